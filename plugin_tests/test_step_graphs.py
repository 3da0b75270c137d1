"""Step graphs (cpu_backend.worker.step_graphs): a recorded step replays the
same ops on new inputs, bit for bit against running the module (the reference),
and steps whose Python reads tensor values are left eager."""

from __future__ import annotations

import pytest
import torch

from cpu_backend import ops
from cpu_backend.worker.step_graphs import DataDependentStep, StepGraph, StepGraphs

HIDDEN, VOCAB = 32, 50


@pytest.fixture(autouse=True, scope="module")
def kernels():
    ops.load()  # torch.ops.cpu_backend


class TinyStep(torch.nn.Module):
    """Embedding, a split into views, in-place ops, one of our mutating kernels
    (fused add + RMSNorm) and an allocation, as a decoder layer has them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.norm_weight = torch.nn.Parameter(torch.rand(HIDDEN) + 0.5)

    def forward(self, input_ids, positions):
        x = self.embed(input_ids)
        q, k, v = self.qkv(x).split(HIDDEN, dim=-1)
        hidden = q * positions[:, None].float() + k.sin()
        hidden.add_(v)
        residual = x.clone()
        torch.ops.cpu_backend.fused_add_rms_norm(hidden, residual, self.norm_weight.detach(), 1e-6)
        out = torch.empty_like(hidden)
        torch.mul(hidden, 2.0, out=out)
        return out, residual


def inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g), torch.randint(0, 100, (n,), generator=g)


@torch.inference_mode()
def test_a_recorded_step_replays_new_inputs_like_the_module():
    module = TinyStep()
    ids, pos = inputs(5, seed=1)
    output, graph = StepGraph.record(module, ids, pos)
    assert all(torch.equal(a, b) for a, b in zip(output, module(input_ids=ids, positions=pos)))
    assert graph.op_counts["cpu_backend::fused_add_rms_norm"] == 1
    assert "del " in graph.source  # intermediates are dropped after their last use
    for seed in (2, 3):
        ids, pos = inputs(5, seed)
        want = module(input_ids=ids, positions=pos)
        got = graph.run(ids, pos)
        assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, want))


@torch.inference_mode()
def test_weights_are_referenced_not_copied():
    module = TinyStep()
    ids, pos = inputs(4, seed=1)
    _, graph = StepGraph.record(module, ids, pos)
    module.qkv.weight.mul_(-1.5)  # e.g. weights reloaded in place
    assert torch.equal(graph.run(ids, pos)[0], module(input_ids=ids, positions=pos)[0])


@torch.inference_mode()
def test_python_reading_tensor_values_is_not_recorded():
    def step(input_ids, positions):
        if bool((input_ids > 10).any()):  # a value leaves torch for Python
            return input_ids * 2
        return input_ids

    with pytest.raises(DataDependentStep, match="returns bool"):
        StepGraph.record(step, *inputs(3, seed=1))


@torch.inference_mode()
@pytest.mark.parametrize("select", [
    lambda ids: ids[ids > 10],              # boolean mask
    lambda ids: ids.nonzero(),
    lambda ids: torch.masked_select(ids, ids > 10),
])
def test_shapes_that_depend_on_values_are_not_recorded(select):
    with pytest.raises(DataDependentStep, match="depends on tensor values"):
        StepGraph.record(lambda input_ids, positions: select(input_ids) * 2, *inputs(3, seed=1))


@torch.inference_mode()
def test_integer_indexing_is_recorded():
    table = torch.arange(100.0)
    output, graph = StepGraph.record(lambda input_ids, positions: table[positions] + input_ids,
                                     *inputs(4, seed=1))
    ids, pos = inputs(4, seed=2)
    assert torch.equal(graph.run(ids, pos), table[pos] + ids)


@torch.inference_mode()
def test_step_graphs_capture_each_token_count_once_and_replay_it():
    module = TinyStep()
    graphs = StepGraphs(module, max_tokens=8)
    for n, seed in [(3, 1), (3, 2), (1, 3), (3, 4), (1, 5)]:
        ids, pos = inputs(n, seed)
        got, want = graphs(ids, pos), module(input_ids=ids, positions=pos)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    report = graphs.report()
    assert report["on"] and report["token_counts"] == [1, 3]
    assert report["replays"] == 3
    assert report["op_calls"]["cpu_backend::fused_add_rms_norm"] == 3
    assert graphs.covers(torch.zeros(8, dtype=torch.long), None, None, {})
    assert not graphs.covers(torch.zeros(9, dtype=torch.long), None, None, {})
    assert not graphs.covers(None, None, torch.zeros(1, HIDDEN), {})
    assert not graphs.covers(torch.zeros(1, dtype=torch.long), None, None, {"extra": 1})


@torch.inference_mode()
def test_a_step_that_replays_differently_goes_back_to_eager():
    """Python state outside torch (here a call counter) is baked into a graph;
    the replay check catches it and the runner stays eager, with right outputs."""
    calls = []

    def step(input_ids, positions):
        calls.append(1)
        return input_ids * len(calls)

    graphs = StepGraphs(step)
    ids, pos = inputs(2, seed=1)
    out = graphs(ids, pos)
    assert torch.equal(out, ids * len(calls))  # the output of a plain run
    assert not graphs.enabled and graphs.report()["token_counts"] == []
    assert not graphs.covers(ids, None, None, {})


@torch.inference_mode()
def test_a_failed_capture_goes_back_to_eager():
    def step(input_ids, positions):
        return input_ids + int(positions.sum())  # .item() inside

    graphs = StepGraphs(step)
    ids, pos = inputs(2, seed=1)
    assert torch.equal(graphs(ids, pos), ids + int(pos.sum()))
    assert not graphs.enabled


def runner_like(**changes):
    """The attributes `_why_no_step_graphs` reads, for an engine that qualifies."""
    from types import SimpleNamespace

    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
    from vllm.config import CompilationMode
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    class Traceable(torch.nn.Module, TorchCompileWithNoGuardsWrapper):
        def __init__(self):
            torch.nn.Module.__init__(self)

    model = torch.nn.Module()
    model.inner = Traceable()
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    fields = dict(
        parallel_config=SimpleNamespace(world_size=1, data_parallel_size=1),
        kv_cache_config=SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)]),
        compilation_config=SimpleNamespace(mode=CompilationMode.NONE),
        lora_config=None, speculative_config=None, use_aux_hidden_state_outputs=False,
        model_config=SimpleNamespace(is_encoder_decoder=False, is_multimodal_model=False),
        model=model,
    )
    fields.update(changes)
    return SimpleNamespace(**fields)


def test_which_engines_run_step_graphs(monkeypatch):
    from types import SimpleNamespace

    from vllm.config import CompilationMode
    from vllm.v1.kv_cache_interface import MambaSpec

    from cpu_backend.worker.model_runner import CpuBackendModelRunner

    why_not = CpuBackendModelRunner._why_no_step_graphs
    monkeypatch.delenv("VLLM_CPU_BACKEND_STEP_GRAPHS", raising=False)
    assert why_not(runner_like()) is None
    mamba = MambaSpec(block_size=16, shapes=((1, 1),), dtypes=(torch.float32,))
    for changes, reason in [
        (dict(compilation_config=SimpleNamespace(mode=CompilationMode.VLLM_COMPILE)),
         "torch.compile mode"),
        (dict(parallel_config=SimpleNamespace(world_size=2, data_parallel_size=1)), "parallel ranks"),
        (dict(lora_config=object()), "LoRA"),
        (dict(speculative_config=object()), "speculative decoding"),
        (dict(model=torch.nn.Linear(2, 2)), "a model the host cannot trace once"),
        (dict(kv_cache_config=SimpleNamespace(
            kv_cache_groups=[SimpleNamespace(kv_cache_spec=mamba)])),
         "layers with state beside the KV cache"),
    ]:
        assert why_not(runner_like(**changes)) == reason, changes
    monkeypatch.setenv("VLLM_CPU_BACKEND_STEP_GRAPHS", "0")
    assert why_not(runner_like()) == "VLLM_CPU_BACKEND_STEP_GRAPHS=0"
