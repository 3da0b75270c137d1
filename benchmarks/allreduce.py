"""All-reduce latency for decode-sized tensors: our shared-memory group
(cpu_backend.shm_group.ShmGroup) vs torch.distributed gloo, in the same run.

    .venv/bin/python -m benchmarks.allreduce [--world 2] [--hidden 4096] [--iters 200]

Two (or --world) spawned processes, one thread each, pinned to CPU `rank % ncpu`,
form one gloo group and one shared-memory group. For every shape (1..64 x hidden)
and dtype (bf16, fp32), both implementations run `--iters` times, interleaved in
blocks of 10 so load from other processes hits both alike; each sample is the
time of one call on rank 0 after a barrier. Reported: medians and the ratio
gloo / ours. Writes benchmarks/results/allreduce.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROWS = (1, 2, 4, 8, 16, 32, 64)
DTYPES = (torch.bfloat16, torch.float32)
BLOCK = 10
RESULT = Path(__file__).parent / "results" / "allreduce.md"


def _run(rank, world, port, hidden, iters, q):
    import torch.distributed as dist

    from cpu_backend.shm_group import PREFIX, ShmGroup

    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    name = [f"{PREFIX}bench-tp-{os.getpid()}"]
    dist.broadcast_object_list(name, src=0)
    shm = ShmGroup(name[0], rank, world, barrier=dist.barrier)
    impls = {"shm": shm.all_reduce, "gloo": dist.all_reduce}
    results = []
    for dtype in DTYPES:
        for rows in ROWS:
            x = torch.randn(rows, hidden).to(dtype)
            times = {k: [] for k in impls}
            for fn in impls.values():  # warm-up
                for _ in range(5):
                    fn(x)
            for _ in range(0, iters, BLOCK):
                for key, fn in impls.items():
                    dist.barrier()
                    for _ in range(BLOCK):
                        t0 = time.perf_counter()
                        fn(x)
                        times[key].append(time.perf_counter() - t0)
            if rank == 0:
                results.append((str(dtype).removeprefix("torch."), rows,
                                statistics.median(times["shm"]), statistics.median(times["gloo"])))
    if rank == 0:
        q.put(results)
    dist.barrier()
    shm.close()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", type=Path, default=RESULT)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_run, args=(r, args.world, port, args.hidden, args.iters, q))
             for r in range(args.world)]
    for p in procs:
        p.start()
    results = q.get(timeout=1800)
    for p in procs:
        p.join()
    lines = [
        "# All-reduce latency: shared memory (ours) vs gloo",
        "",
        f"`python -m benchmarks.allreduce --world {args.world} --hidden {args.hidden} "
        f"--iters {args.iters}`; {args.world} processes, 1 thread each, one CPU each "
        f"({os.cpu_count()}-CPU {platform.machine()} machine shared with other jobs: "
        "numbers are noisy). Median of per-call times on rank 0, same run, interleaved.",
        "",
        "| dtype | tensor | bytes | ours (µs) | gloo (µs) | gloo / ours |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for dtype, rows, ours, gloo in results:
        nbytes = rows * args.hidden * (2 if dtype == "bfloat16" else 4)
        lines.append(f"| {dtype} | {rows}x{args.hidden} | {nbytes} | {ours * 1e6:.1f} | "
                     f"{gloo * 1e6:.1f} | {gloo / ours:.1f}x |")
    ratios = [g / o for _, _, o, g in results]
    lines += ["", f"Ratio gloo / ours: median {statistics.median(ratios):.1f}x, "
              f"min {min(ratios):.1f}x (target >= 3x).", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
