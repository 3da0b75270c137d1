"""A tiny random Llama (fp32) through `LLM.generate`, against transformers.

One engine with prefix caching on (vLLM's default) and a 16-token KV block, so
short shared prefixes give cache hits.
"""

from __future__ import annotations

import random

import pytest

from cpu_backend.attention import step_ops
from integration.conftest import greedy, hf_greedy, report, running_llm

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with running_llm(tiny_llama, dtype="float32", block_size=16, enable_prefix_caching=True) as llm:
        yield llm


def random_prompts(lengths, vocab=700, seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def test_current_platform_is_ours():
    from vllm.platforms import current_platform

    from cpu_backend.platform import CpuBackendPlatform

    assert type(current_platform) is CpuBackendPlatform
    assert current_platform.is_cpu()


def test_our_worker_runner_and_attention_ran(llm):
    first = report(llm)
    before = first["attention_forward_calls"]
    greedy(llm, random_prompts([5]), max_tokens=4)
    rep = report(llm)
    assert rep["worker"] == "CpuBackendWorker"
    assert rep["model_runner"] == "CpuBackendModelRunner"
    # vLLM's default, kept by our platform: the checks against transformers
    # in this file run with it.
    assert rep["async_scheduling"] is True
    assert rep["attention_backends"] == ["CPU_BACKEND_ATTN"]
    assert rep["attention_impls"] == ["CpuBackendAttentionImpl"]
    # Our native kernels ran: attention and every linear layer (and the LM head).
    assert rep["kernels_isa"] in ("amx", "avx512", "avx_vnni", "avx2", "portable")
    assert rep["attention_native"] == [True]
    # Greedy sampling ran our argmax (cpu_backend.worker.sampler): one row per
    # step here (1 prefill + 3 decodes of one request); the tokens it picked
    # are checked against transformers in the tests below.
    assert rep["sampler"] == "CpuBackendSampler"
    assert rep["greedy_rows_sampled"] - first["greedy_rows_sampled"] == 4
    assert rep["linear_methods"] == ["CpuBackendLMHeadMethod", "CpuBackendLinearMethod"]
    for providers in rep["rms_norm_providers"].values():
        assert providers[0] == "cpu_backend"
    layers = llm.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers
    # Every layer, every step: 1 prefill + 3 decodes; a step of a token count
    # seen for the first time runs 3 times (recorded, replayed, checked).
    captures = len(rep["step_graphs"]["token_counts"]) - len(first["step_graphs"]["token_counts"])
    assert rep["attention_forward_calls"] - before == layers * (4 + 2 * captures)
    # The host's SiluAndMul / RotaryEmbedding were instantiated as ours
    # (cpu_backend.ops.custom_ops) and our kernels ran in every layer, every step:
    # called from the layers' Python, or replayed from a step graph.
    assert rep["custom_ops"] == ["CpuBackendRotaryEmbedding", "CpuBackendSiluAndMul"]
    calls, calls_before = rep["custom_op_kernel_calls"], first["custom_op_kernel_calls"]
    replayed, replayed_before = rep["step_graphs"]["op_calls"], first["step_graphs"]["op_calls"]
    # (SiLU-and-mul replays with the down projection as one composite call.)
    for name, ops_ in [("CpuBackendRotaryEmbedding", ["cpu_backend::rotary_embedding"]),
                       ("CpuBackendSiluAndMul", ["cpu_backend::silu_and_mul",
                                                 "cpu_backend::silu_and_mul_linear_out"])]:
        ran = calls[name] - calls_before.get(name, 0) + sum(
            replayed.get(op, 0) - replayed_before.get(op, 0) for op in ops_)
        assert ran >= layers * 4, (name, calls, replayed)


def test_small_steps_replay_captured_graphs(llm, tiny_llama):
    """Steps of up to 16 tokens run from graphs captured on first sight, and the
    tokens they give match transformers."""
    before = report(llm)["step_graphs"]
    prompts = random_prompts([3, 8, 11], seed=5)
    got = [list(o.outputs[0].token_ids) for o in greedy(llm, prompts, NEW_TOKENS)]
    graphs = report(llm)["step_graphs"]
    assert graphs["on"] is True
    # The decode steps of the 3 requests (the 22-token prefill runs eagerly).
    assert 3 in graphs["token_counts"], graphs
    replays = graphs["replays"] - before["replays"]
    assert replays >= NEW_TOKENS - 3, (before, graphs)
    # In the graphs, every layer's attention (with its KV-cache write) ran as a
    # direct call of our kernels (cpu_backend.attention.step_ops), not through
    # the host's attention ops.
    layers = llm.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers
    op = step_ops.ATTENTION
    assert graphs["op_calls"][op] - before["op_calls"].get(op, 0) == layers * replays, graphs
    assert not [op for op in graphs["op_calls"] if op.startswith("vllm::")], graphs
    # Each layer's norms (but the first layer's input norm) and SiLU-and-mul
    # ran with the linear after them as one call (step_graphs._PROLOGUES).
    for op, per_step in [("cpu_backend::fused_add_rms_norm_linear_out", 2 * layers - 1),
                         ("cpu_backend::silu_and_mul_linear_out", layers)]:
        assert graphs["op_calls"][op] - before["op_calls"].get(op, 0) == per_step * replays, graphs
    assert got == hf_greedy(tiny_llama, prompts, NEW_TOKENS)


def test_larger_steps_replay_one_graph_for_every_count(llm, tiny_llama):
    """Steps of more than step_graphs.MAX_TOKENS tokens (prefills here): two
    of different counts are recorded, a third checks the graph made of them
    against eager, later ones of any count replay it; the tokens match
    transformers."""
    before = report(llm)["step_graphs"]
    prompts = random_prompts([70, 90, 110, 130, 75], seed=7)
    got = [list(greedy(llm, [p], 4)[0].outputs[0].token_ids) for p in prompts]
    graphs = report(llm)["step_graphs"]
    assert graphs["generic"]["on"] and graphs["generic"]["checked"], graphs["generic"]
    assert graphs["generic"]["replays"] - before["generic"]["replays"] >= 2, (before, graphs)
    assert got == hf_greedy(tiny_llama, prompts, 4)


def test_batch_of_different_lengths_matches_transformers(llm, tiny_llama):
    prompts = random_prompts([1, 2, 7, 15, 16, 17, 33, 64, 100, 5], seed=2)
    got = [o.outputs[0].token_ids for o in greedy(llm, prompts, NEW_TOKENS)]
    want = hf_greedy(tiny_llama, prompts, NEW_TOKENS)
    for i, (g, w) in enumerate(zip(got, want)):
        assert list(g) == w, f"prompt {i} (len {len(prompts[i])}) diverged"


def test_shared_prefix_hits_the_prefix_cache_and_matches(llm, tiny_llama):
    prefix = random_prompts([48], seed=3)[0]  # 3 full blocks of 16
    tails = random_prompts([3, 9, 1, 20], seed=4)
    prompts = [prefix + t for t in tails]
    greedy(llm, [prefix + [5]], max_tokens=1)  # fills the cache with the prefix
    outs = greedy(llm, prompts, NEW_TOKENS)
    assert all(o.num_cached_tokens >= 48 for o in outs), [o.num_cached_tokens for o in outs]
    want = hf_greedy(tiny_llama, prompts, NEW_TOKENS)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
