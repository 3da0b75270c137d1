"""CPU topology discovery and the per-rank CPU plan for `VLLM_CPU_OMP_THREADS_BIND`.

One module reads everything the binding needs from sysfs/procfs under a root
path (tests pass fake trees): online and offline CPUs, NUMA nodes and their
CPUs and memory, physical cores (hyper-thread siblings), the process affinity
mask and the cgroup cpuset (v1 and v2). libnuma is not needed: the kernel
exposes the same facts in sysfs; the memory binding itself uses the host's
`init_cpu_memory_env` op (libnuma inside the host's `_C`).

Why not the host's `vllm.utils.ompmultiprocessing.OMPProcessManager` planner:
it reads `lscpu` (no fake trees), its `auto` needs one NUMA node per rank
(TP=2 fails on a one-node box), it does not know `all`, and bad lists fail on
an `assert`. We compute the plan here and hand the host explicit per-rank lists
(see `cpu_backend.platform`), which it turns into `OMP_PLACES` per worker.

Policies (documented in docs/threads_and_tp.md):
- `auto`: usable CPUs = online ∩ affinity ∩ cpuset; one CPU per physical core
  (lowest id, siblings left out); ranks get whole NUMA nodes when there are at
  least as many nodes as ranks, else each node's cores are split evenly among
  `ranks / nodes` ranks. Reserved CPUs come off the ends of the last ranks;
  by default one per rank that keeps at least two (so a 2-core machine
  computes on both: measured, docs/threads_and_tp.md "Default plan").
- `all`: as `auto` but hyper-thread siblings included and nothing reserved.
- `nobind`: no plan; OpenMP and the OS decide.
- lists: `0-3,8|4-7`, one list per local rank.
- A rank whose CPUs span NUMA nodes is allowed with a warning (sub-NUMA
  clustering and small VMs make it legitimate); its memory is bound to the node
  holding most of its CPUs.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from cpu_backend.envs import (
    NUM_OF_RESERVED_CPU,
    OMP_THREADS_BIND,
    EnvError,
    format_cpu_list,
    num_reserved_cpus,
    parse_cpu_list,
)


@dataclass(frozen=True)
class Topology:
    online: frozenset[int]
    offline: frozenset[int]
    node_of: dict[int, int]  # online CPU -> NUMA node
    core_of: dict[int, tuple[int, int]]  # online CPU -> (package, core id)
    affinity: frozenset[int]  # process affinity mask
    cpuset: frozenset[int] | None  # cgroup cpuset, None when unconstrained/unknown
    mems_allowed: tuple[int, ...]  # memory nodes this process may use
    node_free_bytes: dict[int, int] = field(default_factory=dict)
    node_total_bytes: dict[int, int] = field(default_factory=dict)

    @property
    def allowed(self) -> frozenset[int]:
        """CPUs this process may run on: online ∩ affinity ∩ cpuset."""
        cpus = self.online & self.affinity
        return cpus & self.cpuset if self.cpuset is not None else cpus

    @property
    def nodes(self) -> list[int]:
        return sorted({self.node_of[c] for c in self.allowed})

    def cpus_of_node(self, node: int) -> list[int]:
        return sorted(c for c in self.allowed if self.node_of[c] == node)

    def one_per_core(self, cpus) -> list[int]:
        """The lowest-id CPU of each physical core among `cpus`."""
        first: dict[tuple[int, int], int] = {}
        for c in sorted(cpus):
            first.setdefault(self.core_of[c], c)
        return sorted(first.values())

    def main_node(self, cpus) -> int:
        return Counter(self.node_of[c] for c in cpus).most_common(1)[0][0]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_ids(path: Path) -> list[int] | None:
    text = _read(path)
    return None if text is None else parse_cpu_list(text, name=str(path))


def _status_field(root: Path, key: str) -> str | None:
    text = _read(root / "proc/self/status") or ""
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip()
    return None


def _cgroup_cpuset(root: Path) -> frozenset[int] | None:
    """Effective cpuset of this process's cgroup (v2 unified, else v1)."""
    cgroups = _read(root / "proc/self/cgroup") or ""
    for line in cgroups.splitlines():
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":  # v2
            base = root / "sys/fs/cgroup" / rel
            ids = _read_ids(base / "cpuset.cpus.effective")
            if ids is not None and ids:
                return frozenset(ids)
        elif "cpuset" in controllers.split(","):  # v1
            base = root / "sys/fs/cgroup/cpuset" / rel
            for name in ("cpuset.effective_cpus", "cpuset.cpus"):
                ids = _read_ids(base / name)
                if ids:
                    return frozenset(ids)
    return None


