"""Microbenchmark: cpu_backend paged attention vs another build of it vs torch SDPA.

    .venv/bin/python benchmarks/kernels_attention.py [--threads 2] [--library cpu_backend/_kernels_avx512.so]
        [--baseline /path/to/old/_kernels_avx512.so] [--quick] [--out benchmarks/results/kernels_attention.md]

Shapes (query heads / kv heads / head size): SmolLM2-135M 9/3/64,
Qwen2.5-0.5B 14/2/64, Llama-3-8B 32/8/128. Workloads: one fresh causal
prefill of 512 and 2048 tokens, and decode (a batch of 16 sequences with 1024
cached tokens each, one new token each). bf16 query and KV cache, 16-token
blocks in shuffled order. "baseline" is any other build of the kernels (e.g.
the one before a change: `git stash`, build, copy the .so aside), measured in
its own subprocess since a process holds one library. torch SDPA runs on
contiguous [1, heads, len, head_size] bf16 tensors (causal for prefill,
enable_gqa), i.e. without paging. Times are medians over repeated calls; the
machine may be shared, so compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = [("SmolLM2-135M", 9, 3, 64), ("Qwen2.5-0.5B", 14, 2, 64), ("Llama-3-8B", 32, 8, 128)]
WORKLOADS = [("prefill 512", 1, 0, 512), ("prefill 2048", 1, 0, 2048), ("decode 16x1024", 16, 1023, 1)]
BLOCK = 16


def cases(quick: bool):
    for shape in SHAPES:
        for work in WORKLOADS:
            if quick and (shape[0] == "Llama-3-8B" and work[0] == "prefill 2048"):
                continue
            yield shape, work


def median_time(fn, budget_s: float, min_reps: int = 3, max_reps: int = 100) -> float:
    fn()  # warm-up
    times = []
    t_end = time.perf_counter() + budget_s
    while len(times) < min_reps or (time.perf_counter() < t_end and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_inputs(torch, shape, work, seed=0):
    _, hq, hk, d = shape
    _, batch, context, new = work
    gen = torch.Generator().manual_seed(seed)
    seq = context + new
    blocks_per = -(-seq // BLOCK)
    num_blocks = batch * blocks_per
    kv_cache = (torch.randn(num_blocks, hk, BLOCK, 2 * d, generator=gen) * 0.5).to(torch.bfloat16)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_table = perm.view(batch, blocks_per).contiguous()
    query = torch.randn(batch * new, hq, d, generator=gen).to(torch.bfloat16)
    token_req = torch.arange(batch, dtype=torch.int32).repeat_interleave(new)
    token_pos = torch.arange(context, seq, dtype=torch.int32).repeat(batch)
    return query, kv_cache, block_table, token_req, token_pos


def bench_library(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    torch.ops.load_library(args.library)
    results = {}
    for shape, work in cases(args.quick):
        q, kv, bt, req, pos = make_inputs(torch, shape, work)
        out = torch.empty_like(q)
        scale = shape[3] ** -0.5

        def run():
            torch.ops.cpu_backend.paged_attention(out, q, kv, bt, req, pos, scale, 0, 0.0, None, 0, 1.0, 1.0)

        results[f"{shape[0]}|{work[0]}"] = median_time(run, args.budget)
    return results


def bench_sdpa(args) -> dict:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    results = {}
    for shape, work in cases(args.quick):
        _, hq, hk, d = shape
        _, batch, context, new = work
        seq = context + new
        gen = torch.Generator().manual_seed(1)
        q = torch.randn(batch, hq, new, d, generator=gen).to(torch.bfloat16)
        k = torch.randn(batch, hk, seq, d, generator=gen).to(torch.bfloat16)
        v = torch.randn(batch, hk, seq, d, generator=gen).to(torch.bfloat16)

        def run():
            F.scaled_dot_product_attention(q, k, v, is_causal=new > 1, enable_gqa=True)

        results[f"{shape[0]}|{work[0]}"] = median_time(run, args.budget)
    return results


def run_worker(library: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--library", library, "--threads", str(args.threads),
           "--budget", str(args.budget)] + (["--quick"] if args.quick else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def render(args, ours, base, sdpa) -> str:
    ms = lambda t: f"{t * 1e3:.2f}" if t is not None else "-"  # noqa: E731
    lines = [
        "# Paged attention kernel: ours vs baseline build vs torch SDPA",
        "",
        f"`{' '.join(sys.argv)}` on {platform.processor() or platform.machine()}, {args.threads} threads, "
        f"torch SDPA without paging. Median ms per call (bf16 query and KV cache, block {BLOCK}); "
        f"load average at the end: {os.getloadavg()[0]:.1f}.",
        "",
        "| model (heads/kv/head size) | workload | ours | baseline | SDPA | baseline / ours | SDPA / ours |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for (name, hq, hk, d), work in cases(args.quick):
        key = f"{name}|{work[0]}"
        o, b, s = ours[key], (base or {}).get(key), sdpa[key]
        ratio = lambda x: f"{x / o:.2f}x" if x is not None else "-"  # noqa: E731
        lines.append(f"| {name} ({hq}/{hk}/{d}) | {work[0]} | {ms(o)} | {ms(b)} | {ms(s)} | {ratio(b)} | {ratio(s)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--library", default=str(Path(__file__).resolve().parent.parent / "cpu_backend" / "_kernels_avx512.so"))
    p.add_argument("--baseline", default=None, help="another build's _kernels_<isa>.so")
    p.add_argument("--budget", type=float, default=1.0, help="seconds per measurement")
    p.add_argument("--quick", action="store_true", help="skip Llama-3-8B prefill 2048")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "kernels_attention.md"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(bench_library(args)))
        return
    ours = run_worker(args.library, args)
    base = run_worker(args.baseline, args) if args.baseline else None
    sdpa = bench_sdpa(args)
    text = render(args, ours, base, sdpa)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
