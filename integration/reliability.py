"""Helpers for the reliability tests (test_reliability_*.py): /metrics parsing,
the server's process tree, concurrent streaming clients, and the results file
that docs/reliability.md is generated from (python -m integration.reliability_doc).
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "reliability.json"
LONG = os.environ.get("CPU_BACKEND_LONG_TESTS") == "1"

_METRIC_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def metric(text: str, name: str) -> float:
    """Sum of every sample of `name` (all label sets) in a Prometheus text page."""
    total, seen = 0.0, False
    for line in text.splitlines():
        m = _METRIC_RE.match(line)
        if m and m.group(1) == name:
            total += float(m.group(3))
            seen = True
    if not seen:
        raise KeyError(f"metric {name} not in /metrics")
    return total


def processes(server_proc) -> dict[str, psutil.Process]:
    """The server's processes by title: APIServer, EngineCore, Worker_TP0, ..."""
    root = psutil.Process(server_proc.pid)
    found = {"APIServer": root}
    for child in root.children(recursive=True):
        try:
            title = " ".join(child.cmdline())
        except psutil.Error:
            continue
        m = re.match(r"VLLM::(\S+)", title)
        if m:
            found[m.group(1)] = child
    return found


def rss(procs: dict[str, psutil.Process]) -> dict[str, int]:
    out = {}
    for name, p in procs.items():
        try:
            out[name] = p.memory_info().rss
        except psutil.Error:
            out[name] = -1
    return out


def tree_pids(pid: int) -> set[int]:
    try:
        root = psutil.Process(pid)
        return {pid, *(c.pid for c in root.children(recursive=True))}
    except psutil.NoSuchProcess:
        return set()


def alive(pids: set[int]) -> list[int]:
    """The pids that still exist as running (not zombie) processes."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return sorted(out)


def shm_segments() -> set[str]:
    """Our shared-memory names (cpu_backend.shm_group.PREFIX) and the host's
    (vLLM's message queues use multiprocessing.shared_memory: psm_*)."""
    from cpu_backend.shm_group import PREFIX, SHM_DIR

    return {p.name for p in SHM_DIR.iterdir()
            if p.name.startswith(PREFIX) or p.name.startswith("psm_")}


def mapped_shm(pids: set[int] | None = None) -> set[str]:
    """/dev/shm names that live processes (all, or `pids`) map."""
    names = set()
    files = ([Path(f"/proc/{p}/maps") for p in pids] if pids is not None
             else Path("/proc").glob("[0-9]*/maps"))
    for maps in files:
        try:
            text = maps.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if "/dev/shm/" in line and not line.endswith("(deleted)"):
                names.add(line.rsplit("/", 1)[1])
    return names


def leaked_shm(server_segments: set[str], settle_s: float = 15) -> set[str]:
    """Of the segments a server's processes mapped (`mapped_shm(tree)` while it
    ran) plus any `cpubk-*` of ours, those still in /dev/shm and mapped by no
    live process, after giving the resource tracker `settle_s` to unlink them.
    (Other engines on the machine create psm_* segments too: not counted.)"""
    from cpu_backend.shm_group import PREFIX

    deadline = time.monotonic() + settle_s
    while True:
        present = shm_segments()
        mine = (server_segments & present) | {n for n in present if n.startswith(PREFIX)}
        leaked = mine - mapped_shm()
        if not leaked or time.monotonic() > deadline:
            return leaked
        time.sleep(1)


def token_prompts(n: int, seed: int, lengths=(4, 24, 60, 120, 200)) -> list[list[int]]:
    """Mixed-length random token-id prompts (tiny models' vocab is 1000)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 700) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


@dataclass
class Outcome:
    index: int  # prompt index
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None  # "http <status>" for clean errors, else the exception
    clean_error: bool = False


def stream_completion(client, model: str, prompt, max_tokens: int, index: int,
                      stop_after_chunks: int | None = None, n: int = 1,
                      temperature: float = 0.0) -> Outcome:
    """One streaming greedy completion; `stop_after_chunks` closes it early (a
    client that goes away mid-stream)."""
    import openai

    out = Outcome(index)
    try:
        stream = client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature, stream=True,
            extra_body={"ignore_eos": True}, **({"n": n} if n > 1 else {}),
        )
        for i, chunk in enumerate(stream):
            if stop_after_chunks is not None and i >= stop_after_chunks:
                stream.response.close()
                out.finish_reason = "disconnected"
                return out
            if chunk.choices:
                out.text += chunk.choices[0].text
                if chunk.choices[0].finish_reason:
                    out.finish_reason = chunk.choices[0].finish_reason
    except openai.APIStatusError as e:
        out.error, out.clean_error = f"http {e.status_code}: {e.message[:200]}", True
    except Exception as e:  # noqa: BLE001 - connection resets, timeouts: not clean
        out.error = f"{type(e).__name__}: {e}"[:300]
    return out


@dataclass
class Load:
    """`clients` threads, each issuing streaming requests back to back until
    `seconds` have passed (or `stop` is set)."""

    base_url: str
    model: str
    prompts: list
    max_tokens: int
    clients: int
    seconds: float
    seed: int = 0
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> list[Outcome]:
        import openai

        lock = threading.Lock()
        deadline = time.monotonic() + self.seconds

        def worker(k: int):
            rng = random.Random(self.seed * 1000 + k)
            client = openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused",
                                   max_retries=0, timeout=300)
            while time.monotonic() < deadline and not self.stop.is_set():
                i = rng.randrange(len(self.prompts))
                o = stream_completion(client, self.model, self.prompts[i], self.max_tokens, i)
                with lock:
                    self.outcomes.append(o)
                if o.error and not o.clean_error:
                    time.sleep(0.5)  # server gone: don't spin

        threads = [threading.Thread(target=worker, args=(k,), daemon=True)
                   for k in range(self.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return self.outcomes


def record(section: str, key: str, row: dict) -> None:
    """Merge one result row into RESULTS[section][key] (the doc's source)."""
    import fcntl

    from integration import reliability_doc

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    # Test modules may run in parallel processes: one writer at a time.
    with open(RESULTS.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        data.setdefault(section, {})[key] = {
            **row, "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        tmp = RESULTS.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        tmp.replace(RESULTS)
        reliability_doc.write()
