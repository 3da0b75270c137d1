"""Worker-side binding helpers (cpu_backend.worker.binding): the memory-fit
check's numbers and what a process's threads are bound to."""

from __future__ import annotations

import os

import pytest

from cpu_backend.worker import binding


def test_weights_plus_kv_over_node_free_memory_is_refused_with_numbers():
    gib = 1 << 30
    binding.check_node_fits(weights_bytes=3 * gib, kv_bytes=1 * gib, node=1, free_bytes=5 * gib)
    with pytest.raises(binding.NodeMemoryError) as err:
        binding.check_node_fits(weights_bytes=3 * gib, kv_bytes=4 * gib, node=1,
                                free_bytes=5 * gib)
    msg = str(err.value)
    assert "NUMA node 1 has 5.00 GiB free" in msg
    assert "7.00 GiB (3.00 GiB weight shard + 4.00 GiB KV cache)" in msg
    assert "VLLM_CPU_KVCACHE_SPACE" in msg


def test_checkpoint_bytes_counts_weight_files(tmp_path):
    assert binding.checkpoint_bytes(str(tmp_path / "missing")) is None
    assert binding.checkpoint_bytes("org/remote-name") is None
    (tmp_path / "model-00001.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "model-00002.safetensors").write_bytes(b"x" * 50)
    (tmp_path / "config.json").write_text("{}")
    assert binding.checkpoint_bytes(str(tmp_path)) == 150


def test_thread_cpus_within_the_affinity_mask():
    assert set(binding.thread_cpus()) == set(os.sched_getaffinity(0))


PIN_SCRIPT = """
import json, os, sys, torch
from cpu_backend import topology
from cpu_backend.worker import binding
torch.ones(1 << 16).sum()  # the OpenMP pool exists, on every CPU, before binding
cpus = tuple(json.loads(sys.argv[1]))
before = binding.omp_thread_cpus()
binding.apply(topology.RankBinding(local_rank=0, cpus=cpus, node=0, nodes=(0,)))
after = binding.omp_thread_cpus()
try:
    torch.ops.cpu_backend.pin_threads([10**6, cpus[0]])
    error = None
except RuntimeError as e:
    error = str(e).splitlines()[0]
print("RESULT " + json.dumps({"before": before, "after": after,
                              "threads": torch.get_num_threads(), "error": error}))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_apply_pins_one_running_openmp_thread_per_cpu():
    """Without OMP_PLACES (a worker in an already started process) the pool
    that already exists is pinned one thread per CPU, in the rank's order."""
    import json
    import subprocess
    import sys

    cpus = sorted(os.sched_getaffinity(0))[:2][::-1]
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_PLACES", "KMP_AFFINITY", "GOMP_CPU_AFFINITY", "OMP_NUM_THREADS")}
    proc = subprocess.run([sys.executable, "-c", PIN_SCRIPT, json.dumps(cpus)], env=env,
                          capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    got = json.loads(lines[0].removeprefix("RESULT "))
    assert all(len(c) > 1 for c in got["before"]), got  # not pinned before
    assert got["threads"] == 2 and got["after"] == [[cpus[0]], [cpus[1]]], got
    assert "CPU 1000000: Invalid argument" in got["error"], got


def test_rank_binding_follows_the_planned_lists(monkeypatch):
    from types import SimpleNamespace

    cpus = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", str(cpus[0]))
    cfg = SimpleNamespace(data_parallel_size=1, local_world_size=1)
    b = binding.rank_binding(cfg, 0)
    assert b.cpus == (cpus[0],) and b.nodes == (b.node,)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert binding.rank_binding(cfg, 0) is None
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", str(cpus[0]))
    assert binding.rank_binding(SimpleNamespace(data_parallel_size=2, local_world_size=1), 0) is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
@pytest.mark.parametrize("bind, reserved, executor", [
    ("all", None, "cpu_backend.worker.thread_executor.WorkerThreadExecutor"),  # no CPU of its own for the engine
    ("auto", "1", "uni"),  # one CPU left to the frontend: the worker on the engine's thread
])
def test_worker_in_engine_runs_on_its_own_thread_only_when_bound_to_every_cpu(bind, reserved, executor,
                                                                              monkeypatch):
    from types import SimpleNamespace

    from cpu_backend import platform

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    for name in ("VLLM_CPU_NUM_OF_RESERVED_CPU", "KMP_BLOCKTIME", "KMP_TPAUSE"):
        monkeypatch.delenv(name, raising=False)  # restored afterwards
    if reserved is not None:
        monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", reserved)
    parallel_config = SimpleNamespace(distributed_executor_backend="uni")
    platform._keep_worker_in_engine_process(parallel_config)
    assert parallel_config.distributed_executor_backend == executor
