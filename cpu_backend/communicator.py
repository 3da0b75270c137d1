"""Our device communicator: replaces the host's
`vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator`.

Why: the host's shared-memory all-reduce lives in its `_C` builds (missing
from the AVX2 one) and leaves segments behind when a rank dies before
shutdown. Ours keeps the host class (gather, all2all, the vLLM protocol) and
swaps its `dist_module` for tensor-parallel groups whose ranks share one host:

- one POSIX shared-memory segment per group, two buffer sets (alternating by
  call) of one slot per rank plus one sequence counter per rank;
- all_reduce: copy into own slot, publish the sequence number, wait for all
  ranks, sum the slots in rank order (identical results on every rank);
- all_gather: the same exchange, then copy the slots out;
- naming: `cpubk-<engine ident>-<group>-<creator pid>`; rank 0 unlinks any
  segment of the same name (and any whose creator process is dead) before
  creating, and every rank unlinks right after all have mapped it, so nothing
  is left in /dev/shm whatever happens later (crash, kill -9).

Groups spanning hosts, other groups (pp, dp, ...) and tensors larger than a
slot use torch.distributed (gloo), as the host does. Ordering of data and
counters relies on x86's total store order; elsewhere gloo is used.
"""

from __future__ import annotations

import mmap
import os
import platform
import socket
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from vllm.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase,
)
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")

SHM_DIR = Path("/dev/shm")
PREFIX = "cpubk-"
SLOT_BYTES = int(os.environ.get("CPU_BACKEND_SHM_SLOT_MB", "8")) << 20
_CACHE_LINE = 64
_HEADER = 4096  # counters, one cache line per rank (at most 64 ranks)
TIMEOUT_S = float(os.environ.get("CPU_BACKEND_SHM_TIMEOUT_S", "600"))


class ShmTimeout(RuntimeError):
    pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink our segments whose creator process no longer exists."""
    removed = []
    for path in shm_dir.glob(PREFIX + "*"):
        try:
            pid = int(path.name.rsplit("-", 1)[1])
        except (IndexError, ValueError):
            continue
        if not _pid_alive(pid):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


class ShmGroup:
    """Shared-memory all-reduce / all-gather for `world_size` ranks on one host."""

    def __init__(self, name: str, rank: int, world_size: int, barrier, slot_bytes: int = SLOT_BYTES):
        assert world_size * _CACHE_LINE <= _HEADER
        self.rank, self.world_size, self.slot_bytes = rank, world_size, slot_bytes
        self.size = _HEADER + 2 * world_size * slot_bytes
        path = SHM_DIR / name
        if rank == 0:
            cleanup_stale()
            path.unlink(missing_ok=True)  # a leftover of the same name
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, self.size)
        barrier()
        if rank != 0:
            fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        barrier()
        # Everyone has it mapped: the name can go now, the memory stays.
        path.unlink(missing_ok=True)
        self.name = name
        counters = np.frombuffer(self._mm, dtype=np.int64, count=_HEADER // 8)
        self._counters = counters[:: _CACHE_LINE // 8][:world_size]
        self._counters[rank] = 0
        self._seq = 0
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        barrier()

    def _slot(self, parity: int, rank: int, nbytes: int) -> torch.Tensor:
        start = _HEADER + (parity * self.world_size + rank) * self.slot_bytes
        return self._bytes[start:start + nbytes]

    def fits(self, t: torch.Tensor) -> bool:
        return t.numel() * t.element_size() <= self.slot_bytes

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Publish `t`, wait for every rank's, return views of all slots."""
        self._seq += 1
        seq, parity = self._seq, self._seq & 1
        flat = t.contiguous().view(-1)
        nbytes = flat.numel() * flat.element_size()
        self._slot(parity, self.rank, nbytes).view(t.dtype).copy_(flat)
        self._counters[self.rank] = seq
        counters = self._counters
        spins = 0
        deadline = None
        while (counters < seq).any():
            spins += 1
            if spins > 1000:
                # Oversubscribed cores: let the peer run.
                os.sched_yield()
                if deadline is None:
                    deadline = time.monotonic() + TIMEOUT_S
                elif spins % 4096 == 0 and time.monotonic() > deadline:
                    raise ShmTimeout(
                        f"shared-memory collective {self.name}: no answer from ranks "
                        f"{np.nonzero(counters < seq)[0].tolist()} within {TIMEOUT_S:.0f} s "
                        "(CPU_BACKEND_SHM_TIMEOUT_S)"
                    )
        return [self._slot(parity, r, nbytes).view(t.dtype) for r in range(self.world_size)]

    def all_reduce(self, t: torch.Tensor) -> None:
        slots = self._exchange(t)
        out = t.view(-1) if t.is_contiguous() else torch.empty_like(t).view(-1)
        torch.add(slots[0], slots[1], out=out)
        for s in slots[2:]:
            out.add_(s)
        if not t.is_contiguous():
            t.copy_(out.view(t.shape))

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        slots = self._exchange(input)
        out = output.view(self.world_size, -1)
        for r, s in enumerate(slots):
            out[r].copy_(s)

    def close(self) -> None:
        self._bytes = None
        self._counters = None
        try:
            self._mm.close()
        except BufferError:
            pass  # views still alive; the mapping goes with the process


