"""`vllm serve` exits non-zero when its engine died.

Why: the host's API server (vllm/entrypoints/launchers/launcher.py,
`watchdog_loop` / `terminate_if_errored`) answers an engine death (e.g. a
tensor-parallel worker killed) by stopping uvicorn the same graceful way as
after SIGTERM, and `vllm serve` then returns exit status 0. Supervisors
(systemd `Restart=on-failure`, Docker `--restart on-failure`, Kubernetes
Jobs) read that as a clean stop. We do not patch the host: in the API-server
process we watch the host's own log records for its `EngineDeadError` (and
its "engine core exited unexpectedly" notice), and at interpreter exit turn a
run that saw one into exit status 1, with a line saying why.

Installed once per process by CpuBackendPlatform.check_and_update_config,
only in the `vllm serve` command (never in a user's `LLM(...)` process).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

EXIT_STATUS = 1
_state = {"installed": False, "dead": None, "stopping": False}
# The host's line when SIGTERM/SIGINT starts a shutdown: EngineDeadErrors
# logged after it are the shutdown itself (output handler racing teardown).
_SHUTDOWN_TRIGGERED = "[shutdown] API server: shutdown triggered"


def _is_vllm_serve() -> bool:
    return (len(sys.argv) > 1 and os.path.basename(sys.argv[0]) == "vllm"
            and sys.argv[1] == "serve")


class _EngineDeathWatch(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        if _state["dead"] is not None or _state["stopping"]:
            return
        if record.getMessage().startswith(_SHUTDOWN_TRIGGERED):
            _state["stopping"] = True
            return
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and type(exc).__name__ == "EngineDeadError":
            _state["dead"] = "EngineDeadError"
        elif "engine core exited unexpectedly" in record.getMessage():
            _state["dead"] = "engine core exited unexpectedly"


def _exit_if_engine_died() -> None:
    reason = _state["dead"]
    if reason is None:
        return
    print(f"cpu_backend: the engine died while serving ({reason}, see the log above); "
          f"vllm serve exits with status {EXIT_STATUS}.", file=sys.stderr, flush=True)
    # os._exit skips the atexit handlers registered before ours (logging's
    # among them): flush the log. Shared memory of the dead engine is
    # unlinked by multiprocessing's resource tracker when it sees us exit.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(EXIT_STATUS)


def install() -> None:
    if _state["installed"] or not _is_vllm_serve():
        return
    _state["installed"] = True
    logging.getLogger("vllm").addHandler(_EngineDeathWatch())
    atexit.register(_exit_if_engine_died)
