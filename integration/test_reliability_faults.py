"""Faults: a tensor-parallel worker killed mid-generation.

`vllm serve` with TP=2 (multiprocessing executor, our worker and our
shared-memory communicator, one core per rank) under streaming load; rank 1
gets SIGKILL. Pass: /health stops answering 200 and the server exits non-zero
within 30 s, its log names the dead rank, no process of its tree is left, and
/dev/shm holds no segment of ours (`cpubk-*`), none of the host's message
queues (`psm_*`) and no OpenMP registration file (`__KMP_REGISTERED_LIB_<pid>`)
of the dead tree. SIGTERM during load is in test_reliability_load.py.

One TP=2 server, ~1.5 minutes here.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from integration import reliability as rel
from integration.server import serve

pytestmark = [pytest.mark.slow, pytest.mark.reliability,
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")]

MODEL = "tiny"
DEADLINE_S = 30


def _kmp_files(pids: set[int]) -> set[str]:
    from cpu_backend.shm_group import SHM_DIR

    return {p.name for p in SHM_DIR.glob("__KMP_REGISTERED_LIB_*")
            if int(p.name.split("_")[-2]) in pids}


def test_killed_tp_worker_takes_the_server_down_cleanly(tiny_llama):
    env = {"VLLM_CPU_OMP_THREADS_BIND": "auto", "VLLM_CPU_NUM_OF_RESERVED_CPU": None}
    args = ("--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "512",
            "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
    with serve(tiny_llama, *args, env=env) as server:
        procs = rel.processes(server.proc)
        victim = procs.get("Worker_TP1")
        assert victim is not None, procs
        tree = rel.tree_pids(server.proc.pid)
        segments = rel.mapped_shm(tree)
        assert "Group tp" in server.log() and "shared-memory all-reduce" in server.log()

        load = rel.Load(server.base_url, MODEL, rel.token_prompts(8, seed=3), 200, clients=4,
                        seconds=DEADLINE_S + 30)
        runner = threading.Thread(target=load.run, daemon=True)
        runner.start()
        deadline = time.monotonic() + 60
        while "vllm:generation_tokens_total" not in server.get("/metrics") or rel.metric(
                server.get("/metrics"), "vllm:generation_tokens_total") < 20:
            assert time.monotonic() < deadline, "no tokens generated"
            time.sleep(0.2)

        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        unhealthy_after = None
        while server.proc.poll() is None and time.monotonic() - killed < DEADLINE_S + 30:
            if unhealthy_after is None:
                try:
                    server.get("/health")
                except OSError:  # HTTP errors are OSErrors too
                    unhealthy_after = time.monotonic() - killed
            time.sleep(0.2)
        exit_after = time.monotonic() - killed
        code = server.proc.poll()
        load.stop.set()
        runner.join(timeout=60)
        time.sleep(2)  # children reaped by their parents' exit paths
        left = rel.alive(tree - {server.proc.pid})
        log = server.log()

    shm_leaked = rel.leaked_shm(segments) | _kmp_files(tree)
    outcomes = load.outcomes
    row = {
        "fault": "SIGKILL of TP rank 1 mid-generation", "exit_code": code,
        "exit_s": round(exit_after, 1),
        "unhealthy_s": None if unhealthy_after is None else round(unhealthy_after, 1),
        "processes_left": len(left), "shm_leaked": sorted(shm_leaked),
        "shm_segments_watched": len(segments),
        "requests": len(outcomes),
        "completed": sum(o.error is None for o in outcomes),
        "errors": sum(o.error is not None for o in outcomes),
        # The host's executor names the process by rank: VllmWorker-<rank>.
        "rank_named": re.search(r"Worker proc VllmWorker-1 died unexpectedly", log) is not None,
        "exit_reason_logged": "cpu_backend: the engine died while serving" in log,
    }
    rel.record("faults", "tp_worker_sigkill", row)
    print(row)
    assert code is not None and code != 0, row
    assert exit_after <= DEADLINE_S, row
    assert row["rank_named"], log[-4000:]
    assert not left, left
    assert not shm_leaked, shm_leaked
    assert row["exit_reason_logged"], log[-3000:]
