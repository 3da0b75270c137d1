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

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from vllm.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase,
)
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
from vllm.logger import init_logger

from cpu_backend.shm_group import PREFIX, ShmGroup, shm_usable

logger = init_logger(f"vllm.{__name__}")


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

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """Out of place, unlike the host's: our platform routes collectives
        through the host's `torch.ops.vllm.all_reduce` custom op, whose output
        must not alias its input (else a compiled graph may read the input
        unreduced)."""
        out = input_.clone()
        self.dist_module.all_reduce(out, group=self.device_group)
        return out

    def destroy(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        super().destroy()
