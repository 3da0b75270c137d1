"""KV-cache size when the user set none (`VLLM_CPU_KVCACHE_SPACE` unset or 0,
no `--kv-cache-memory-bytes`).

The host's `CPUWorker` then reserves `--gpu-memory-utilization` (0.92) of its
memory node and refuses to start unless that much is free, which fails on any
machine where other processes hold memory. We keep the host's rule when it
fits, and otherwise take min(4 GiB, 25% of the node's free memory) with a
warning. Readings come from the host's own `get_memory_node_info`, for the
node of the worker's first CPU, exactly what the host's check reads.
"""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.utils.cpu_resource_utils import (
    get_allowed_cpu_list,
    get_memory_node_info,
    get_visible_memory_node,
)

logger = init_logger(f"vllm.{__name__}")

FALLBACK_FRACTION_OF_FREE = 0.25
FALLBACK_MAX_BYTES = 4 << 30
_GiB = float(1 << 30)


def fallback_kv_bytes(total: int, available: int, utilization: float) -> int | None:
    """None when the host's rule fits; else the bytes to use instead."""
    if total * utilization <= available:
        return None
    return int(min(FALLBACK_MAX_BYTES, available * FALLBACK_FRACTION_OF_FREE))


def size_kv_cache_if_unset(vllm_config: VllmConfig) -> None:
    cache_config = vllm_config.cache_config
    if cache_config.kv_cache_memory_bytes is not None:
        return
    node = get_allowed_cpu_list()[0].numa_node
    if node not in get_visible_memory_node():
        node = get_visible_memory_node()[0]
    info = get_memory_node_info(node)
    size = fallback_kv_bytes(
        info.total_memory, info.available_memory, cache_config.gpu_memory_utilization
    )
    if size is None:
        return
    logger.warning(
        "Only %.1f of %.1f GiB is free on memory node %d, less than "
        "--gpu-memory-utilization=%.2f asks for; using %.2f GiB for the KV cache. "
        "Set VLLM_CPU_KVCACHE_SPACE (GiB) to choose.",
        info.available_memory / _GiB, info.total_memory / _GiB, node,
        cache_config.gpu_memory_utilization, size / _GiB,
    )
    cache_config.kv_cache_memory_bytes = size
