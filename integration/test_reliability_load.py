"""Sustained load against `vllm serve` with our plugin, more demand than the
KV cache holds, clients that go away mid-stream, and SIGTERM under load.

One server (tiny random Llama, fp32, 64 blocks of 16 tokens = 1024 tokens of
KV, prefix caching off so every request needs its own blocks). 32 streaming
`openai` clients send mixed-length prompts (4-200 tokens, 48 new tokens,
greedy, ignore_eos) back to back: up to 32 x 248 tokens wanted at once, about
8x the cache, so the scheduler preempts all the time. Pass: every request
either streams exactly the text the same prompt gets when sent alone (the
references are taken first, one at a time) or gets an HTTP error status; the
server stays healthy; the RSS of the engine-core process (which runs the
worker: one rank) after a warm-up round grows < 5% over the run. Preemptions come from /metrics.

Then 12 clients close their streams after 4 chunks: no request and no KV
block stays in use. Last, SIGTERM with 32 streams in flight: with
`--shutdown-timeout` they all finish with their alone-output, exit status 0,
no process or shared-memory segment left.

Default run: 40 s of load (~3 minutes with start-up). `CPU_BACKEND_LONG_TESTS=1`: 150 s.

    CPU_BACKEND_LONG_TESTS=1 pytest -m reliability integration/test_reliability_load.py
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from integration import reliability as rel
from integration.server import serve

pytestmark = [pytest.mark.slow, pytest.mark.reliability]

MODEL = "tiny"
BLOCKS, BLOCK = 64, 16
KV_BYTES = BLOCKS * BLOCK * 1024  # tiny-llama fp32: 1 KiB of K+V per token
SERVE_ARGS = (
    "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "512",
    "--block-size", str(BLOCK), "--kv-cache-memory-bytes", str(KV_BYTES),
    "--no-enable-prefix-caching",
    # SIGTERM drains: in-flight requests get up to this long to finish.
    "--shutdown-timeout", "120",
)
CLIENTS = 32
NEW_TOKENS = 48
SECONDS = 150 if rel.LONG else 40
RSS_GROWTH_LIMIT = 0.05


@pytest.fixture(scope="module")
def server(tiny_llama):
    # Explicit KV bytes: VLLM_CPU_KVCACHE_SPACE would override them.
    with serve(tiny_llama, *SERVE_ARGS, env={"VLLM_CPU_KVCACHE_SPACE": None}) as s:
        yield s


def _metrics(server) -> str:
    return server.get("/metrics")


PROMPTS = rel.token_prompts(24, seed=1)


@pytest.fixture(scope="module")
def alone(server):
    """Each prompt's output when it is the only request."""
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    out = [rel.stream_completion(client, MODEL, p, NEW_TOKENS, i) for i, p in enumerate(PROMPTS)]
    assert all(o.error is None and o.finish_reason == "length" for o in out), out
    return out


