"""Shared-memory all-reduce / all-gather for ranks on one host (x86).

Used by cpu_backend.communicator (see its docstring for the protocol and the
clean-up rules). Kept free of vLLM imports so spawned test and benchmark
processes start fast.
"""

from __future__ import annotations

import mmap
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from cpu_backend import envs

SHM_DIR = Path("/dev/shm")
PREFIX = "cpubk-"
_CACHE_LINE = 64
_HEADER = 4096  # counters, one cache line per rank (at most 64 ranks)


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

    def __init__(self, name: str, rank: int, world_size: int, barrier, slot_bytes: int | None = None):
        slot_bytes = slot_bytes or envs.shm_slot_bytes()
        self._timeout_s = envs.shm_timeout_s()
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
                    deadline = time.monotonic() + self._timeout_s
                elif spins % 4096 == 0 and time.monotonic() > deadline:
                    raise ShmTimeout(
                        f"shared-memory collective {self.name}: no answer from ranks "
                        f"{np.nonzero(counters < seq)[0].tolist()} within {self._timeout_s:.0f} s "
                        f"({envs.SHM_TIMEOUT_S})"
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


def shm_usable() -> bool:
    """`VLLM_CPU_BACKEND_SHM=0` forces gloo (to compare, or to test the multi-host path)."""
    if not envs.shm():
        return False
    return platform.machine() in ("x86_64", "AMD64") and SHM_DIR.is_dir()
