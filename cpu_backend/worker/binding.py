"""Per-worker CPU and memory binding, and the memory-fit check before weights load.

With several ranks the host's multiprocessing executor starts each worker with
`OMP_PLACES`/`OMP_PROC_BIND` (or `KMP_AFFINITY`/`GOMP_CPU_AFFINITY`) for the
explicit CPU list our platform planned (cpu_backend.topology), so the OpenMP
runtime pins one thread per CPU (the host does this for a single rank too). A
worker inside an already running process (the engine core, a single rank's
default, see VLLM_CPU_BACKEND_WORKER_IN_ENGINE; or the caller's with
VLLM_ENABLE_V1_MULTIPROCESSING=0) finds its OpenMP runtime started before any
placement could be set: there the pool's threads pin themselves one per CPU
(our `pin_threads` op, csrc/threads.cpp). Here the
worker recomputes the plan, sets the thread count, pins, binds memory to the
rank's node with the host's `init_cpu_memory_env` op, and reports where the
OpenMP threads really run.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from vllm.logger import init_logger

from cpu_backend import ops, topology
from cpu_backend.worker import memory

logger = init_logger(f"vllm.{__name__}")


class NodeMemoryError(RuntimeError):
    """The rank's weights and KV cache do not fit its NUMA node's free memory."""


def rank_binding(parallel_config, local_rank: int) -> topology.RankBinding | None:
    """This rank's share of the plan the engine process validated. The
    affinity mask is left out: OpenMP has already narrowed it to this rank's
    first place, which would make the other ranks' CPUs look forbidden.
    None with `nobind`, and with data parallel (the host plans that itself)."""
    if parallel_config.data_parallel_size > 1:
        return None
    topo = topology.discover()
    topo = dataclasses.replace(topo, affinity=topo.online)
    plan = topology.plan_from_env(parallel_config.local_world_size, topo)
    return plan.ranks[local_rank] if plan.ranks else None


def ranks_on_node(parallel_config, binding: topology.RankBinding | None) -> int:
    """How many of this host's ranks share `binding`'s NUMA node (they split
    its memory); all local ranks when unbound."""
    if binding is None:
        return max(parallel_config.local_world_size, 1)
    topo = topology.discover()
    topo = dataclasses.replace(topo, affinity=topo.online)
    plan = topology.plan_from_env(parallel_config.local_world_size, topo)
    return max(sum(r.node == binding.node for r in plan.ranks), 1)


def _placement_from_env() -> bool:
    return any(k in os.environ for k in ("OMP_PLACES", "KMP_AFFINITY", "GOMP_CPU_AFFINITY"))


def apply(binding: topology.RankBinding | None) -> None:
    if binding is None:
        return
    if torch.get_num_threads() != len(binding.cpus):
        torch.set_num_threads(len(binding.cpus))
    if not _placement_from_env():
        # Threads started later by this thread inherit its mask: the rank's CPUs
        # until the pool pins itself (the calling thread is thread 0 of the pool).
        topology.note_binding(os.sched_getaffinity(0))
        os.sched_setaffinity(0, binding.cpus)
        ops.load()
        torch.ops.cpu_backend.pin_threads(list(binding.cpus))
    # The host's CPUWorker already bound memory to the node of this process's
    # first allowed CPU; rebind (the host's op, libnuma membind) only when the
    # rank's main node differs, e.g. a list spanning nodes.
    first_node = topology.discover().node_of.get(min(os.sched_getaffinity(0)))
    if binding.node != first_node and hasattr(torch.ops._C, "init_cpu_memory_env"):
        torch.ops._C.init_cpu_memory_env([binding.node])


def omp_thread_cpus() -> list[list[int]]:
    """Per OpenMP thread of this process's pool, the CPUs it may run on."""
    ops.load()
    mask = torch.ops.cpu_backend.thread_affinity()
    return [row.nonzero().flatten().tolist() for row in mask]