def test_load_above_kv_capacity_loses_nothing(server, alone):
    assert f"{BLOCKS} blocks of {BLOCK} tokens" in server.log()
    prompts = PROMPTS

    procs = rel.processes(server.proc)
    # One rank: the worker runs in the engine core, no process of its own.
    assert "EngineCore" in procs and not any(n.startswith("Worker") for n in procs), procs
    # Warm-up: one round at full concurrency, so allocator pools and the
    # server's per-connection state exist before the baseline.
    rel.Load(server.base_url, MODEL, prompts, NEW_TOKENS, CLIENTS, seconds=8, seed=99).run()
    rss_start = rel.rss(procs)
    preempt_start = rel.metric(_metrics(server), "vllm:num_preemptions_total")

    load = rel.Load(server.base_url, MODEL, prompts, NEW_TOKENS, CLIENTS, SECONDS, seed=1)
    samples, health = [], []

    def watch():
        while not load.stop.is_set():
            samples.append(rel.rss(procs))
            try:
                health.append(server.get("/health") is not None)
            except OSError:
                health.append(False)
            load.stop.wait(2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    outcomes = load.run()
    elapsed = time.monotonic() - t0
    load.stop.set()
    watcher.join()
    rss_end = rel.rss(procs)
    preemptions = rel.metric(_metrics(server), "vllm:num_preemptions_total") - preempt_start

    wrong = [o for o in outcomes if o.error is None and
             (o.text != alone[o.index].text or o.finish_reason != "length")]
    clean_errors = [o for o in outcomes if o.clean_error]
    lost = [o for o in outcomes if o.error and not o.clean_error]
    growth = {name: (rss_end[name] - rss_start[name]) / rss_start[name]
              for name in procs if name != "APIServer"}
    row = {
        "seconds": round(elapsed), "clients": CLIENTS, "requests": len(outcomes),
        "kv_tokens": BLOCKS * BLOCK, "completed_identical": len(outcomes) - len(wrong)
        - len(clean_errors) - len(lost), "wrong_output": len(wrong),
        "http_errors": len(clean_errors), "lost": len(lost), "preemptions": int(preemptions),
        "rss_growth_pct": {k: round(100 * v, 2) for k, v in growth.items()},
        "rss_mib_start": {k: v >> 20 for k, v in rss_start.items()},
        "rss_peak_mib": {k: max(s[k] for s in samples) >> 20 for k in rss_start},
        "health_checks": len(health), "health_failures": health.count(False),
    }
    rel.record("load", "long" if rel.LONG else "short", row)
    print(row)
    assert server.proc.poll() is None, "the server died under load"
    assert all(health), "the server reported unhealthy under load"
    assert not lost, lost[:3]
    assert not wrong, [(o.index, o.text[:60], alone[o.index].text[:60]) for o in wrong[:3]]
    assert len(outcomes) >= CLIENTS * 2
    assert preemptions > 0, "demand was meant to exceed the KV cache"
    assert all(g < RSS_GROWTH_LIMIT for g in growth.values()), row


def test_disconnected_clients_free_their_kv_blocks(server):
    """Clients that close the stream after a few chunks: their requests stop
    (far fewer tokens generated than asked for) and no request, and no KV
    block, stays in use. (The host's metrics do not count aborts.)"""
    import openai

    def scrape():
        m = _metrics(server)
        return {name: rel.metric(m, name) for name in (
            "vllm:num_requests_running", "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc", "vllm:generation_tokens_total")}

    # Short prompts, long answers, 32 sequences each: 184k tokens through a
    # 1024-token KV cache take far longer than the disconnects need, even on a
    # quiet machine (with 8 sequences each a quiet machine nearly finished
    # everything before the clients had read their 4 chunks); a client closes
    # after its 4th chunk.
    n, max_tokens, seqs = 12, 480, 32
    prompts = rel.token_prompts(n, seed=2, lengths=(4, 8, 16))
    before = scrape()
    outcomes = []
    peak = {"running": 0.0, "kv": 0.0}
    done = threading.Event()

    def watch():
        while not done.is_set():
            s = scrape()
            peak["running"] = max(peak["running"], s["vllm:num_requests_running"])
            peak["kv"] = max(peak["kv"], s["vllm:kv_cache_usage_perc"])
            done.wait(0.1)

    def client(i):
        c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        outcomes.append(rel.stream_completion(c, MODEL, prompts[i], max_tokens, i,
                                              stop_after_chunks=4, n=seqs,
                                              temperature=1.0))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    closed = time.monotonic()
    deadline = closed + 30
    while True:
        after = scrape()
        idle = (after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
                and after["vllm:kv_cache_usage_perc"] == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    done.set()
    watcher.join()
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    row = {"clients": n, "max_tokens": max_tokens, "n": seqs,
           "idle_after_s": round(time.monotonic() - closed, 1),
           "tokens_generated": int(generated), "peak_running": peak["running"],
           "peak_kv_usage": round(peak["kv"], 3), "kv_usage_after": after["vllm:kv_cache_usage_perc"],
           "running_after": after["vllm:num_requests_running"]}
    # what was asked would take this long at the rate seen (ignore_eos)
    rate = generated / max(closed - started, 1e-3)
    row["unfinished_work_s"] = round((n * seqs * max_tokens - generated) / max(rate, 1e-3), 1)
    rel.record("load", "disconnect", row)
    print(row)
    assert [o.finish_reason for o in outcomes] == ["disconnected"] * n, outcomes
    assert idle, after
    # The server went idle sooner than it could have finished what was asked
    # (ignore_eos: every sequence wants all its tokens) at the rate it had
    # been generating: the disconnected requests were aborted, their blocks
    # freed. (How many tokens run before the disconnects land depends on the
    # machine's speed, so that count alone proves nothing.)
    assert generated < n * seqs * max_tokens and row["idle_after_s"] < row["unfinished_work_s"], row
    assert server.get("/health") is not None


def test_sigterm_during_load_drains_and_exits_0(server, alone):
    """Last test of the module: SIGTERM to the server while 32 streams are in
    flight. With --shutdown-timeout they all finish with their alone-output (or
    a clean HTTP error); the server exits 0 and leaves no process behind."""
    import openai

    tree = rel.tree_pids(server.proc.pid)
    segments = rel.mapped_shm(tree)
    started = threading.Semaphore(0)
    outcomes = []

    def client(k):
        i = k % len(PROMPTS)
        c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                          timeout=300)
        o = rel.Outcome(i)
        try:
            stream = c.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=NEW_TOKENS,
                                          temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
            for n, chunk in enumerate(stream):
                if n == 0:
                    started.release()
                if chunk.choices:
                    o.text += chunk.choices[0].text
                    o.finish_reason = chunk.choices[0].finish_reason or o.finish_reason
        except openai.APIStatusError as e:
            o.error, o.clean_error = f"http {e.status_code}", True
            started.release()
        except Exception as e:  # noqa: BLE001
            o.error = f"{type(e).__name__}: {e}"
            started.release()
        outcomes.append(o)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=120), "streams did not start"
    server.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    for t in threads:
        t.join(timeout=180)
    code = server.proc.wait(timeout=180)
    exit_s = time.monotonic() - t0
    time.sleep(2)
    left = rel.alive(tree - {server.proc.pid})
    shm_leaked = rel.leaked_shm(segments)
    wrong = [o for o in outcomes if o.error is None and
             (o.text != alone[o.index].text or o.finish_reason != "length")]
    lost = [o for o in outcomes if o.error and not o.clean_error]
    row = {"fault": "SIGTERM with 32 streams in flight (--shutdown-timeout 120)",
           "exit_code": code, "exit_s": round(exit_s, 1), "requests": len(outcomes),
           "completed": sum(o.error is None for o in outcomes) - len(wrong),
           "wrong_output": len(wrong), "http_errors": sum(o.clean_error for o in outcomes),
           "lost": len(lost), "processes_left": len(left), "shm_leaked": sorted(shm_leaked),
           "shm_segments_watched": len(segments)}
    rel.record("faults", "sigterm_under_load", row)
    print(row)
    assert code == 0, server.log()[-4000:]
    assert len(outcomes) == CLIENTS
    assert not lost and not wrong, (lost[:3], wrong[:3])
    assert not left, left
    assert not shm_leaked, shm_leaked
