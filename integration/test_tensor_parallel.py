"""Tensor parallel with our worker and shared-memory communicator:
`tensor_parallel_size=2, distributed_executor_backend="mp"` on this machine
(one core per rank, planned by `VLLM_CPU_OMP_THREADS_BIND=auto` on one NUMA
node) gives the same fp32 greedy tokens as TP=1.

Two engines, ~2.5 minutes here. With `CPU_BACKEND_LONG_TESTS=1` also (one
engine each, ~1.5 minutes each): TP=2 with explicit `VLLM_CPU_OMP_THREADS_BIND="0|1"`,
TP=2 over gloo (`VLLM_CPU_BACKEND_SHM=0`, the path ranks on different hosts take) and
pipeline parallel 2 (gloo send/recv between stages), all against TP=1.

    CPU_BACKEND_LONG_TESTS=1 pytest integration/test_tensor_parallel.py
"""

from __future__ import annotations

import os
import random

import pytest

from integration.conftest import greedy, running_llm

pytestmark = pytest.mark.slow

NEW_TOKENS = 24


def _prompts():
    rng = random.Random(7)
    return [[rng.randrange(3, 700) for _ in range(n)] for n in (3, 17, 40, 9)]


CPUS = sorted(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")


@pytest.fixture(scope="module")
def tp1_tokens(tiny_llama):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
        with running_llm(tiny_llama, dtype="float32") as llm:
            return [o.outputs[0].token_ids for o in greedy(llm, _prompts(), NEW_TOKENS)]


@needs_two_cpus
def test_tp2_matches_tp1_and_binds_one_core_per_rank(tiny_llama, tp1_tokens, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    prompts, want = _prompts(), tp1_tokens
    with running_llm(tiny_llama, dtype="float32", tensor_parallel_size=2,
                     distributed_executor_backend="mp") as llm:
        got = [o.outputs[0].token_ids for o in greedy(llm, prompts, NEW_TOKENS)]
        reports = llm.collective_rpc("cpu_backend_report")
    assert got == want
    assert [r["worker"] for r in reports] == ["CpuBackendWorker"] * 2
    # Our shared-memory all-reduce served the TP group.
    assert [r["communicator"] for r in reports] == ["_ShmDistModule"] * 2
    for rank, rep in enumerate(reports):
        assert rep["bound_cpus"] == [CPUS[rank]]
        assert rep["torch_threads"] == 1
        # Every thread of the rank (OpenMP pool included) stays on its core.
        assert rep["thread_cpus"] == [CPUS[rank]]


@needs_two_cpus
@pytest.mark.skipif(os.environ.get("CPU_BACKEND_LONG_TESTS") != "1",
                    reason="long: set CPU_BACKEND_LONG_TESTS=1")
@pytest.mark.parametrize("name,kwargs,env,communicator", [
    ("tp2-explicit-lists", {"tensor_parallel_size": 2}, {"VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, CPUS[:2]))},
     "_ShmDistModule"),
    ("tp2-gloo", {"tensor_parallel_size": 2}, {"VLLM_CPU_BACKEND_SHM": "0"}, "module"),
    ("pp2-gloo", {"pipeline_parallel_size": 2}, {}, "none"),
])
def test_other_layouts_match_tp1(tiny_llama, tp1_tokens, monkeypatch, name, kwargs, env,
                                 communicator):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with running_llm(tiny_llama, dtype="float32", distributed_executor_backend="mp",
                     **kwargs) as llm:
        got = [o.outputs[0].token_ids for o in greedy(llm, _prompts(), NEW_TOKENS)]
        reports = llm.collective_rpc("cpu_backend_report")
    assert got == tp1_tokens
    # "module": torch.distributed itself (gloo); "none": one rank per TP group.
    assert [r["communicator"] for r in reports] == [communicator] * 2
