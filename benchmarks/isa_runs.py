"""Shared by the per-ISA kernel microbenchmarks (kernels_wna16.py, kernels_w8a8.py).

Each script's `worker(threads, iters) -> dict` runs in one subprocess per ISA
library (`VLLM_CPU_BACKEND_ISA`, since a process loads one library), with
torch's own kernels (oneDNN, ATen) limited to the same ISA level
(TORCH_ISA_ENV), so that the torch and host columns are what a CPU of that
tier runs; `main` collects the results, renders them and writes the markdown
file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# The decoder-layer linears of Qwen2.5-0.5B: (name, N, K).
QWEN05_LINEARS = [("qkv", 1152, 896), ("o", 896, 896), ("gate_up", 9728, 896), ("down", 896, 4864)]
# What limits torch's own kernels (oneDNN: the host's int8 and bf16 GEMMs; ATen)
# to the level of one of our libraries, as on a CPU of that tier. The host's
# `_C` kernels pick their ISA at build time and are not limited.
TORCH_ISA_ENV = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    # Intel client parts (Alder Lake and later): AVX2 + 256-bit VNNI
    "avx_vnni": {"ONEDNN_MAX_CPU_ISA": "AVX2_VNNI", "ATEN_CPU_CAPABILITY": "avx2"},
}
# A process whose environment has this directory first on PYTHONPATH sees a CPU
# without AVX-512/AMX through torch's capability queries, from which the host
# picks its `_C` build (`_C_AVX2`) and its attention/GEMM paths
# (benchmarks/avx2_cpu/sitecustomize.py).
AVX2_CPU_SITE = Path(__file__).resolve().parent / "avx2_cpu"


def as_avx2_cpu(env: dict) -> dict:
    """`env` plus what makes the host, too, run what a CPU without AVX-512 runs."""
    paths = [str(AVX2_CPU_SITE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


# Weights are rotated through copies totalling more than this, so that M = 1
# reads come from DRAM, like a model whose layers do not stay in cache.
ROTATE_BYTES = 96 << 20
_MARKER = "RESULT "
REPO = Path(__file__).resolve().parent.parent


def median_ms(fn, iters: int) -> float:
    """Median wall time of `fn(i)` over `iters` calls, after one warm-up call."""
    fn(0)
    ts = []
    for i in range(iters):
        t = time.perf_counter()
        fn(i)
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def main(module: str, worker, render, default_out: str) -> None:
    """CLI of a per-ISA benchmark `module` (run as `python -m <module>` from the repo root)."""
    p = argparse.ArgumentParser()
    p.add_argument("--isas", default="avx2,avx_vnni,avx512")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=default_out)
    p.add_argument("--worker", action="store_true")
    a = p.parse_args()
    if a.worker:
        print(_MARKER + json.dumps(worker(a.threads, a.iters)))
        return
    results = []
    for isa in a.isas.split(","):
        proc = subprocess.run(
            [sys.executable, "-m", module, "--worker", "--threads", str(a.threads), "--iters", str(a.iters)],
            env={**os.environ, **TORCH_ISA_ENV.get(isa, {}), "VLLM_CPU_BACKEND_ISA": isa},
            capture_output=True, text=True, cwd=REPO)
        line = [x for x in proc.stdout.splitlines() if x.startswith(_MARKER)]
        if proc.returncode or not line:
            print(proc.stderr[-2000:], file=sys.stderr)
            raise SystemExit(f"{isa} worker failed")
        results.append(json.loads(line[-1].removeprefix(_MARKER)))
    text = render(results)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
    print(text)