class _ShmDistModule:
    """The `dist_module` interface `CpuCommunicator` calls, on shared memory
    where a tensor fits, torch.distributed otherwise."""

    def __init__(self, group: ShmGroup):
        self.group = group

    def all_reduce(self, input: torch.Tensor, group: ProcessGroup | None = None) -> None:
        if self.group.fits(input):
            self.group.all_reduce(input)
        else:
            dist.all_reduce(input, group=group)

    def all_gather_into_tensor(self, output, input, group: ProcessGroup | None = None) -> None:
        if self.group.fits(input) and output.is_contiguous():
            self.group.all_gather_into_tensor(output, input)
        else:
            dist.all_gather_into_tensor(output, input, group=group)

    def gather(self, input, gather_list, dst: int = -1, group=None) -> None:
        dist.gather(input, gather_list, dst=dst, group=group)


def _host_id() -> str:
    boot = Path("/proc/sys/kernel/random/boot_id")
    return socket.gethostname() + ":" + (boot.read_text().strip() if boot.exists() else "")


def shm_usable() -> bool:
    """`CPU_BACKEND_SHM=0` forces gloo (to compare, or to test the multi-host path)."""
    if os.environ.get("CPU_BACKEND_SHM", "1").strip() == "0":
        return False
    return platform.machine() in ("x86_64", "AMD64") and SHM_DIR.is_dir()


class CpuBackendCommunicator(CpuCommunicator):
    def __init__(
        self,
        cpu_group: ProcessGroup,
        device: torch.device | None = None,
        device_group: ProcessGroup | None = None,
        unique_name: str = "",
        use_all2all: bool = False,
    ):
        # The host's __init__ would set up its own `_C` shared memory; we take
        # the base class's and choose the dist module ourselves.
        DeviceCommunicatorBase.__init__(
            self, cpu_group, device, device_group, unique_name, use_all2all=use_all2all
        )
        self.dist_module = dist
        self.supports_tensor_dict = False
        self.shm: ShmGroup | None = None
        if unique_name.startswith("tp") and self.world_size > 1:
            self._try_shared_memory()
        if self.use_all2all:
            from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager

            self.all2all_manager = AgRsAll2AllManager(self.cpu_group)

    def _try_shared_memory(self) -> None:
        hosts = [None] * self.world_size
        dist.all_gather_object(hosts, (_host_id(), shm_usable()), group=self.cpu_group)
        if len({h for h, _ in hosts}) != 1 or not all(ok for _, ok in hosts):
            logger.info("Group %s spans hosts (or has no /dev/shm): all-reduce over gloo.",
                        self.unique_name)
            return
        ident = os.environ.get("VLLM_DIST_IDENT", "local").replace("/", "_")
        creator = [os.getpid()]
        dist.broadcast_object_list(creator, src=self.ranks[0], group=self.cpu_group)
        name = f"{PREFIX}{ident}-{self.unique_name}-{creator[0]}"
        self.shm = ShmGroup(
            name, self.rank_in_group, self.world_size,
            barrier=lambda: dist.barrier(group=self.cpu_group),
        )
        self.dist_module = _ShmDistModule(self.shm)
        logger.info("Group %s: shared-memory all-reduce/all-gather over %d ranks (%s).",
                    self.unique_name, self.world_size, name)

    def destroy(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        super().destroy()
