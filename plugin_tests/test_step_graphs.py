"""Step graphs (cpu_backend.worker.step_graphs): a recorded step replays the
same ops on new inputs, bit for bit against running the module (the reference),
and steps whose Python reads tensor values are left eager."""

from __future__ import annotations

import pytest
import torch

from cpu_backend import ops, stats
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
def test_views_that_change_nothing_are_not_replayed():
    """view(x, x.shape) and detach(x) read as x itself; real views and an
    in-place kernel writing through an elided view still replay like eager."""
    weight = torch.rand(HIDDEN) + 0.5

    def step(input_ids, positions):
        x = torch.empty(input_ids.shape[0], HIDDEN).detach()          # elided detach
        torch.mul(positions[:, None].float(), weight, out=x)
        same = x.view(-1, HIDDEN).reshape(input_ids.shape[0], HIDDEN)  # two elided views
        residual = input_ids[:, None].float().expand(-1, HIDDEN).contiguous()
        torch.ops.cpu_backend.fused_add_rms_norm(same, residual, weight, 1e-6)
        return x.view(-1, 4, HIDDEN // 4), residual                   # a real view

    output, graph = StepGraph.record(step, *inputs(3, seed=1))
    assert "aten::detach" not in graph.op_counts and "aten::reshape" not in graph.op_counts
    assert graph.op_counts["aten::view"] == 1, graph.op_counts
    assert graph.op_counts["aten::empty.memory_format"] == 1
    assert torch.Tensor.view in graph.run.__globals__.values()  # the parser path, not the boxed op
    for seed in (2, 3):
        ids, pos = inputs(3, seed)
        want, got = step(ids, pos), graph.run(ids, pos)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert got[0].shape == (3, 4, HIDDEN // 4)


@torch.library.custom_op("step_graph_test::copy", mutates_args=())
def _foreign_copy(x: torch.Tensor) -> torch.Tensor:
    """An op from outside aten and ours: it might keep a reference to x."""
    return x.clone()


class BufferStep(torch.nn.Module):
    """A decoder layer's activation traffic: our linear (which allocates its
    result) split into q/k/v and viewed as heads, an `empty` our RMSNorm
    writes, a second linear whose result the step returns."""

    def __init__(self, foreign_reader: bool = False):
        super().__init__()
        torch.manual_seed(3)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.qkv = torch.ops.cpu_backend.pack_linear_weight(torch.randn(3 * HIDDEN, HIDDEN) / 8)
        self.proj = torch.ops.cpu_backend.pack_linear_weight(torch.randn(HIDDEN, HIDDEN) / 8)
        self.norm_weight = torch.rand(HIDDEN) + 0.5
        self.foreign_reader = foreign_reader

    def forward(self, input_ids, positions):
        q, k, v = torch.ops.cpu_backend.linear(self.embed(input_ids), self.qkv, 3 * HIDDEN).split(HIDDEN, -1)
        heads = [t.view(-1, 4, HIDDEN // 4) for t in (q, k, v)]
        mixed = (heads[0] * heads[1] + heads[2]).flatten(1)
        normed = torch.empty(input_ids.shape[0], HIDDEN)
        torch.ops.cpu_backend.rms_norm(normed, mixed, self.norm_weight, 1e-6)
        if self.foreign_reader:
            normed = _foreign_copy(normed)
        return torch.ops.cpu_backend.linear(normed, self.proj, HIDDEN)


@torch.inference_mode()
@pytest.mark.parametrize("foreign_reader", [False, True])
def test_activations_live_in_buffers_preallocated_at_capture(foreign_reader):
    """Scratch memory (our linear's result, an `empty`) read only by aten's and
    our ops becomes a buffer the graph owns, and views of it constants; the
    returned tensor and memory another op reads stay fresh every step, so a
    step's result survives the next step."""
    module = BufferStep(foreign_reader)
    _, graph = StepGraph.record(module, *inputs(3, seed=1))
    counts = graph.op_counts
    assert counts["cpu_backend::linear"] == 2
    assert "aten::split_with_sizes" not in counts and "aten::view" not in counts, counts
    # fresh each step: the result, and the `empty` the foreign op reads
    assert counts["aten::empty.memory_format"] == 1 + foreign_reader, counts
    ids, pos = inputs(3, seed=2)
    first = graph.run(ids, pos)
    kept = first.clone()
    assert torch.equal(first, module(ids, pos))
    ids, pos = inputs(3, seed=3)
    assert torch.equal(graph.run(ids, pos), module(ids, pos))
    assert torch.equal(first, kept)


class PrologueStep(torch.nn.Module):
    """A decoder layer's in-place ops right before our linears that read their
    result (residual add + RMSNorm before gate_up, SiLU-and-mul before down),
    and two norms that must stay calls of their own: one whose result another
    op reads first, one followed by a linear reading a different tensor."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.gate_up = torch.ops.cpu_backend.pack_linear_weight(torch.randn(4 * HIDDEN, HIDDEN) / 8)
        self.gate_up_bias = torch.randn(4 * HIDDEN)
        self.down = torch.ops.cpu_backend.pack_linear_weight(torch.randn(HIDDEN, 2 * HIDDEN) / 8)
        self.proj = torch.ops.cpu_backend.pack_linear_weight(torch.randn(HIDDEN, HIDDEN) / 8)
        self.norm_weight = torch.rand(HIDDEN) + 0.5

    def forward(self, input_ids, positions):
        ops_ = torch.ops.cpu_backend
        x = self.embed(input_ids)
        residual = positions[:, None].float().expand(-1, HIDDEN).contiguous()
        ops_.fused_add_rms_norm(x, residual, self.norm_weight, 1e-6)
        gate_up = ops_.linear(x, self.gate_up, 4 * HIDDEN, self.gate_up_bias)
        act = torch.empty(input_ids.shape[0], 2 * HIDDEN)
        ops_.silu_and_mul(act, gate_up)
        down = ops_.linear(act, self.down, HIDDEN)
        ops_.fused_add_rms_norm(down, residual, self.norm_weight, 1e-6)
        scaled = down * 2  # read before the linear: no composite
        out = ops_.linear(down, self.proj, HIDDEN)
        ops_.fused_add_rms_norm(out, residual, self.norm_weight, 1e-6)
        return ops_.linear(residual, self.proj, HIDDEN) + scaled  # reads residual, not out


@torch.inference_mode()
def test_prologue_and_linear_replay_as_one_call():
    """fused_add_rms_norm or silu_and_mul right before our linear reading what
    it wrote replays as one composite call (csrc/prologue_linear.cpp), bit for
    bit like the module's two calls; any other order keeps both calls."""
    module = PrologueStep()
    _, graph = StepGraph.record(module, *inputs(3, seed=1))
    counts = graph.op_counts
    assert counts["cpu_backend::fused_add_rms_norm_linear_out"] == 1, counts
    assert counts["cpu_backend::silu_and_mul_linear_out"] == 1, counts
    assert counts["cpu_backend::fused_add_rms_norm"] == 2, counts
    assert "cpu_backend::silu_and_mul" not in counts and counts["cpu_backend::linear"] == 2, counts
    for n, seed in ((3, 2), (3, 3)):
        ids, pos = inputs(n, seed)
        assert torch.equal(graph.run(ids, pos), module(ids, pos))


class QuantizedPrologueStep(torch.nn.Module):
    """The prologues before our int4 (GPTQ; act-order W4A8) and W8A8 linears:
    residual add + RMSNorm and SiLU-and-mul, each before both."""

    def __init__(self):
        super().__init__()
        from cpu_backend.quantization import formats

        torch.manual_seed(5)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.norm_weight = torch.rand(HIDDEN) + 0.5

        def int4(n, k, perm=None):
            v = formats.quantize_rtn(torch.randn(n, k) / 8, 4, 32, True, perm)
            return formats.kernel_layout(v["q"], v["zero"], v["scale"], v["g_idx"], 4), n

        def int8(n, k):
            return formats.int8_kernel_layout(torch.randint(-127, 128, (n, k), dtype=torch.int8),
                                              torch.rand(n) / 256), n

        self.gate_up = int4(4 * HIDDEN, HIDDEN)
        self.down = int8(HIDDEN, 2 * HIDDEN)
        self.down_bias = torch.randn(HIDDEN)
        self.gate_up2 = int8(4 * HIDDEN, HIDDEN)
        self.down2 = int4(HIDDEN, 2 * HIDDEN, perm=torch.randperm(2 * HIDDEN))

    @staticmethod
    def int4_linear(x, layer, int8_act=False):
        lay, n = layer
        return torch.ops.cpu_backend.wna16_linear(x, lay["qweight"], lay["scales"], lay["zs"], 4,
                                                  lay["group_size"], n, lay["perm"], int8_act=int8_act)

    @staticmethod
    def int8_linear(x, layer, bias=None):
        lay, n = layer
        return torch.ops.cpu_backend.w8a8_linear(x, lay["qweight"], lay["wsum"], lay["w_scale"], n,
                                                 bias=bias)

    def forward(self, input_ids, positions):
        ops_ = torch.ops.cpu_backend
        n = input_ids.shape[0]
        x = self.embed(input_ids)
        residual = positions[:, None].float().expand(-1, HIDDEN).contiguous()
        ops_.fused_add_rms_norm(x, residual, self.norm_weight, 1e-6)
        gate_up = self.int4_linear(x, self.gate_up)
        act = torch.empty(n, 2 * HIDDEN)
        ops_.silu_and_mul(act, gate_up)
        down = self.int8_linear(act, self.down, bias=self.down_bias)
        ops_.fused_add_rms_norm(down, residual, self.norm_weight, 1e-6)
        gate_up2 = self.int8_linear(down, self.gate_up2)
        act2 = torch.empty(n, 2 * HIDDEN)
        ops_.silu_and_mul(act2, gate_up2)
        return self.int4_linear(act2, self.down2, int8_act=True) + residual


@torch.inference_mode()
def test_prologues_and_quantized_linears_replay_as_one_call():
    module = QuantizedPrologueStep()
    _, graph = StepGraph.record(module, *inputs(3, seed=1))
    counts = graph.op_counts
    for composite in ("fused_add_rms_norm_wna16_linear_out", "silu_and_mul_w8a8_linear_out",
                      "fused_add_rms_norm_w8a8_linear_out", "silu_and_mul_wna16_linear_out"):
        assert counts[f"cpu_backend::{composite}"] == 1, counts
    assert not {"cpu_backend::fused_add_rms_norm", "cpu_backend::silu_and_mul"} & set(counts), counts
    for n, seed in ((3, 2), (3, 3)):
        ids, pos = inputs(n, seed)
        assert torch.equal(graph.run(ids, pos), module(ids, pos))


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
    assert graphs.covers(torch.zeros(9, dtype=torch.long), None, None, {})  # the graph for larger steps
    assert not StepGraphs(module, max_tokens=8, generic=False).covers(
        torch.zeros(9, dtype=torch.long), None, None, {})
    assert not graphs.covers(None, None, torch.zeros(1, HIDDEN), {})
    assert not graphs.covers(torch.zeros(1, dtype=torch.long), None, None, {"extra": 1})


def _same_outputs(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return torch.equal(got, want)
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


@torch.inference_mode()
def test_steps_above_max_tokens_share_one_graph_for_every_count():
    """Two steps of different counts above max_tokens are recorded (their
    integer arguments as slope * T + offset), the graph is checked against
    eager at a third count, then replays every count; steps of the recorded
    counts run eagerly until the check. Outputs always equal the module's."""
    module = TinyStep()
    graphs = StepGraphs(module, max_tokens=4)
    # (count, whether the graph for larger steps is checked after the step)
    plan = [(9, False), (9, False), (13, False), (13, False), (11, True), (6, True), (30, True),
            (9, True), (2, True)]
    for seed, (n, checked) in enumerate(plan):
        ids, pos = inputs(n, seed)
        assert _same_outputs(graphs(ids, pos), module(input_ids=ids, positions=pos)), n
        assert graphs.report()["generic"]["checked"] == checked, n
    report = graphs.report()
    assert report["generic"] == {"on": True, "checked": True, "above": 4, "replays": 3}
    assert report["token_counts"] == [2] and report["replays"] == 3
    assert report["op_calls"]["cpu_backend::fused_add_rms_norm"] == 3
    assert "T = input_ids.shape[0]" in graphs.generic.source


@torch.inference_mode()
def test_sizes_not_linear_in_the_token_count_keep_larger_steps_eager():
    """A size that is not slope * T + offset (here T * T // 8) is caught (by
    the fit, or by the check at a third count): larger steps stay eager, with
    right outputs, and the graphs of small counts are unaffected."""
    def step(input_ids, positions):
        count = input_ids.shape[0]
        return input_ids.float().sum() + torch.ones(count * count // 8), positions * 2

    graphs = StepGraphs(step, max_tokens=4)
    for seed, n in enumerate([6, 9, 13, 17, 23, 3, 3, 31]):
        ids, pos = inputs(n, seed)
        assert _same_outputs(graphs(ids, pos), step(ids, pos)), n
    report = graphs.report()
    assert report["generic"]["on"] is False and graphs.generic is None
    assert report["token_counts"] == [3] and report["replays"] == 1 and graphs.enabled
    assert not graphs.covers(torch.zeros(9, dtype=torch.long), None, None, {})


@torch.inference_mode()
def test_a_larger_step_whose_python_branches_on_the_count_is_caught_by_the_check():
    """Recorded at 6 and 8 tokens, the graph is wrong from 10 tokens on (the
    step's Python takes another branch there): the check against eager at the
    third count finds it, and larger steps stay eager with right outputs."""
    def step(input_ids, positions):
        scale = 3.0 if input_ids.shape[0] >= 10 else 2.0
        return input_ids.float() * scale + positions

    graphs = StepGraphs(step, max_tokens=4)
    for seed, n in enumerate([6, 8, 12, 14, 7]):
        ids, pos = inputs(n, seed)
        assert torch.equal(graphs(ids, pos), step(ids, pos)), n
    assert graphs.report()["generic"] == {"on": False, "checked": False, "above": 4, "replays": 0}


@torch.inference_mode()
def test_larger_token_counts_are_captured_when_seen_again():
    """Above capture_at_first a count's first steps run eagerly (a one-off
    prefill costs no capture); its capture_at_sighting-th step captures, later
    ones replay."""
    module = TinyStep()
    graphs = StepGraphs(module, max_tokens=8, capture_at_first=2, capture_at_sighting=2)
    for n, seed, counts in [(5, 1, []), (2, 2, [2]), (5, 3, [2, 5]), (5, 4, [2, 5]), (7, 5, [2, 5])]:
        ids, pos = inputs(n, seed)
        got, want = graphs(ids, pos), module(input_ids=ids, positions=pos)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert graphs.report()["token_counts"] == counts
    assert graphs.report()["replays"] == 1


@torch.inference_mode()
def test_graphs_stop_capturing_where_their_buffers_would_outgrow_the_budget():
    """The budget the KV sizing left for graph buffers: a count whose graph
    would not fit runs eagerly (right outputs), the graphs already kept stay;
    a first graph larger than the whole budget is not kept either."""
    module = BufferStep(foreign_reader=False)
    per_token = StepGraph.record(module, *inputs(1, seed=1))[1].buffer_bytes
    assert per_token > 0
    assert StepGraph.record(module, *inputs(3, seed=1))[1].buffer_bytes == 3 * per_token

    graphs = StepGraphs(module, max_tokens=8, buffer_budget=3 * per_token)
    for n, seed, counts in [(1, 1, [1]), (2, 2, [1, 2]), (3, 3, [1, 2]), (1, 4, [1, 2]),
                            (3, 5, [1, 2])]:
        ids, pos = inputs(n, seed)
        assert torch.equal(graphs(ids, pos), module(ids, pos))
        assert graphs.report()["token_counts"] == counts
    report = graphs.report()
    assert report["buffer_bytes"] == 3 * per_token == report["buffer_budget"]
    assert report["replays"] == 1 and graphs.enabled

    small = StepGraphs(module, max_tokens=8, buffer_budget=per_token - 1)
    ids, pos = inputs(1, seed=6)
    assert torch.equal(small(ids, pos), module(ids, pos))
    assert small.report()["token_counts"] == [] and small.report()["buffer_bytes"] == 0
    assert small.enabled


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
    # At profiling time (the graph-buffer reserve) the KV cache is not set up yet.
    assert why_not(runner_like(kv_cache_config=None), kv_cache_known=False) is None
    monkeypatch.setenv("VLLM_CPU_BACKEND_STEP_GRAPHS", "0")
    assert why_not(runner_like()) == "VLLM_CPU_BACKEND_STEP_GRAPHS=0"


def test_profile_reserves_graph_buffers_even_without_measured_growth(monkeypatch):
    """The KV sizing's activation peak holds the step graphs' reserve: the
    profile step's growth per token for every count the graphs may capture,
    and at least GRAPH_BUFFER_MIN_BYTES where the step showed no growth (its
    memory already held by the allocator); the graphs get it as their budget."""
    from types import SimpleNamespace

    from cpu_backend.worker import memory
    from cpu_backend.worker.model_runner import (GRAPH_BUFFER_MIN_BYTES, GRAPH_BUFFER_TOKEN_ROWS,
                                                 CpuBackendModelRunner)

    rss = {"now": 1 << 30, "peak": 1 << 30}
    monkeypatch.setattr(memory, "rss_bytes", lambda: rss["now"])
    monkeypatch.setattr(memory, "peak_rss_bytes", lambda: rss["peak"])
    monkeypatch.setattr(memory, "reset_peak_rss", lambda: True)
    for growth_per_token, graphs_on in [(0, True), (100_000, True), (100_000, False)]:
        runner = SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_batched_tokens=4096),
            _dummy_run=lambda n, g=growth_per_token: rss.update(peak=rss["now"] + n * g),
            _why_no_step_graphs=lambda kv_cache_known, on=graphs_on: None if on else "LoRA")
        peak = CpuBackendModelRunner.profile_activation_peak(runner)
        reserve = max(growth_per_token * GRAPH_BUFFER_TOKEN_ROWS, GRAPH_BUFFER_MIN_BYTES) if graphs_on else 0
        assert runner._cpu_backend_graph_buffer_budget == reserve
        assert peak == growth_per_token * 4096 + reserve


# --- the host's attention ops, lowered to our kernels (attention.step_ops) ---

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 4, 2, 64, 16


class HostAttentionStep(torch.nn.Module):
    """A step that calls the host's attention op the way vLLM's Attention does
    for our backend (which writes the KV cache in its forward: no update op)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.embed = torch.nn.Embedding(VOCAB, (HEADS + 2 * KV_HEADS) * HEAD_SIZE)

    def forward(self, input_ids, positions):
        q, k, v = self.embed(input_ids).split(
            [HEADS * HEAD_SIZE, KV_HEADS * HEAD_SIZE, KV_HEADS * HEAD_SIZE], dim=-1)
        q, k, v = (t.reshape(t.shape[0], -1, HEAD_SIZE) for t in (q, k, v))
        out = torch.empty_like(q)
        torch.ops.vllm.unified_attention_with_output(q, k, v, out, "layer0")
        return out


def attention_context(kv_cache, positions, blocks):
    """What the host's forward context holds for one layer: the layer (our impl,
    its cache and scales), its metadata and slot mapping; one request per token."""
    from types import SimpleNamespace

    from cpu_backend.attention.impl import CpuBackendAttentionImpl

    impl = CpuBackendAttentionImpl(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, KV_HEADS, None, None, "auto")
    layer = SimpleNamespace(impl=impl, kv_cache=kv_cache, _k_scale_float=1.0, _v_scale_float=1.0)
    pos = torch.tensor(positions, dtype=torch.int32)
    table = torch.tensor([[b] for b in blocks], dtype=torch.int32)
    slots = table[:, 0].long() * BLOCK + pos.long()
    metadata = SimpleNamespace(token_req=torch.arange(len(positions), dtype=torch.int32),
                               token_pos=pos, block_table=table, slot_mapping=slots)
    return SimpleNamespace(attn_metadata={"layer0": metadata}, slot_mapping={"layer0": slots},
                           no_compile_layers={"layer0": layer})


@torch.inference_mode()
def test_host_attention_op_is_recorded_as_calls_of_our_kernels():
    """Recorded, the host's attention op becomes a direct call of our kernels
    that reads the step's slots and metadata when it runs: a replay in another
    step's context writes the cache and attends exactly as the host's op does."""
    import vllm.model_executor.layers.attention.attention  # noqa: F401  (registers the host ops)
    from vllm.forward_context import override_forward_context

    from cpu_backend.attention import step_ops

    module = HostAttentionStep()
    cache = torch.randn(4, KV_HEADS, BLOCK, 2 * HEAD_SIZE)
    ids, pos = inputs(2, seed=7)
    with override_forward_context(attention_context(cache.clone(), [5, 9], [0, 1])):
        _, graph = StepGraph.record(module, ids, pos, lower=step_ops.lower)
    assert graph.op_counts[step_ops.ATTENTION] == 1
    assert not [op for op in graph.op_counts if op.startswith("vllm::")], graph.op_counts

    ids, pos = inputs(2, seed=8)  # the next step: other tokens, positions, blocks
    replayed = attention_context(cache.clone(), [12, 3], [2, 3])
    reference = attention_context(cache.clone(), [12, 3], [2, 3])
    calls = stats.get("attention_forward")
    with override_forward_context(replayed):
        got = graph.run(ids, pos)
    assert stats.get("attention_forward") == calls + 1
    with override_forward_context(reference):
        want = module(ids, pos)
    assert torch.equal(got, want)
    assert torch.equal(replayed.no_compile_layers["layer0"].kv_cache,
                       reference.no_compile_layers["layer0"].kv_cache)
    assert not torch.equal(replayed.no_compile_layers["layer0"].kv_cache, cache)


@torch.inference_mode()
def test_attention_ops_stay_host_ops_off_our_native_path():
    import vllm.model_executor.layers.attention.attention  # noqa: F401
    from vllm.forward_context import override_forward_context

    from cpu_backend.attention import step_ops

    context = attention_context(torch.zeros(4, KV_HEADS, BLOCK, 2 * HEAD_SIZE), [5], [0])
    q = torch.zeros(1, HEADS, HEAD_SIZE)
    kv = torch.zeros(1, KV_HEADS, HEAD_SIZE)
    attention = torch.ops.vllm.unified_attention_with_output.default
    with override_forward_context(context):
        impl = context.no_compile_layers["layer0"].impl
        impl._native = True
        assert step_ops.lower(attention, (q, kv, kv, q.clone(), "layer0"), {}) is not None
        # fused output quantization: the host op's business
        assert step_ops.lower(attention, (q, kv, kv, q.clone(), "layer0", q), {}) is None
        assert step_ops.lower(torch.ops.aten.add.Tensor, (q, q), {}) is None
        impl._native = False  # the PyTorch path (e.g. a cache dtype the kernel lacks)
        assert step_ops.lower(attention, (q, kv, kv, q.clone(), "layer0"), {}) is None
