"""`LLM(...)` with the worker in the caller's process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as in notebooks and debuggers): the
worker keeps its bound thread count through start-up, so the model runs on
every bound CPU, and its tokens equal the multiprocess engine's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

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
      "caller_threads": torch.get_num_threads(), "tokens": list(out[0].outputs[0].token_ids)}))
"""


# Every CPU: "auto" may leave one for the frontend, and one thread would hide the bug.
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "all", "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_in_process_worker_keeps_its_threads_and_tokens(tiny_llama, monkeypatch):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, tiny_llama, json.dumps(PROMPT), str(NEW_TOKENS)], capture_output=True, text=True, timeout=300,
        env=_env({**ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = json.loads(lines[0].removeprefix("RESULT "))
    cpus = got["bound_cpus"]
    assert len(cpus) == len(os.sched_getaffinity(0)), got
    # One process: the report's count is the caller's too.
    assert got["worker_threads"] == got["caller_threads"] == len(cpus), got

    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    with running_llm(tiny_llama, dtype="float32", max_model_len=256) as llm:
        assert report(llm)["torch_threads"] == len(cpus)
        (want,) = greedy(llm, [PROMPT], NEW_TOKENS)
    assert got["tokens"] == list(want.outputs[0].token_ids)