def thread_cpus() -> list[int]:
    """Union of the CPUs the OpenMP threads (the ones that run the model) may
    run on."""
    return sorted({cpu for cpus in omp_thread_cpus() for cpu in cpus})


def log_binding(rank: int, local_rank: int, binding: topology.RankBinding | None) -> None:
    if binding is None:
        logger.info(
            "cpu_backend rank %d (local %d): VLLM_CPU_OMP_THREADS_BIND=nobind, %d threads, "
            "CPUs %s", rank, local_rank, torch.get_num_threads(),
            topology.format_cpu_list(os.sched_getaffinity(0)),
        )
        return
    logger.info(
        "cpu_backend rank %d (local %d): %d OpenMP threads bound to CPUs %s on NUMA node %s; "
        "memory bound to node %d; threads run on CPUs %s",
        rank, local_rank, torch.get_num_threads(), topology.format_cpu_list(binding.cpus),
        ",".join(map(str, binding.nodes)), binding.node,
        topology.format_cpu_list(thread_cpus()),
    )


def checkpoint_bytes(model_path: str) -> int | None:
    """Bytes of the weight files of a local checkpoint; None when unknown."""
    path = Path(model_path)
    if not path.is_dir():
        return None
    files = list(path.glob("*.safetensors")) or list(path.glob("*.bin")) or list(path.glob("*.pt"))
    return sum(f.stat().st_size for f in files) or None


def check_node_fits(*, weights_bytes: int, kv_bytes: int, node: int, free_bytes: int) -> None:
    """Only this rank is counted: ranks sharing a node load at the same time and
    the free memory read already reflects whichever loaded first."""
    need = weights_bytes + kv_bytes
    if need > free_bytes:
        raise NodeMemoryError(
            f"NUMA node {node} has {free_bytes / memory.GiB:.2f} GiB free (within the container's "
            f"memory limit, if any), but this rank needs "
            f"{need / memory.GiB:.2f} GiB ({weights_bytes / memory.GiB:.2f} GiB weight shard + "
            f"{kv_bytes / memory.GiB:.2f} GiB KV cache). Lower VLLM_CPU_KVCACHE_SPACE, use a "
            "larger --tensor-parallel-size, or bind ranks to other nodes "
            "(VLLM_CPU_OMP_THREADS_BIND)."
        )


def check_before_load(vllm_config, binding: topology.RankBinding | None) -> None:
    """Weight shard + KV against the node's free memory, before loading."""
    model_config = vllm_config.model_config
    size = checkpoint_bytes(model_config.model)
    if size is None:
        logger.debug("Memory-fit check skipped: no local checkpoint at %s", model_config.model)
        return
    # `dtype` first: reading `torch_dtype` makes transformers log a deprecation line.
    ckpt_dtype = getattr(model_config.hf_config, "dtype", None) or getattr(
        model_config.hf_config, "torch_dtype", None)
    if isinstance(ckpt_dtype, str):
        ckpt_dtype = getattr(torch, ckpt_dtype, None)
    if isinstance(ckpt_dtype, torch.dtype):
        size = size * model_config.dtype.itemsize // ckpt_dtype.itemsize
    tp = vllm_config.parallel_config.tensor_parallel_size
    pp = vllm_config.parallel_config.pipeline_parallel_size
    weights = size // (tp * pp)
    kv = vllm_config.cache_config.kv_cache_memory_bytes or 0
    node = binding.node if binding is not None else memory.worker_memory_node()
    # The same reading the KV plan uses after loading: the node, capped by a
    # container's limit.
    free = memory.read_memory(node).free_now
    check_node_fits(weights_bytes=weights, kv_bytes=kv, node=node, free_bytes=free)
    logger.info(
        "cpu_backend: node %d has %.2f GiB free for this rank's %.2f GiB weight shard + "
        "%.2f GiB KV cache.", node, free / memory.GiB, weights / memory.GiB, kv / memory.GiB,
    )
