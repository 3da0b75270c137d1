"""Where a single rank's worker runs, and on which CPUs its threads run.

- `LLM(...)` with the worker in the caller's process
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as in notebooks and debuggers): the
  worker keeps its bound thread count through start-up, so the model runs on
  every bound CPU, one OpenMP thread pinned per CPU; an `LLM` left to the
  interpreter's exit shuts down without a traceback.
- `LLM(...)` by default: the worker runs inside the engine-core process (no
  separate worker process), on a thread of its own when it is bound to every
  CPU (so async scheduling still overlaps), with the same pinning, and gives
  the same tokens;
- `LLM(...)` with `VLLM_CPU_BACKEND_WORKER_IN_ENGINE=0`: the host's layout, a
  worker process beside the engine core, pinned by the environment the host's
  executor gives it; the same tokens again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

from cpu_backend.worker.thread_executor import THREAD_NAME
from integration.conftest import greedy, report, running_llm
from integration.server import _env

PROMPT = [5, 17, 29, 3, 101]
NEW_TOKENS = 12
SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
import torch
llm = LLM(model=sys.argv[1], dtype="float32", seed=0, max_model_len=256)
(rep,) = llm.collective_rpc("cpu_backend_report")
out = llm.generate([{"prompt_token_ids": json.loads(sys.argv[2])}],
                   SamplingParams(temperature=0, max_tokens=int(sys.argv[3]), ignore_eos=True), use_tqdm=False)
print("RESULT " + json.dumps({"bound_cpus": rep["bound_cpus"], "worker_threads": rep["torch_threads"],
      "caller_threads": torch.get_num_threads(), "omp_thread_cpus": rep["omp_thread_cpus"],
      "tokens": list(out[0].outputs[0].token_ids)}))
"""


# Every CPU: "auto" may leave one for the frontend, and one thread would hide the bug.
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "all", "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_single_rank_worker_pins_its_threads_in_every_layout(tiny_llama, monkeypatch):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, tiny_llama, json.dumps(PROMPT), str(NEW_TOKENS)], capture_output=True, text=True, timeout=300,
        env=_env({**ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    # The LLM is left to the interpreter's exit: its worker thread shuts down quietly.
    assert "Traceback" not in proc.stderr, proc.stderr[-6000:]
    got = json.loads(lines[0].removeprefix("RESULT "))
    cpus = got["bound_cpus"]
    assert len(cpus) == len(os.sched_getaffinity(0)), got
    # One process: the report's count is the caller's too.
    assert got["worker_threads"] == got["caller_threads"] == len(cpus), got
    assert got["omp_thread_cpus"] == [[cpu] for cpu in cpus], got

    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("VLLM_CPU_BACKEND_WORKER_IN_ENGINE", raising=False)  # the default
    with running_llm(tiny_llama, dtype="float32", max_model_len=256) as llm:
        rep = report(llm)
        engine = psutil.Process(rep["pid"])
        title, parent = " ".join(engine.cmdline()), engine.ppid()
        children = engine.children(recursive=True)
        (want,) = greedy(llm, [PROMPT], NEW_TOKENS)
    assert rep["torch_threads"] == len(cpus)
    assert parent == os.getpid() and title.startswith("VLLM::EngineCore"), title
    assert not children, [" ".join(c.cmdline()) for c in children]  # no worker process
    assert rep["thread"].startswith(THREAD_NAME), rep["thread"]
    assert rep["omp_thread_cpus"] == [[cpu] for cpu in rep["bound_cpus"]], rep
    assert got["tokens"] == list(want.outputs[0].token_ids)

    monkeypatch.setenv("VLLM_CPU_BACKEND_WORKER_IN_ENGINE", "0")
    with running_llm(tiny_llama, dtype="float32", max_model_len=256) as llm:
        rep = report(llm)
        worker = psutil.Process(rep["pid"])
        title, engine_title = " ".join(worker.cmdline()), " ".join(psutil.Process(worker.ppid()).cmdline())
        (own_process,) = greedy(llm, [PROMPT], NEW_TOKENS)
    assert title.startswith("VLLM::Worker") and engine_title.startswith("VLLM::EngineCore"), (title, engine_title)
    assert rep["torch_threads"] == len(cpus)
    assert rep["omp_thread_cpus"] == [[cpu] for cpu in rep["bound_cpus"]], rep
    assert list(own_process.outputs[0].token_ids) == got["tokens"]
