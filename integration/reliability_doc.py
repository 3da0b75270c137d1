"""Render benchmarks/results/reliability.json (written by the
integration/test_reliability_*.py runs) into docs/reliability.md, between the
markers. Every `integration.reliability.record` call re-renders, so the page
follows the last run; plugin_tests/test_reliability_doc.py checks they agree.

    python -m integration.reliability_doc          # rewrite the page
    python -m integration.reliability_doc --check  # exit 1 if out of date
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "reliability.json"
DOC = REPO / "docs" / "reliability.md"
BEGIN, END = "<!-- reliability:begin -->", "<!-- reliability:end -->"


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join("" if c is None else str(c) for c in row) + " |" for row in rows]
    return out + [""]


def _pct(d: dict) -> str:
    return ", ".join(f"{k} {v:+.2f}%" for k, v in sorted(d.items()))


def render(data: dict) -> str:
    lines: list[str] = []
    load, faults, bad = data.get("load", {}), data.get("faults", {}), data.get("bad_input", {})
    lost = sum(r.get("lost", 0) + r.get("wrong_output", 0) for r in load.values()) + sum(
        r.get("lost", 0) + r.get("wrong_output", 0) for r in faults.values()
        if r.get("exit_code") == 0)
    runs = [load[k] for k in ("short", "long") if k in load]
    lines += [f"**Requests lost or wrong under load and SIGTERM: {lost}** (target 0).", ""]

    lines += ["### Load", ""]
    lines += _table(
        ["run", "s", "clients", "requests", "KV tokens", "preemptions", "identical to alone",
         "HTTP errors", "lost", "wrong", "RSS growth after warm-up", "health failures",
         "recorded"],
        [[k, r["seconds"], r["clients"], r["requests"], r["kv_tokens"], r["preemptions"],
          r["completed_identical"], r["http_errors"], r["lost"], r["wrong_output"],
          _pct(r["rss_growth_pct"]), r["health_failures"], r["recorded"]]
         for k, r in zip([k for k in ("short", "long") if k in load], runs)])
    if "disconnect" in load:
        r = load["disconnect"]
        lines += [f"Disconnects: {r['clients']} streaming clients asking for "
                  f"{r.get('n', 1)} x {r['max_tokens']} tokens each closed the stream after 4 "
                  f"chunks; {r['tokens_generated']} tokens were generated in all "
                  f"(of {r['clients'] * r.get('n', 1) * r['max_tokens']} asked), then "
                  f"running requests {r['running_after']:g} and KV-cache usage "
                  f"{r['kv_usage_after']:g} (peak seen {r['peak_kv_usage']:g}) within "
                  f"{r.get('idle_after_s', '?')} s"
                  + (f", where finishing what was asked would have taken ~{r['unfinished_work_s']:g} s "
                     "more at the rate seen" if "unfinished_work_s" in r else "")
                  + f" ({r['recorded']}).", ""]

    lines += ["### Faults", ""]
    lines += _table(
        ["fault", "exit code", "exit after (s)", "/health failing after (s)", "requests",
         "completed", "errors", "lost", "processes left", "shm segments leaked", "recorded"],
        [[r["fault"], r["exit_code"], r["exit_s"], r.get("unhealthy_s", ""), r["requests"],
          r["completed"], r.get("errors", r.get("http_errors", 0) + r.get("lost", 0)),
          r.get("lost", ""), r["processes_left"], len(r.get("shm_leaked", [])), r["recorded"]]
         for r in faults.values()])

    lines += ["### Bad input", ""]
    req = bad.get("requests")
    if req:
        lines += [f"Requests to one running server ({req['recorded']}); a good request after "
                  f"them: HTTP {req['good_request_after']}.", ""]
        lines += _table(["request", "HTTP status", "healthy after"],
                        [[name, c["status"], c["healthy_after"]]
                         for name, c in req["cases"].items()])
    starts = {k: v for k, v in bad.items() if k != "requests"}
    if starts:
        lines += ["Settings and checkpoints refused at start-up with an error naming the "
                  "setting, tensor or file (`config check`: the platform's check, in-process; "
                  "`vllm serve`: a real start, which exits non-zero):", ""]
        lines += _table(["input", "checked through", "refused", "named", "recorded"],
                        [[f"`{k}`", v.get("path", ""), v["refused"], v.get("named", True),
                          v["recorded"]] for k, v in sorted(starts.items())])
    return "\n".join(lines).rstrip() + "\n"


def _load() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {}


def rendered_page(data: dict | None = None) -> str:
    text = DOC.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    body = render(_load() if data is None else data)
    return f"{head}{BEGIN}\n{body}{END}{tail}"


def write() -> None:
    DOC.write_text(rendered_page())


def main(argv: list[str]) -> int:
    if "--check" in argv:
        if DOC.read_text() != rendered_page():
            print(f"{DOC} is out of date: python -m integration.reliability_doc", file=sys.stderr)
            return 1
        return 0
    write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
