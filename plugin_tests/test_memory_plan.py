"""KV-cache sizing (cpu_backend.worker.memory): the plan from readings, the
errors, and the cgroup reader on fake cgroup trees."""

from __future__ import annotations

import pytest

from cpu_backend.worker import memory
from cpu_backend.worker.memory import KVCacheSizeError, MemoryReadings, plan_kv_cache

GiB = 1 << 30
MiB = 1 << 20


def readings(total=64, available=40, rss=2, limit=None, usage=None):
    return MemoryReadings(
        node=0, node_total=int(total * GiB), node_available=int(available * GiB),
        cgroup_limit=None if limit is None else int(limit * GiB),
        cgroup_usage=None if usage is None else int(usage * GiB), rss=int(rss * GiB),
    )


def plan(r, requested=None, utilization=0.9, activation=256 * MiB, per_block=MiB, block=16, max_len=4096,
         shares=1):
    return plan_kv_cache(r, requested, utilization, activation, per_block, block, max_len, shares)


def test_automatic_takes_the_fraction_minus_process_activations_and_margin():
    p = plan(readings(total=64, available=60, rss=2))
    margin = int(0.05 * 64 * GiB)
    assert p.kv_bytes == int(0.9 * 64 * GiB) - 2 * GiB - 256 * MiB - margin
    assert p.source == "automatic"
    assert p.num_blocks == p.kv_bytes // MiB and p.num_tokens == 16 * p.num_blocks
    assert "max concurrency" in p.summary()


def test_automatic_never_takes_more_than_is_free_now():
    p = plan(readings(total=64, available=10, rss=2))
    assert p.kv_bytes == 10 * GiB - 256 * MiB - int(0.05 * 64 * GiB)


def test_container_limit_caps_the_automatic_size():
    p = plan(readings(total=64, available=60, rss=2, limit=8, usage=3))
    # free in the container: 5 GiB; the fraction of 8 GiB minus RSS: 5.2 GiB
    assert p.kv_bytes == 5 * GiB - 256 * MiB - GiB
    assert "container limit 8.00 GiB" in p.summary()


def test_explicit_size_too_large_names_the_variable(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "40")
    with pytest.raises(KVCacheSizeError, match=r"VLLM_CPU_KVCACHE_SPACE=40 asks for 40.00 GiB.*room for 6\.55 GiB"):
        plan(readings(total=64, available=10), requested=40 * GiB)


def test_explicit_size_too_small_for_one_sequence_says_the_minimum(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    # 4096 tokens / 16 = 256 blocks of 1 MiB = 0.25 GiB
    with pytest.raises(KVCacheSizeError, match=r"--kv-cache-memory-bytes=107374182 gives 0\.10 GiB.*less than one sequence.*0\.25 GiB.*at least 1 \(or --kv-cache-memory-bytes to at least 268435456\)"):
        plan(readings(), requested=int(0.1 * GiB))
    assert plan(readings(), requested=GiB // 4).kv_bytes == GiB // 4


def test_cli_bytes_are_named_when_the_variable_is_unset(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    with pytest.raises(KVCacheSizeError, match="--kv-cache-memory-bytes="):
        plan(readings(available=1), requested=4 * GiB)


def test_automatic_too_small_explains(monkeypatch):
    with pytest.raises(KVCacheSizeError, match="Automatic sizing.*lower --max-model-len"):
        plan(readings(total=64, available=1, rss=2), max_len=1 << 20)


@pytest.mark.parametrize(
    "files, proc_cgroup, want",
    [
        ({"memory.max": "8589934592\n", "memory.current": "1073741824\n"}, "0::/\n", (8 * GiB, GiB)),
        ({"memory.max": "max\n", "memory.current": "5\n"}, "0::/\n", (None, 5)),
        ({"kube/pod1/memory.max": "4294967296", "kube/pod1/memory.current": "0"}, "0::/kube/pod1\n", (4 * GiB, 0)),
        ({"memory/memory.limit_in_bytes": "2147483648", "memory/memory.usage_in_bytes": "7"},
         "4:memory:/\n", (2 * GiB, 7)),
        ({"memory/memory.limit_in_bytes": "9223372036854771712"}, "4:memory:/\n", (None, None)),
    ],
)
def test_cgroup_memory_reads_v1_and_v2(tmp_path, monkeypatch, files, proc_cgroup, want):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    real_read_text = memory.Path.read_text

    def read_text(self, *a, **k):
        if str(self) == "/proc/self/cgroup":
            return proc_cgroup
        return real_read_text(self, *a, **k)

    monkeypatch.setattr(memory.Path, "read_text", read_text)
    assert memory.cgroup_memory(str(tmp_path)) == want


def test_process_readings_are_live():
    assert memory.rss_bytes() > 10 * MiB
    assert memory.peak_rss_bytes() >= memory.rss_bytes() - MiB


def test_ranks_on_one_node_split_its_memory():
    one = plan(readings(total=64, available=60, rss=2))
    two = plan(readings(total=64, available=60, rss=2), shares=2)
    assert two.kv_bytes == int(0.9 * 32 * GiB) - 2 * GiB - 256 * MiB - int(0.05 * 32 * GiB)
    assert two.kv_bytes < one.kv_bytes / 2 + GiB
