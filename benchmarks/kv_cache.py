"""Long-context decode with each KV-cache dtype, side by side in one run.

    .venv/bin/python -m benchmarks.kv_cache [--seqs 16] [--prompt-len 2048] [--output-len 128]
                                            [--dtypes auto,fp8_e5m2,...] [--quick]

SmolLM2-135M-Instruct in bf16 (built locally by integration/models.py), our
plugin, one fresh subprocess per `--kv-cache-dtype` with the same fixed KV
budget (VLLM_CPU_KVCACHE_SPACE=2). In each: `--seqs` random prompts of
`--prompt-len` tokens are prefilled once (max_tokens=1, which also fills the
prefix cache), then the same prompts run again with `--output-len` new tokens:
that second pass is almost all decode over the long cached context
(median of `--reps`). Reported: decode throughput (output tok/s) and its ratio
to bf16 KV ("auto"), prefill throughput, and the KV capacity in tokens the
same budget holds (from the worker's plan), with its ratio to bf16.

Writes benchmarks/results/kv_cache.md and kv_cache.json (--quick: kv_cache_quick.*; with
VLLM_CPU_BACKEND_ISA=avx2, the AVX2 library forced: kv_cache_avx2.*).
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

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
MARKER = "KV_RESULT "
ISA_VAR = "VLLM_CPU_BACKEND_ISA"  # e.g. avx2: results go to kv_cache_avx2.*
DTYPES = ["auto", "fp8_e5m2", "fp8_e4m3", "int8_per_token_head", "fp8_per_token_head"]
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}


def worker(args) -> dict:
    import random

    from vllm import LLM, SamplingParams

    from integration import models

    model = str(models.smollm2(models.default_cache_root(), dtype="bfloat16"))
    llm = LLM(
        model=model, dtype="bfloat16", kv_cache_dtype=args.worker, seed=0,
        max_model_len=args.prompt_len + args.output_len + 64, enable_prefix_caching=True,
        max_num_seqs=args.seqs,
    )
    (rep,) = llm.collective_rpc("cpu_backend_report")
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(args.prompt_len)]}
               for _ in range(args.seqs)]

    def timed(max_tokens: int) -> tuple[float, int]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)

    prefill_s, _ = timed(1)  # also puts the prompts in the prefix cache
    decode = []
    for i in range(args.reps):
        if i:
            llm.reset_prefix_cache()
            timed(1)
        seconds, tokens = timed(args.output_len)
        decode.append(tokens / seconds)
    mem = rep["memory"]
    # which attention path ran is known after the first real forward
    (after,) = llm.collective_rpc("cpu_backend_report")
    return {
        "kv_cache_dtype": args.worker,
        "attention_native": after["attention_native"],
        "capacity_tokens": mem["num_blocks"] * llm.llm_engine.vllm_config.cache_config.block_size,
        "kv_bytes": mem["kv_allocated"],
        "prefill_tok_s": args.seqs * args.prompt_len / prefill_s,
        "decode_tok_s": decode,
    }


def run_all(args) -> list[dict]:
    results = []
    for dtype in args.dtypes.split(","):
        cmd = [sys.executable, "-m", "benchmarks.kv_cache", "--worker", dtype, "--seqs", str(args.seqs),
               "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
               "--reps", str(args.reps)]
        print(f"[kv_cache] {dtype} ...", flush=True)
        proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **ENV}, capture_output=True, text=True,
                              timeout=args.timeout)
        lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
        if proc.returncode or not lines:
            results.append({"kv_cache_dtype": dtype, "error": proc.stderr[-2000:]})
        else:
            results.append(json.loads(lines[-1][len(MARKER):]))
        print(f"[kv_cache] {results[-1]}", flush=True)
    return results


def forced_isa() -> str:
    """The ISA library this run forces ('' = auto-detected)."""
    return os.environ.get(ISA_VAR, "").strip()


def isa_prefix() -> str:
    """The forced ISA library of this run, as the command's env prefix."""
    return f"{ISA_VAR}={forced_isa()} " if forced_isa() else ""


def report(args, results: list[dict]) -> str:
    base = next((r for r in results if r["kv_cache_dtype"] == "auto" and "error" not in r), None)
    lines = [
        f"# Long-context decode by KV-cache dtype ({time.strftime('%Y-%m-%d')})",
        "",
        f"SmolLM2-135M-Instruct bf16, our plugin, {args.seqs} sequences x {args.prompt_len}-token prompts, "
        f"{args.output_len} new tokens each (decode over the cached prompts), KV budget "
        f"VLLM_CPU_KVCACHE_SPACE=2, median of {args.reps}. Command: "
        f"`{isa_prefix()}python -m benchmarks.kv_cache{' --quick' if args.quick else ''}`. "
        "Shared 2-core machine: ratios measured in the same run matter, absolute numbers are noisy.",
        "",
        "| KV dtype | decode tok/s | vs bf16 KV | prefill tok/s | KV capacity (tokens) | vs bf16 KV |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['kv_cache_dtype']} | error: {r['error'].strip().splitlines()[-1][:120]} |||||")
            continue
        dec = statistics.median(r["decode_tok_s"])
        ratio = f"{dec / statistics.median(base['decode_tok_s']):.2f}x" if base else "-"
        cap = f"{r['capacity_tokens'] / base['capacity_tokens']:.2f}x" if base else "-"
        lines.append(
            f"| {r['kv_cache_dtype']} | {dec:.1f} | {ratio} | {r['prefill_tok_s']:.0f} | "
            f"{r['capacity_tokens']} | {cap} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--quick", action="store_true", help="8 x 1024-token prompts, 64 new tokens, 1 rep")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.seqs, args.prompt_len, args.output_len, args.reps = 8, 1024, 64, 1
    if args.worker:
        print(MARKER + json.dumps(worker(args)), flush=True)
        return 0
    results = run_all(args)
    stem = "kv_cache_quick" if args.quick else "kv_cache"
    if forced_isa():
        stem += f"_{forced_isa()}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    text = report(args, results)
    (RESULTS / f"{stem}.md").write_text(text)
    print(text)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
