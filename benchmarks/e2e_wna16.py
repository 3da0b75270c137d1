"""End to end: batch-1 decode of an int4 GPTQ checkpoint vs the bf16 model, on
our plugin (one fresh subprocess per variant), each with its LM head in bf16
(`VLLM_CPU_BACKEND_LM_HEAD_QUANT=none`, the bf16 model's default) and as an
int8 copy (`int8`, the quantized checkpoint's default); the int4 model both
W4A16 (`VLLM_CPU_INT4_W4A8=0`: bf16 activations) and W4A8 (the default: int8
activations per 32 inputs).

    .venv/bin/python -m benchmarks.e2e_wna16 [--isa avx2|avx512|portable] [--tokens 64] [--repeat 3]

Model: integration/models.qwen25_05b_shape (Qwen2.5-0.5B's shape, random bf16
weights, tied 151936 x 896 embedding / LM head, which the checkpoint keeps in
bf16), quantized once by `cpu_backend.tools.quantize` (GPTQ 4-bit, group 128,
sym) into the model cache. Each variant: LLM(dtype=bfloat16), one warm-up
generation, then `--repeat` greedy generations of `--tokens` tokens from a
16-token prompt; decode tok/s = (tokens - 1) / (total time - time to first
token), median; then one batch of 32 prompts of 128 tokens, 32 generated each
(generated tok/s over the whole batch, prefill included). Bytes read per token: every stored weight once (the tied
embedding once, as the head; an int8 head as its int8 copy plus two fp32 per
row); read bandwidth: torch.sum over 512 MiB on 2 threads before and after the
variants (benchmarks/e2e.py), the higher median taken as the roofline.
Threads: `VLLM_CPU_OMP_THREADS_BIND=0-1` unless set (both cores of this
machine, as in benchmarks/e2e.py; the default `auto` keeps one core of two
for the engine process). Writes benchmarks/results/e2e_wna16.md
(e2e_wna16_<isa>.md for another --isa).
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

from safetensors import safe_open

REPO = Path(__file__).resolve().parent.parent
BATCH, BATCH_IN, BATCH_OUT = 32, 128, 32  # the batched measurement: prompts, tokens in, tokens out


def worker(model: str, tokens: int, repeat: int) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from cpu_backend.quantization import register

    register()
    llm = LLM(model=model, dtype="bfloat16", max_model_len=512, seed=0)
    prompt = {"prompt_token_ids": list(range(100, 116))}
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate([prompt], full, use_tqdm=False)  # warm-up
    rates = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        llm.generate([prompt], first, use_tqdm=False)
        t1 = time.perf_counter()
        llm.generate([prompt], full, use_tqdm=False)
        t2 = time.perf_counter()
        rates.append((tokens - 1) / ((t2 - t1) - (t1 - t0)))
    # Batched: prefill and decode at up to BATCH rows per linear, where the int4
    # kernels' compute shows.
    batch = [{"prompt_token_ids": [100 + (7 * i + j) % 5000 for j in range(BATCH_IN)]} for i in range(BATCH)]
    gen = SamplingParams(temperature=0.0, max_tokens=BATCH_OUT, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(batch, gen, use_tqdm=False)
    throughput = BATCH * BATCH_OUT / (time.perf_counter() - t0)
    (rep,) = llm.collective_rpc("cpu_backend_report")
    return {"decode_tok_s": statistics.median(rates), "samples": rates, "batch_tok_s": throughput,
            "linear_methods": rep["linear_methods"], "isa": rep["kernels_isa"],
            "lm_head_quant": rep["lm_head_quant"], "int8_act_layers": rep["wna16_int8_act_layers"]}


def bytes_per_token(folder: Path, int8_head: bool) -> int:
    """What one decode step reads: the checkpoint's weights at bf16 (benchmarks/e2e.py),
    with the tied embedding counted once, as the LM head, or as its int8 copy."""
    from benchmarks.e2e import weight_bytes

    total = weight_bytes(folder, "bfloat16")
    if int8_head:
        with safe_open(folder / "model.safetensors", "pt") as f:
            vocab, hidden = f.get_slice("model.embed_tokens.weight").get_shape()
        total -= vocab * hidden * 2 - (vocab * hidden + vocab * 8)
    return total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--isa", default="avx2")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--worker")
    a = p.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(a.worker, a.tokens, a.repeat)))
        return
    sys.path.insert(0, str(REPO))
    from integration import models

    from cpu_backend.tools.quantize import quantize_checkpoint

    root = models.default_cache_root()
    bf16 = models.qwen25_05b_shape(root)
    int4 = Path(os.environ.get("CPU_BACKEND_WNA16_OUT", bf16.parent / (bf16.name + "-gptq4-g128")))
    if not (int4 / "model.safetensors").exists():
        quantize_checkpoint(bf16, int4, "gptq", 4, 128, True)
    from benchmarks.e2e import memory_bandwidth

    bandwidth = [statistics.median(memory_bandwidth())]
    rows = []
    variants = [("bf16 (default)", bf16, "none", "1"), ("bf16, int8 LM head", bf16, "int8", "1")]
    for w4a8, label in (("0", "W4A16"), ("1", "W4A8")):
        default = " (default)" if w4a8 == "1" else ""
        variants += [(f"gptq int4 g128 {label}, bf16 LM head", int4, "none", w4a8),
                     (f"gptq int4 g128 {label}, int8 LM head{default}", int4, "int8", w4a8)]
    for name, model, head, w4a8 in variants:
        env = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", **os.environ, "VLLM_CPU_BACKEND_ISA": a.isa,
               "VLLM_CPU_BACKEND_LM_HEAD_QUANT": head, "VLLM_CPU_INT4_W4A8": w4a8,
               "PYTHONPATH": str(REPO)}
        proc = subprocess.run([sys.executable, "-m", "benchmarks.e2e_wna16", "--worker", str(model),
                               "--tokens", str(a.tokens), "--repeat", str(a.repeat)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{name} failed")
        r = json.loads(line[-1][7:])
        if r["lm_head_quant"] != [head]:
            raise SystemExit(f"{name}: the worker ran LM head {r['lm_head_quant']}, not {head}")
        if (r["int8_act_layers"] > 0) != (model == int4 and w4a8 == "1"):
            raise SystemExit(f"{name}: {r['int8_act_layers']} layers ran W4A8")
        rows.append((name, r, bytes_per_token(model, head == "int8")))
    bandwidth.append(statistics.median(memory_bandwidth()))
    roof = max(bandwidth)
    base = rows[0][1]["decode_tok_s"]
    text = ["# Batch-1 decode: GPTQ int4 vs bf16 (Qwen2.5-0.5B shape, our plugin)", "",
            f"ISA library {a.isa}; VLLM_CPU_OMP_THREADS_BIND="
            f"{os.environ.get('VLLM_CPU_OMP_THREADS_BIND', '0-1')}; {a.tokens} tokens, median of {a.repeat}; "
            f"read bandwidth before / after the runs {bandwidth[0]:.1f} / {bandwidth[1]:.1f} GB/s "
            f"(torch.sum, 2 threads); shared 2-core machine.", "",
            "| model | decode tok/s | vs bf16 | MB read per token | GB/s | % of read bandwidth "
            f"| {BATCH} prompts: generated tok/s | vs bf16 | linear methods |",
            "|---|---|---|---|---|---|---|---|---|"]
    base_batch = rows[0][1]["batch_tok_s"]
    for name, r, nbytes in rows:
        gbs = r["decode_tok_s"] * nbytes / 1e9
        text.append(f"| {name} | {r['decode_tok_s']:.2f} | {r['decode_tok_s'] / base:.2f}x | "
                    f"{nbytes / 1e6:.0f} | {gbs:.1f} | {100 * gbs / roof:.0f} | "
                    f"{r['batch_tok_s']:.1f} | {r['batch_tok_s'] / base_batch:.2f}x | "
                    f"{', '.join(r['linear_methods'])} |")
    stem = "e2e_wna16" if a.isa == "avx2" else f"e2e_wna16_{a.isa}"
    out = REPO / "benchmarks" / "results" / f"{stem}.md"
    out.write_text("\n".join(text) + "\n")
    print("\n".join(text))


if __name__ == "__main__":
    main()
