"""Shared-memory all-reduce / all-gather (cpu_backend.shm_group) across real
processes, against torch.distributed (gloo) on the same inputs; segment clean-up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from cpu_backend.shm_group import PREFIX, SHM_DIR, ShmGroup, cleanup_stale, shm_usable

pytestmark = pytest.mark.skipif(not shm_usable(), reason="x86 + /dev/shm only")


def _worker(rank, world, port, name, q):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    g = ShmGroup(name, rank, world, barrier=dist.barrier, slot_bytes=1 << 16)
    results = {"leftover": (SHM_DIR / name).exists()}
    for dtype, shape in [(torch.float32, (3, 64)), (torch.bfloat16, (5, 128)),
                         (torch.float32, (1, 7))]:
        for step in range(3):  # several calls: both buffer sets reused
            gen = torch.Generator().manual_seed(1000 * rank + step)
            x = torch.randn(shape, generator=gen).to(dtype)
            ours, ref = x.clone(), x.clone()
            g.all_reduce(ours)
            dist.all_reduce(ref)
            out = torch.empty((world * shape[0], shape[1]), dtype=dtype)
            g.all_gather_into_tensor(out, x)
            ref_g = torch.empty_like(out)
            dist.all_gather_into_tensor(ref_g, x)
            # Plain values: tensors through a queue would share memory with an ended process.
            results[(str(dtype), shape, step)] = (
                ours.float().tolist(), ref.float().tolist(), torch.equal(out, ref_g))
    q.put((rank, results))
    g.close()
    dist.destroy_process_group()


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 3])
def test_matches_gloo_and_leaves_no_segment(world):
    name = f"{PREFIX}test-{os.getpid()}-{world}-{os.getpid()}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, name, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=120) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    results = [got[r] for r in range(world)]
    assert not any(r["leftover"] for r in results)  # unlinked once all mapped it
    assert not (SHM_DIR / name).exists()
    for key in results[0]:
        if key == "leftover":
            continue
        first = results[0][key][0]
        for r in range(world):
            ours, ref, gathered = results[r][key]
            assert gathered, key
            assert ours == first, key  # every rank: the same bits
            ours, ref = torch.tensor(ours), torch.tensor(ref)
            tol = 1e-2 if "bfloat16" in key[0] else 1e-5
            torch.testing.assert_close(ours, ref, rtol=tol, atol=tol)


def test_stale_segments_of_dead_creators_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{PREFIX}x-tp-{dead.pid}"
    live = tmp_path / f"{PREFIX}x-tp-{os.getpid()}"
    other = tmp_path / "not-ours-1"
    for p in (stale, live, other):
        p.write_bytes(b"x")
    assert cleanup_stale(tmp_path) == [stale.name]
    assert live.exists() and other.exists() and not stale.exists()


def _hang(name, port, rank):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    g = ShmGroup(name, rank, 2, barrier=dist.barrier, slot_bytes=4096)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # a crashed rank
    g.all_reduce(torch.ones(4))


def test_crashed_peer_times_out_with_a_clear_error_and_no_segment(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_BACKEND_SHM_TIMEOUT_S", "3")
    code = (
        "import sys, torch.multiprocessing as mp\n"
        "from plugin_tests.test_shm_communicator import _hang\n"
        "if __name__ == '__main__':\n"
        "    ctx = mp.get_context('spawn')\n"
        f"    name, port = sys.argv[1], int(sys.argv[2])\n"
        "    p = ctx.Process(target=_hang, args=(name, port, 1)); p.start()\n"
        "    _hang(name, port, 0)\n"
    )
    name = f"{PREFIX}crash-tp-{os.getpid()}"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code, name, str(_free_port())],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert proc.returncode != 0
    assert "no answer from ranks [1]" in proc.stderr
    assert time.monotonic() - start < 100
    assert not (SHM_DIR / name).exists()
