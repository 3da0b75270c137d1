"""End to end: 64-prompt throughput of a compressed-tensors W8A8 INT8 checkpoint
on our plugin vs the bf16 model on our plugin vs the same W8A8 checkpoint on
the host alone (VLLM_PLUGINS=none: the in-tree CPU platform, oneDNN int8),
one fresh subprocess per variant, same run.

    .venv/bin/python -m benchmarks.e2e_w8a8 [--avx2-emulation | --avx-vnni-emulation] [--isa avx2]
                                            [--prompts 64] [--prompt-len 64] [--tokens 32] [--repeat 2]

Default: every variant on this CPU's native ISA (ours: the library the
dispatcher picks; the host: oneDNN's own pick, AVX-512 VNNI here).
`--avx2-emulation`: every variant limited to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2,
ATEN_CPU_CAPABILITY=avx2; ours on its avx2 library), as on an AVX2-only CPU;
writes e2e_w8a8_avx2.md. `--avx-vnni-emulation`: the same with AVX-VNNI, as on
an Intel client CPU (Alder Lake and later: AVX2 + 256-bit VNNI, no AVX-512):
oneDNN at AVX2_VNNI, ATen at avx2, ours on its avx_vnni library; writes
e2e_w8a8_avx_vnni.md. Under either emulation torch's CPU capability queries
also hide AVX-512 and AMX (benchmarks/avx2_cpu), so the host loads its AVX2
`_C` build. `--isa` forces our library only (not the host's).

Model: integration/models.qwen25_05b_shape (Qwen2.5-0.5B's shape, random bf16
weights, tied LM head in bf16), W8A8 dynamic per-token symmetric written once
by `cpu_backend.tools.quantize` (ours runs its LM head on an int8 copy, the
default for quantized checkpoints). Each variant: LLM(dtype=bfloat16), one warm-up
batch, then `--repeat` timed batches of `--prompts` prompts (`--prompt-len`
random tokens each) generating `--tokens` tokens; throughput = generated
tokens / wall time, and total (prompt + generated) tokens / wall time; medians.
Writes benchmarks/results/e2e_w8a8.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worker(model: str, prompts: int, prompt_len: int, tokens: int, repeat: int,
           ours: bool) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    if ours:
        from cpu_backend.quantization import register

        register()
    llm = LLM(model=model, dtype="bfloat16", max_model_len=512, seed=0)
    rng = random.Random(0)
    batch = [{"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(prompt_len)]}
             for _ in range(prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(batch[:8], params, use_tqdm=False)  # warm-up
    gen_rates, total_rates = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        gen = sum(len(o.outputs[0].token_ids) for o in outs)
        gen_rates.append(gen / dt)
        total_rates.append((gen + prompts * prompt_len) / dt)
    info = {"quantization": llm.llm_engine.vllm_config.model_config.quantization}
    if ours:
        (rep,) = llm.collective_rpc("cpu_backend_report")
        info.update(linear_methods=rep["linear_methods"], isa=rep["kernels_isa"],
                    w8a8_calls=rep["w8a8_linear_calls"])
    return {"gen_tok_s": statistics.median(gen_rates), "total_tok_s": statistics.median(total_rates),
            "samples": gen_rates, **info}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--isa", default=None, help="force our kernel library (not the host's ISA)")
    p.add_argument("--avx2-emulation", action="store_true",
                   help="all variants limited to AVX2 (oneDNN and ATen), ours on its avx2 library")
    p.add_argument("--avx-vnni-emulation", action="store_true",
                   help="all variants limited to AVX2 + AVX-VNNI (oneDNN AVX2_VNNI, ATen avx2), ours on "
                   "its avx_vnni library")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--worker")
    p.add_argument("--ours", type=int, default=1)
    a = p.parse_args()
    isa_env = {}
    if a.avx2_emulation or a.avx_vnni_emulation:
        from benchmarks.isa_runs import TORCH_ISA_ENV, as_avx2_cpu

        tier = "avx2" if a.avx2_emulation else "avx_vnni"
        isa_env = dict(TORCH_ISA_ENV[tier])
        a.isa = a.isa or tier
    if a.worker:
        print("RESULT " + json.dumps(worker(a.worker, a.prompts, a.prompt_len, a.tokens, a.repeat,
                                            bool(a.ours))))
        return
    sys.path.insert(0, str(REPO))
    from integration import models

    from cpu_backend.tools.quantize import quantize_checkpoint

    root = models.default_cache_root()
    bf16 = models.qwen25_05b_shape(root)
    w8a8 = Path(os.environ.get("CPU_BACKEND_W8A8_OUT", bf16.parent / (bf16.name + "-w8a8-dyn")))
    if not (w8a8 / "model.safetensors").exists():
        quantize_checkpoint(bf16, w8a8, "compressed-tensors", 8, -1, True, activations="dynamic")
    rows = []
    variants = (("bf16, our plugin", bf16, True), ("W8A8, our plugin", w8a8, True),
                ("W8A8, host alone (VLLM_PLUGINS=none)", w8a8, False))
    for name, model, ours in variants:
        env = {**os.environ, **isa_env, "PYTHONPATH": str(REPO)}
        if isa_env:  # the host on its AVX2 `_C` build too, as on such a CPU
            env = as_avx2_cpu(env)
        if a.isa:
            env["VLLM_CPU_BACKEND_ISA"] = a.isa
        if not ours:
            env["VLLM_PLUGINS"] = "none"
        proc = subprocess.run([sys.executable, "-m", "benchmarks.e2e_w8a8", "--worker", str(model),
                               "--prompts", str(a.prompts), "--prompt-len", str(a.prompt_len),
                               "--tokens", str(a.tokens), "--repeat", str(a.repeat),
                               "--ours", str(int(ours))],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{name} failed")
        rows.append((name, json.loads(line[-1][7:])))
        print(name, rows[-1][1], flush=True)
    base = rows[0][1]["gen_tok_s"]
    text = ["# 64-prompt throughput: W8A8 INT8 vs bf16 (Qwen2.5-0.5B shape)", "",
            f"Our kernel library: {rows[0][1].get('isa')}; "
            + (f"{a.isa} emulation for every variant ({' '.join(f'{k}={v}' for k, v in isa_env.items())}, "
               "and torch's CPU capability queries without AVX-512/AMX, so the host loads its AVX2 "
               "`_C` build: benchmarks/avx2_cpu); "
               if isa_env else "native ISA for every variant (the host's oneDNN picks its own); ")
            + f"{a.prompts} prompts x {a.prompt_len} tokens, {a.tokens} generated each, median of "
            f"{a.repeat}; async scheduling as each backend defaults. Command: "
            f"`python -m benchmarks.e2e_w8a8 {' '.join(sys.argv[1:])}`.", "",
            "| variant | generated tok/s | total tok/s | vs bf16 | quantization | linear methods |",
            "|---|---|---|---|---|---|"]
    for name, r in rows:
        text.append(f"| {name} | {r['gen_tok_s']:.2f} | {r['total_tok_s']:.1f} | "
                    f"{r['gen_tok_s'] / base:.2f}x | {r['quantization']} | "
                    f"{', '.join(r.get('linear_methods', ['(host)']))} |")
    out = REPO / "benchmarks" / "results" / (f"e2e_w8a8_{a.isa}.md" if isa_env else "e2e_w8a8.md")
    out.write_text("\n".join(text) + "\n")
    print("\n".join(text))


if __name__ == "__main__":
    main()
