"""KV-cache sizing and memory accounting in real engines (cpu_backend.worker.memory).

- Accounting: after start-up the worker's resident memory is what the plan
  saw (weights and runtime) plus the KV cache it allocated, within the
  profiled activation peak plus RSS_MARGIN; the allocated KV is the planned
  size rounded down to whole blocks; the activation peak holds the step
  graphs' buffers for every token count they may capture.
- Bad sizes stop `vllm serve` before it listens, with the setting named:
  more than the machine has, and less than one max_model_len sequence.
- KV exhaustion: more concurrent long requests than the cache holds are
  preempted and resumed (preemptions counted), and every one completes with
  the tokens it gets when run alone.
"""

from __future__ import annotations

import random

import pytest

from cpu_backend.worker import huge_pages
from cpu_backend.worker.model_runner import GRAPH_BUFFER_MIN_BYTES, GRAPH_BUFFER_TOKEN_ROWS
from integration.conftest import greedy, report, running_llm
from integration.server import run_vllm

MiB = 1 << 20
RSS_MARGIN = 96 * MiB


def test_rss_after_start_is_weights_runtime_plus_kv(tiny_llama, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    with running_llm(tiny_llama, dtype="float32") as llm:
        greedy(llm, [[5, 6, 7]], max_tokens=2)
        greedy(llm, [[5 + i, 6, 7] for i in range(8)], max_tokens=2)
        rep = report(llm)
        mem, graphs = rep["memory"], rep["step_graphs"]
    print({k: (v / MiB if isinstance(v, int) else v) for k, v in mem.items()})
    assert mem["kv_source"] == "VLLM_CPU_KVCACHE_SPACE"
    assert mem["kv_planned"] == MiB * 1024
    assert mem["kv_planned"] - 64 * 1024 < mem["kv_allocated"] <= mem["kv_planned"]
    assert mem["rss_at_plan"] > mem["weights"]
    expected = mem["rss_at_plan"] + mem["kv_allocated"]
    assert abs(mem["rss_now"] - expected) <= mem["activation_peak"] + RSS_MARGIN, (mem, expected)
    # The profiled peak includes a reserve for the step graphs' buffers: their
    # size per token, measured in the graphs captured, for every count up to
    # their limit (StepGraphs captures no more than the reserve holds).
    assert graphs["token_counts"], graphs
    per_token = graphs["buffer_bytes"] / sum(graphs["token_counts"])
    assert 0 < per_token * GRAPH_BUFFER_TOKEN_ROWS <= graphs["buffer_budget"], graphs
    assert graphs["buffer_budget"] <= mem["activation_peak"], (graphs, mem)
    assert graphs["buffer_budget"] >= GRAPH_BUFFER_MIN_BYTES, graphs
    if huge_pages.thp_mode() != "never":  # most of the 1 GiB buffer faulted in 2 MiB pages
        assert mem["kv_huge_pages"] >= mem["kv_allocated"] // 2, mem


@pytest.mark.parametrize(
    "args, space, expected",
    [
        # caught before the weights load (worker/binding.py); KV sizing checks again after profiling
        ([], "100000", "GiB free (within the container's memory limit, if any), but this rank needs 100000.00 GiB (0.00 GiB weight shard + 100000.00 GiB KV cache). "
                       "Lower VLLM_CPU_KVCACHE_SPACE"),
        (["--kv-cache-memory-bytes", "10000"], None,
         "--kv-cache-memory-bytes=10000 gives 0.00 GiB of KV cache, less than one sequence of max_model_len=1024 needs"),
    ],
    ids=["too-large", "too-small"],
)
def test_bad_kv_size_stops_serve_with_the_setting_named(tiny_llama, args, space, expected):
    code, out = run_vllm(
        ["serve", tiny_llama, "--max-model-len", "1024", "--port", "1", *args],
        env={"VLLM_CPU_KVCACHE_SPACE": space}, timeout=600,
    )
    assert code != 0
    assert expected in out, out[-3000:]
    assert "Application startup complete" not in out


def test_kv_exhaustion_preempts_and_every_request_completes(tiny_llama, monkeypatch):
    # tiny-llama, fp32: 2 layers x 2 KV heads x 32 x 2 (K, V) x 4 B = 1 KiB per
    # token: 26 blocks of 16 = 416 tokens, for 8 x 180 wanted.
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 700) for _ in range(60)] for _ in range(8)]
    with running_llm(
        tiny_llama, dtype="float32", block_size=16, max_model_len=256,
        kv_cache_memory_bytes=26 * 16 * 1024, enable_prefix_caching=False, disable_log_stats=False,
    ) as llm:
        assert report(llm)["memory"]["num_blocks"] == 26
        together = greedy(llm, prompts, 120)
        preemptions = sum(
            m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"
        )
        alone = [greedy(llm, [p], 120)[0] for p in prompts]
    print(f"preemptions: {preemptions}")
    assert preemptions > 0
    for i, (t, a) in enumerate(zip(together, alone)):
        assert len(t.outputs[0].token_ids) == 120
        assert list(t.outputs[0].token_ids) == list(a.outputs[0].token_ids), f"request {i}"
