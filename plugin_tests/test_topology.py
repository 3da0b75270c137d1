"""Topology discovery and CPU plans on fake sysfs/procfs trees (cpu_backend.topology)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpu_backend import topology
from cpu_backend.envs import EnvError, format_cpu_list, parse_cpu_list
from cpu_backend.topology import discover, plan


def make_tree(root: Path, *, sockets: int, cores: int, smt: int = 1, offline=(),
              affinity=None, cgroup: str | None = None, cgroup_cpus=None,
              free_gib: float = 10.0, numa=True) -> Path:
    """Linux numbering: CPU = thread * (sockets*cores) + socket*cores + core."""
    n = sockets * cores * smt
    cpu = root / "sys/devices/system/cpu"
    cpu.mkdir(parents=True)
    online = [c for c in range(n) if c not in offline]
    (cpu / "present").write_text(f"0-{n - 1}\n")
    (cpu / "online").write_text(format_cpu_list(online) + "\n")
    (cpu / "offline").write_text(format_cpu_list(offline) + "\n")
    for c in online:
        t = cpu / f"cpu{c}/topology"
        t.mkdir(parents=True)
        socket, core = divmod(c % (sockets * cores), cores)
        (t / "physical_package_id").write_text(f"{socket}\n")
        (t / "core_id").write_text(f"{core}\n")
    if numa:
        for s in range(sockets):
            node = root / f"sys/devices/system/node/node{s}"
            node.mkdir(parents=True)
            cpus = [c for c in online if (c % (sockets * cores)) // cores == s]
            (node / "cpulist").write_text(format_cpu_list(cpus) + "\n")
            kb = int(free_gib * (1 << 20))
            (node / "meminfo").write_text(
                f"Node {s} MemTotal:       {4 * kb} kB\nNode {s} MemFree:        {kb} kB\n"
                f"Node {s} Active(file):   0 kB\nNode {s} Inactive(file): 0 kB\n"
                f"Node {s} SReclaimable:   0 kB\n"
            )
    proc = root / "proc/self"
    proc.mkdir(parents=True)
    aff = format_cpu_list(affinity if affinity is not None else range(n))
    mems = f"0-{sockets - 1}" if sockets > 1 else "0"
    (proc / "status").write_text(f"Name:\tx\nCpus_allowed_list:\t{aff}\nMems_allowed_list:\t{mems}\n")
    if cgroup == "v2":
        (proc / "cgroup").write_text("0::/kubepods/pod1\n")
        d = root / "sys/fs/cgroup/kubepods/pod1"
        d.mkdir(parents=True)
        (d / "cpuset.cpus.effective").write_text(format_cpu_list(cgroup_cpus) + "\n")
    elif cgroup == "v1":
        (proc / "cgroup").write_text("4:memory:/docker/abc\n3:cpuset,cpu:/docker/abc\n")
        d = root / "sys/fs/cgroup/cpuset/docker/abc"
        d.mkdir(parents=True)
        (d / "cpuset.effective_cpus").write_text(format_cpu_list(cgroup_cpus) + "\n")
    else:
        (proc / "cgroup").write_text("0::/\n")
    return root


@pytest.fixture
def two_socket(tmp_path):
    """2 sockets x 32 cores x 2 threads: node 0 = 0-31,64-95; node 1 = 32-63,96-127."""
    return discover(make_tree(tmp_path, sockets=2, cores=32, smt=2))


def test_parse_and_format_round_trip():
    assert parse_cpu_list("0-2,5,7-8") == [0, 1, 2, 5, 7, 8]
    assert format_cpu_list([8, 0, 1, 2, 5, 7]) == "0-2,5,7-8"
    for bad in ("0-x", "3-1", "1,,2", "-1", "0 1"):
        with pytest.raises(EnvError, match="VLLM_CPU_OMP_THREADS_BIND"):
            parse_cpu_list(bad)


def test_two_sockets_with_hyperthreads_discovered(two_socket):
    t = two_socket
    assert t.nodes == [0, 1]
    assert t.cpus_of_node(0) == list(range(32)) + list(range(64, 96))
    assert t.one_per_core(t.cpus_of_node(1)) == list(range(32, 64))
    assert t.core_of[3] == t.core_of[67] == (0, 3)
    assert t.mems_allowed == (0, 1)
    assert t.node_free_bytes[1] == 10 << 30


def test_auto_one_rank_per_node_siblings_out_reserved_off_last_rank(two_socket):
    p = plan(two_socket, "auto", world_size=2, reserved=None)
    # Default reservation: one core per local rank, from the end of each rank.
    assert [r.cpus for r in p.ranks] == [tuple(range(31)), tuple(range(32, 63))]
    assert [r.node for r in p.ranks] == [0, 1]
    assert p.reserved == (31, 63)
    assert p.host_value() == "0-30|32-62"
    p = plan(two_socket, "auto", world_size=2, reserved=3)
    assert p.reserved == (31, 62, 63)  # last rank gives the odd one
    p = plan(two_socket, "auto", world_size=1, reserved=0)
    assert p.ranks[0].cpus == tuple(range(32)) and p.ranks[0].node == 0


def test_auto_splits_nodes_when_ranks_outnumber_them(two_socket):
    p = plan(two_socket, "auto", world_size=4, reserved=0)
    assert p.host_value() == "0-15|16-31|32-47|48-63"
    assert [r.node for r in p.ranks] == [0, 0, 1, 1]
    with pytest.raises(EnvError, match="spread evenly over 2 NUMA nodes"):
        plan(two_socket, "auto", world_size=3)


def test_all_keeps_siblings_and_reserves_nothing(two_socket):
    p = plan(two_socket, "all", world_size=1, reserved=None)
    assert p.ranks[0].cpus == tuple(range(32)) + tuple(range(64, 96))
    assert p.reserved == ()


def test_explicit_lists_validated(two_socket):
    p = plan(two_socket, "0-3,8|32-35", world_size=2)
    assert [r.cpus for r in p.ranks] == [(0, 1, 2, 3, 8), (32, 33, 34, 35)]
    assert not p.warnings
    with pytest.raises(EnvError, match=r"2 CPU list\(s\).*3 local rank"):
        plan(two_socket, "0-3|4-7", world_size=3)
    with pytest.raises(EnvError, match="rank 1 is empty"):
        plan(two_socket, "0-3|", world_size=2)
    with pytest.raises(EnvError, match="CPUs 200 are not usable"):
        plan(two_socket, "0,200", world_size=1)
    with pytest.raises(EnvError, match="low-high"):
        plan(two_socket, "5-2", world_size=1)
    # Spanning nodes: allowed, with a warning; memory goes to the majority node.
    p = plan(two_socket, "30-40", world_size=1)
    assert p.ranks[0].nodes == (0, 1) and p.ranks[0].node == 1
    assert any("span NUMA nodes [0, 1]" in w for w in p.warnings)
    p = plan(two_socket, "0-3|3-5", world_size=2)
    assert any("CPU 3 is given to ranks 0 and 1" in w for w in p.warnings)


def test_reserved_that_leaves_a_rank_without_a_core_is_refused(two_socket):
    with pytest.raises(EnvError, match="VLLM_CPU_NUM_OF_RESERVED_CPU='63'"):
        plan(two_socket, "auto", world_size=2, reserved=63)
    plan(two_socket, "auto", world_size=2, reserved=62)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_container_cpuset_limits_auto_and_lists(tmp_path, version):
    # A pod given CPUs 8-11 and their siblings 72-75 on socket 0.
    cpus = [8, 9, 10, 11, 72, 73, 74, 75]
    t = discover(make_tree(tmp_path, sockets=2, cores=32, smt=2, cgroup=version, cgroup_cpus=cpus))
    assert t.cpuset == frozenset(cpus)
    assert t.nodes == [0]
    p = plan(t, "auto", world_size=1, reserved=None)
    assert p.ranks[0].cpus == (8, 9, 10) and p.reserved == (11,)
    p = plan(t, "auto", world_size=2, reserved=None)  # one node: its cores split
    assert p.host_value() == "8-9|10-11" and p.reserved == ()  # no rank left with one core
    p = plan(t, "auto", world_size=2, reserved=2)
    assert p.host_value() == "8|10" and p.reserved == (9, 11)
    with pytest.raises(EnvError, match="not usable"):
        plan(t, "0-3", world_size=1)


def test_affinity_mask_honoured(tmp_path):
    t = discover(make_tree(tmp_path, sockets=1, cores=8, affinity=[2, 3, 4, 5]))
    assert sorted(t.allowed) == [2, 3, 4, 5]
    assert plan(t, "auto", world_size=1, reserved=0).host_value() == "2-5"


def test_offline_cpus_left_out_and_named(tmp_path):
    t = discover(make_tree(tmp_path, sockets=1, cores=8, offline=(5, 6)))
    assert t.offline == frozenset({5, 6})
    assert plan(t, "auto", world_size=1, reserved=0).host_value() == "0-4,7"
    with pytest.raises(EnvError, match="offline: 5"):
        plan(t, "4-5", world_size=1)


def test_single_node_box_like_this_machine(tmp_path):
    t = discover(make_tree(tmp_path, sockets=1, cores=2))
    assert t.nodes == [0]
    # TP=1: both cores compute (the host's rule would leave one to the engine
    # core: measured slower, docs/threads_and_tp.md); asked for, one is reserved.
    p = plan(t, "auto", world_size=1, reserved=None)
    assert p.host_value() == "0-1" and p.reserved == ()
    p = plan(t, "auto", world_size=1, reserved=1)
    assert p.host_value() == "0" and p.reserved == (1,)
    # TP=2: one core each; nothing can be reserved.
    p = plan(t, "auto", world_size=2, reserved=None)
    assert p.host_value() == "0|1" and p.reserved == ()
    with pytest.raises(EnvError, match="at least one core each"):
        plan(t, "auto", world_size=3)
    assert plan(t, "nobind", world_size=2).ranks == ()


@pytest.mark.parametrize("cores, bound, reserved", [(3, "0-1", (2,)), (4, "0-2", (3,))])
def test_a_rank_with_three_or_more_cores_leaves_one_to_the_frontend(tmp_path, cores, bound, reserved):
    p = plan(discover(make_tree(tmp_path, sockets=1, cores=cores)), "auto", world_size=1, reserved=None)
    assert p.host_value() == bound and p.reserved == reserved


def test_no_numa_directory_means_node_zero(tmp_path):
    t = discover(make_tree(tmp_path, sockets=1, cores=4, numa=False))
    assert t.nodes == [0] and plan(t, "auto", 2, reserved=0).host_value() == "0-1|2-3"


def test_real_machine_discovery():
    t = discover()
    assert t.allowed and set(t.allowed) <= set(t.online)
    p = topology.plan(t, "auto", world_size=1, reserved=0)
    assert set(p.ranks[0].cpus) <= set(t.allowed)
