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