def _node_memory(node_dir: Path) -> tuple[int, int] | None:
    """(free, total) bytes of a node, counting page cache as free as the host does."""
    text = _read(node_dir / "meminfo")
    if text is None:
        return None
    kb = {}
    for line in text.splitlines():
        parts = line.split()  # "Node 0 MemFree: 123 kB"
        if len(parts) >= 4:
            kb[parts[2].rstrip(":")] = int(parts[3])
    free = sum(kb.get(k, 0) for k in ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable"))
    return free * 1024, kb.get("MemTotal", 0) * 1024


# The process's affinity mask before our worker bound this thread to its rank's
# CPUs (with the worker in the engine, a single rank's default, the engine-core process
# re-validates its config after its worker bound it): what the process may use.
_affinity_before_binding: frozenset[int] | None = None


def note_binding(previous_affinity) -> None:
    """Called by the worker before it narrows this thread's affinity."""
    global _affinity_before_binding
    if _affinity_before_binding is None:
        _affinity_before_binding = frozenset(previous_affinity)


def discover(root: str | os.PathLike = "/", affinity=None) -> Topology:
    """Read the topology under `root`. With the real root the affinity mask
    comes from `os.sched_getaffinity` (as it was before our worker bound this
    thread); under a fake root from its proc/self/status (`Cpus_allowed_list`)."""
    root = Path(root)
    cpu_dir = root / "sys/devices/system/cpu"
    present = _read_ids(cpu_dir / "present") or _read_ids(cpu_dir / "possible") or []
    online = _read_ids(cpu_dir / "online")
    if online is None:
        online = sorted(int(p.name[3:]) for p in cpu_dir.glob("cpu[0-9]*")) or present
    offline = set(_read_ids(cpu_dir / "offline") or []) | (set(present) - set(online))

    node_of: dict[int, int] = {}
    free: dict[int, int] = {}
    total: dict[int, int] = {}
    node_root = root / "sys/devices/system/node"
    for node_dir in sorted(node_root.glob("node[0-9]*")):
        node = int(node_dir.name[4:])
        for c in _read_ids(node_dir / "cpulist") or []:
            node_of[c] = node
        mem = _node_memory(node_dir)
        if mem is not None:
            free[node], total[node] = mem
    core_of: dict[int, tuple[int, int]] = {}
    for c in online:
        topo = cpu_dir / f"cpu{c}/topology"
        package = _read(topo / "physical_package_id")
        core = _read(topo / "core_id")
        if package is None or core is None:
            core_of[c] = (0, c)  # no topology files: every CPU its own core
        else:
            core_of[c] = (int(package), int(core))
        node_of.setdefault(c, 0)  # non-NUMA kernels: everything on node 0

    if affinity is None:
        if root == Path("/"):
            affinity = _affinity_before_binding or os.sched_getaffinity(0)
        else:
            listed = _status_field(root, "Cpus_allowed_list")
            affinity = parse_cpu_list(listed) if listed else online
    mems = _status_field(root, "Mems_allowed_list")
    mems_allowed = tuple(parse_cpu_list(mems)) if mems else tuple(sorted(set(node_of.values())))
    return Topology(
        online=frozenset(online),
        offline=frozenset(offline),
        node_of={c: node_of[c] for c in online},
        core_of=core_of,
        affinity=frozenset(affinity),
        cpuset=_cgroup_cpuset(root),
        mems_allowed=mems_allowed,
        node_free_bytes=free,
        node_total_bytes=total,
    )


@dataclass(frozen=True)
class RankBinding:
    local_rank: int
    cpus: tuple[int, ...]
    node: int  # memory node: the one holding most of the rank's CPUs
    nodes: tuple[int, ...]  # every node the CPUs lie on


@dataclass(frozen=True)
class BindPlan:
    mode: str  # "auto" | "all" | "nobind" | "lists"
    ranks: tuple[RankBinding, ...] = ()
    reserved: tuple[int, ...] = ()
    warnings: tuple[str, ...] = ()

    def host_value(self) -> str:
        """The explicit `VLLM_CPU_OMP_THREADS_BIND` the host's executor understands."""
        if self.mode == "nobind":
            return "nobind"
        return "|".join(format_cpu_list(r.cpus) for r in self.ranks)


def _binding(topo: Topology, rank: int, cpus) -> RankBinding:
    cpus = tuple(sorted(cpus))
    return RankBinding(rank, cpus, topo.main_node(cpus), tuple(sorted({topo.node_of[c] for c in cpus})))


def _split(items: list[int], parts: int) -> list[list[int]]:
    """Contiguous, as even as possible (earlier parts get the extra ones)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def _auto(topo: Topology, value: str, world_size: int, reserved: int | None, smt: bool) -> BindPlan:
    nodes = topo.nodes
    if not nodes:
        raise EnvError(OMP_THREADS_BIND, value, why="this process may use no online CPU")
    per_node = [topo.cpus_of_node(n) if smt else topo.one_per_core(topo.cpus_of_node(n)) for n in nodes]
    if world_size <= len(nodes):
        groups = per_node[:world_size]
    elif world_size % len(nodes) == 0:
        groups = [g for cpus in per_node for g in _split(cpus, world_size // len(nodes))]
    else:
        raise EnvError(
            OMP_THREADS_BIND, value,
            why=f"{world_size} local ranks cannot be spread evenly over {len(nodes)} NUMA nodes "
            f"{nodes}; give one CPU list per rank, e.g. '{_example(per_node, world_size)}'",
        )
    if any(not g for g in groups):
        raise EnvError(
            OMP_THREADS_BIND, value,
            why=f"{world_size} local ranks need at least one core each; usable cores per node: "
            f"{ {n: format_cpu_list(c) for n, c in zip(nodes, per_node)} }",
        )
    warnings = []
    if smt:
        counts = [0] * world_size
    elif reserved is None:
        # The host's rule, one core per local rank for the engine core's
        # scheduling and the API server, but only from ranks that keep two or
        # more: on 2 cores, computing on 1 served 8 and 32 streams slower
        # (measured: docs/threads_and_tp.md, "Default plan").
        counts = [1 if len(g) >= 3 else 0 for g in groups]
    else:
        total = sum(len(g) for g in groups)
        spare = total - world_size  # every rank keeps at least one core
        if reserved > spare:
            raise EnvError(
                NUM_OF_RESERVED_CPU, str(reserved),
                why=f"reserving {reserved} of the {total} cores that VLLM_CPU_OMP_THREADS_BIND="
                f"{value!r} selects for {world_size} rank(s) leaves a rank without a core "
                f"(at most {spare})",
            )
        counts = [reserved // world_size] * world_size
        for i in range(reserved % world_size):
            counts[world_size - 1 - i] += 1
    kept, held = [], []
    for g, n in zip(groups, counts):
        kept.append(g[: len(g) - n])
        held.extend(g[len(g) - n:])
    ranks = tuple(_binding(topo, i, g) for i, g in enumerate(kept))
    return BindPlan(value, ranks, tuple(sorted(held)), tuple(warnings))


def _example(per_node: list[list[int]], world_size: int) -> str:
    flat = [c for cpus in per_node for c in cpus]
    return "|".join(format_cpu_list(p) for p in _split(flat, world_size) if p)


def _lists(topo: Topology, value: str, world_size: int) -> BindPlan:
    texts = value.split("|")
    if len(texts) != world_size:
        raise EnvError(
            OMP_THREADS_BIND, value,
            why=f"{len(texts)} CPU list(s) joined by '|' but {world_size} local rank(s) "
            "(tensor x pipeline parallel size on this node) need one list each",
        )
    lists = []
    for i, text in enumerate(texts):
        if not text.strip():
            raise EnvError(OMP_THREADS_BIND, value, why=f"the CPU list of rank {i} is empty")
        lists.append(parse_cpu_list(text, OMP_THREADS_BIND, value))
    allowed = topo.allowed
    outside = sorted({c for cpus in lists for c in cpus} - allowed)
    if outside:
        offline = sorted(set(outside) & topo.offline)
        why = f"CPUs {format_cpu_list(outside)} are not usable by this process " \
              f"(usable: {format_cpu_list(allowed)}: online, in the affinity mask and cgroup cpuset)"
        if offline:
            why += f"; offline: {format_cpu_list(offline)}"
        raise EnvError(OMP_THREADS_BIND, value, why=why)
    warnings = []
    seen: dict[int, int] = {}
    for i, cpus in enumerate(lists):
        for c in cpus:
            if c in seen and seen[c] != i:
                warnings.append(f"{OMP_THREADS_BIND}: CPU {c} is given to ranks {seen[c]} and {i}; "
                                "their threads will compete for it")
            seen.setdefault(c, i)
    ranks = tuple(_binding(topo, i, cpus) for i, cpus in enumerate(lists))
    for r in ranks:
        if len(r.nodes) > 1:
            warnings.append(
                f"{OMP_THREADS_BIND}: rank {r.local_rank}'s CPUs {format_cpu_list(r.cpus)} span "
                f"NUMA nodes {list(r.nodes)}; its memory is bound to node {r.node}, so threads on "
                "other nodes read remote memory"
            )
    return BindPlan("lists", ranks, (), tuple(warnings))


def plan(topo: Topology, value: str | None, world_size: int, reserved: int | None = None) -> BindPlan:
    """The per-local-rank CPU plan for a `VLLM_CPU_OMP_THREADS_BIND` value."""
    value = (value or "auto").strip() or "auto"
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, not {world_size}")
    if value == "nobind":
        return BindPlan("nobind")
    if value in ("auto", "all"):
        return _auto(topo, value, world_size, reserved, smt=value == "all")
    return _lists(topo, value, world_size)


def plan_from_env(world_size: int, topo: Topology | None = None) -> BindPlan:
    return plan(topo or discover(), os.environ.get(OMP_THREADS_BIND), world_size, num_reserved_cpus())
