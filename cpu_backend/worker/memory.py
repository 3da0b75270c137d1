"""KV-cache sizing for one worker rank: the memory profiler behind
`VLLM_CPU_KVCACHE_SPACE`.

Replaces the sizing in the host's `CPUWorker.__init__` /
`determine_available_memory`, which reserves `--gpu-memory-utilization`
(0.92) of the memory node's *total* and refuses to start unless that much is
free (any machine where other processes hold memory), ignores container
limits and the activation peak, and lets a KV size that cannot hold one
`max_model_len` sequence through to a later, generic error.

- `VLLM_CPU_KVCACHE_SPACE=N` (GiB, or `--kv-cache-memory-bytes`): that much,
  checked before anything is allocated: it plus the profiled activation peak
  and a safety margin must fit in the memory available to the rank, and it
  must hold one `max_model_len` sequence. Errors name the variable, the
  request and what is available / needed.
- Unset or 0: automatic. The rank may use `--gpu-memory-utilization` of its
  memory limit (the NUMA node's memory, or the container's cgroup limit if
  lower, split evenly between the ranks bound to that node); the KV cache gets that minus the process's resident memory
  (weights, runtime) minus the activation peak minus a safety margin, and
  never more than the memory free right now minus the same peak and margin.
- The activation peak is measured: the peak-RSS counter is reset
  (`/proc/self/clear_refs`), one dummy forward of `PROFILE_TOKENS` tokens
  runs, and the growth is scaled to `max_num_batched_tokens`; plus, where
  steps run from captured graphs, the same growth per token for the 2080
  token-rows their buffers may hold (`model_runner.GRAPH_BUFFER_TOKEN_ROWS`,
  at least `GRAPH_BUFFER_MIN_BYTES`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from cpu_backend import envs

GiB = float(1 << 30)
PROFILE_TOKENS = 256
# Left free for what "available" memory counts but cannot give: the page cache
# that the running processes' libraries live in, and the sibling processes (API
# server, engine core). 512 MiB on a 24 GiB VM let a `--gpu-memory-utilization
# 0.99` server evict those pages and get the worker OOM-killed.
SAFETY_MARGIN_MIN = 1 << 30  # bytes
SAFETY_MARGIN_FRACTION = 0.05  # of the rank's memory limit


class KVCacheSizeError(ValueError):
    """The KV cache cannot be sized as asked; the message says what fits."""


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


# --- process and container readings ----------------------------------------


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    return _status_kib("VmRSS") << 10


def peak_rss_bytes() -> int:
    return _status_kib("VmHWM") << 10


def reset_peak_rss() -> bool:
    """Set the peak-RSS counter to the current RSS (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def cgroup_memory(root: str = "/sys/fs/cgroup") -> tuple[int | None, int | None]:
    """(limit, usage) in bytes of this process's memory cgroup; None = no
    limit / unknown. cgroup v2 (memory.max) or v1 (memory.limit_in_bytes)."""
    base = Path(root)
    candidates = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hierarchy, controllers, path = line.split(":", 2)
            if controllers == "" or "memory" in controllers.split(","):
                rel = path.lstrip("/")
                candidates += [base / rel, base / "memory" / rel]
    except OSError:
        pass
    candidates += [base, base / "memory"]
    for d in candidates:
        for limit_file, usage_file in (("memory.max", "memory.current"),
                                       ("memory.limit_in_bytes", "memory.usage_in_bytes")):
            try:
                raw = (d / limit_file).read_text().strip()
            except OSError:
                continue
            usage = None
            try:
                usage = int((d / usage_file).read_text().strip())
            except (OSError, ValueError):
                pass
            if raw == "max" or not raw.isdigit() or int(raw) >= 1 << 60:
                return None, usage
            return int(raw), usage
    return None, None


# --- the plan ----------------------------------------------------------------


@dataclass(frozen=True)
class MemoryReadings:
    node: int
    node_total: int
    node_available: int
    cgroup_limit: int | None
    cgroup_usage: int | None
    rss: int  # this process, now (weights loaded)

    @property
    def limit(self) -> int:
        """What this rank may occupy at most: the node, or the container."""
        return min(self.node_total, self.cgroup_limit or self.node_total)

    @property
    def free_now(self) -> int:
        free = self.node_available
        if self.cgroup_limit is not None and self.cgroup_usage is not None:
            free = min(free, self.cgroup_limit - self.cgroup_usage)
        return max(free, 0)

    def describe(self) -> str:
        text = f"memory node {self.node}: {gib(self.node_available)} free of {gib(self.node_total)}"
        if self.cgroup_limit is not None:
            used = gib(self.cgroup_usage) if self.cgroup_usage is not None else "?"
            text += f"; container limit {gib(self.cgroup_limit)}, {used} used"
        return text


@dataclass(frozen=True)
class KVPlan:
    kv_bytes: int
    source: str  # "VLLM_CPU_KVCACHE_SPACE" | "--kv-cache-memory-bytes" | "automatic"
    activation_peak: int
    margin: int
    bytes_per_block: int  # all layers
    block_size: int
    max_model_len: int
    readings: MemoryReadings

    @property
    def num_blocks(self) -> int:
        return self.kv_bytes // self.bytes_per_block

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        return self.num_tokens / self.max_model_len

    def summary(self) -> str:
        return (
            f"KV cache {gib(self.kv_bytes)} ({self.source}): {self.num_blocks} blocks of "
            f"{self.block_size} tokens = {self.num_tokens} tokens, max concurrency "
            f"{self.max_concurrency:.2f}x at max_model_len={self.max_model_len}; "
            f"activation peak {gib(self.activation_peak)}, margin {gib(self.margin)}, "
            f"process RSS {gib(self.readings.rss)}; {self.readings.describe()}"
        )


def min_kv_bytes(bytes_per_block: int, block_size: int, max_model_len: int) -> int:
    """Bytes for one sequence of max_model_len tokens."""
    return math.ceil(max_model_len / block_size) * bytes_per_block


def explicit_source() -> str:
    return envs.KVCACHE_SPACE if envs.kvcache_space_bytes() is not None else "--kv-cache-memory-bytes"


def plan_kv_cache(
    readings: MemoryReadings,
    requested: int | None,
    utilization: float,
    activation_peak: int,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    shares: int = 1,
) -> KVPlan:
    """The KV size for one rank, or KVCacheSizeError. `requested` None = auto;
    `shares`: ranks splitting this memory node."""
    limit, free_now = readings.limit // shares, readings.free_now // shares
    margin = max(SAFETY_MARGIN_MIN, int(SAFETY_MARGIN_FRACTION * limit))
    room = free_now - activation_peak - margin
    needed = min_kv_bytes(bytes_per_block, block_size, max_model_len)
    if requested is not None:
        source = explicit_source()
        asked = (
            f"{source}={os.environ.get(envs.KVCACHE_SPACE)}"
            if source == envs.KVCACHE_SPACE
            else f"--kv-cache-memory-bytes={requested}"
        )
        if requested > room:
            raise KVCacheSizeError(
                f"{asked} asks for {gib(requested)} of KV cache, but this rank has room for "
                f"{gib(max(room, 0))} ({readings.describe()}{_shared(shares)}; the activation peak "
                f"{gib(activation_peak)} and a {gib(margin)} margin stay free). "
                f"Lower {source} or free memory."
            )
        kv = requested
    else:
        source = "automatic"
        by_fraction = int(utilization * limit) - readings.rss - activation_peak - margin
        kv = min(by_fraction, room)
    if kv < needed:
        what = (
            f"{asked} gives" if requested is not None
            else f"Automatic sizing (--gpu-memory-utilization={utilization}) leaves"
        )
        hint = (
            f"set {envs.KVCACHE_SPACE} to at least {math.ceil(needed / GiB)} "
            f"(or --kv-cache-memory-bytes to at least {needed})"
            if requested is not None
            else "free memory, raise --gpu-memory-utilization"
        )
        raise KVCacheSizeError(
            f"{what} {gib(max(kv, 0))} of KV cache, less than one sequence of "
            f"max_model_len={max_model_len} needs ({gib(needed)}, "
            f"{math.ceil(max_model_len / block_size)} blocks of {block_size} tokens): "
            f"{hint}, or lower --max-model-len. ({readings.describe()})"
        )
    return KVPlan(
        kv_bytes=int(kv), source=source, activation_peak=activation_peak, margin=margin,
        bytes_per_block=bytes_per_block, block_size=block_size, max_model_len=max_model_len,
        readings=readings,
    )


def _shared(shares: int) -> str:
    return f", shared by {shares} ranks" if shares > 1 else ""


def read_memory(node: int) -> MemoryReadings:
    """Readings for `node` through the host's own helper (what it checks)."""
    from vllm.utils.cpu_resource_utils import get_memory_node_info

    info = get_memory_node_info(node)
    limit, usage = cgroup_memory()
    return MemoryReadings(
        node=node, node_total=int(info.total_memory), node_available=int(info.available_memory),
        cgroup_limit=limit, cgroup_usage=usage, rss=rss_bytes(),
    )


def worker_memory_node() -> int:
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_visible_memory_node

    node = get_allowed_cpu_list()[0].numa_node
    visible = get_visible_memory_node()
    return node if node in visible else visible[0]
