"""Run `vllm serve` (the host's own console script) as users type it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

VLLM = str(Path(sys.executable).parent / "vllm")
START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path):
        self.proc, self.port, self.log_path = proc, port, log_path
        self.base_url = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.base_url + path, timeout=30) as r:
            return r.read().decode()


def _env(overrides: dict | None) -> dict:
    """os.environ with `overrides` applied; a None value removes the variable."""
    env = dict(os.environ)
    for key, value in (overrides or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_vllm(args: list[str], env: dict | None = None, timeout: float = 180):
    """Run `vllm ARGS` to completion: (exit code, combined output)."""
    proc = subprocess.run(
        [VLLM, *args], env=_env(env), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=timeout,
    )
    return proc.returncode, proc.stdout


@contextlib.contextmanager
def serve(model: str, *args: str, env: dict | None = None, command: list[str] | None = None):
    """`vllm serve MODEL --host 127.0.0.1 --port P ARGS`, ready to take requests.

    `command` replaces `vllm serve` (e.g. the Docker image's entry point)."""
    port = free_port()
    log_file = tempfile.NamedTemporaryFile(prefix="vllm-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [*(command or [VLLM, "serve"]), model, "--host", "127.0.0.1", "--port", str(port), *args],
        env=_env(env), stdout=log_file, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    server = Server(proc, port, Path(log_file.name))
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{server.log()[-6000:]}")
            with contextlib.suppress(OSError):
                if server.get("/health") is not None:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve not ready in {START_TIMEOUT_S}s:\n{server.log()[-6000:]}")
            time.sleep(1)
        yield server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log_file.close()
