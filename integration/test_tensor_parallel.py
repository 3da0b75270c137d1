"""Tensor parallel with our worker and shared-memory communicator:
`tensor_parallel_size=2, distributed_executor_backend="mp"` on this machine
(one core per rank, planned by `VLLM_CPU_OMP_THREADS_BIND=auto` on one NUMA
node) gives the same fp32 greedy tokens as TP=1.

Two engines, ~3 minutes here.
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


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_tp2_matches_tp1_and_binds_one_core_per_rank(tiny_llama, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    prompts = _prompts()
    with running_llm(tiny_llama, dtype="float32") as llm:
        want = [o.outputs[0].token_ids for o in greedy(llm, prompts, NEW_TOKENS)]
    with running_llm(tiny_llama, dtype="float32", tensor_parallel_size=2,
                     distributed_executor_backend="mp") as llm:
        got = [o.outputs[0].token_ids for o in greedy(llm, prompts, NEW_TOKENS)]
        reports = llm.collective_rpc("cpu_backend_report")
    assert got == want
    assert [r["worker"] for r in reports] == ["CpuBackendWorker"] * 2
    # Our shared-memory all-reduce served the TP group.
    assert [r["communicator"] for r in reports] == ["_ShmDistModule"] * 2
    cpus = sorted(os.sched_getaffinity(0))
    for rank, rep in enumerate(reports):
        assert rep["bound_cpus"] == [cpus[rank]]
        assert rep["torch_threads"] == 1
        # Every thread of the rank (OpenMP pool included) stays on its core.
        assert rep["thread_cpus"] == [cpus[rank]]
