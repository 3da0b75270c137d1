"""cpu_backend.serve_exit: `vllm serve` exits 1 after the host logged an
engine death, 0 otherwise, and nothing changes outside `vllm serve`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = """
import logging, sys
sys.argv = [{argv0!r}, {argv1!r}]
from cpu_backend import serve_exit
serve_exit.install()
serve_exit.install()  # once per process
logging.getLogger("vllm").setLevel(logging.INFO)  # as vLLM's logging config does
log = logging.getLogger("vllm.entrypoints.openai.serving")
class EngineDeadError(Exception):
    pass
if {dead!r} == "exception":
    try:
        raise EngineDeadError("EngineCore encountered an issue.")
    except EngineDeadError:
        log.exception("Error in completion stream generator.")
elif {dead!r} == "after-sigterm":
    log.info("[shutdown] API server: shutdown triggered")
    try:
        raise EngineDeadError("EngineCore encountered an issue.")
    except EngineDeadError:
        log.exception("AsyncLLM output_handler failed.")
elif {dead!r} == "notice":
    log.warning("[shutdown] MPClient: engine core exited unexpectedly; starting cleanup")
else:
    log.error("some request failed")
"""


@pytest.mark.parametrize("argv,dead,code", [
    (("/venv/bin/vllm", "serve"), "exception", 1),
    (("/venv/bin/vllm", "serve"), "notice", 1),
    (("/venv/bin/vllm", "serve"), "none", 0),
    (("/venv/bin/vllm", "serve"), "after-sigterm", 0),  # the drain's own teardown
    (("/venv/bin/python", "my_app.py"), "exception", 0),  # an LLM(...) user's process
])
def test_exit_status(argv, dead, code):
    script = SCRIPT.format(argv0=argv[0], argv1=argv[1], dead=dead)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert proc.returncode == code, proc.stderr
    assert ("cpu_backend: the engine died while serving" in proc.stderr) == (code == 1)
