"""setup.py's CPU_BACKEND_BUILD_ISAS: which kernel libraries a build compiles.

`native` (./run.sh's local install) must build a library for every path
`cpu_backend.isa` can select on this CPU and nothing else; unset and `all` (the
wheel) build every library; a bad value stops the build with a message naming
the variable. setup.py runs in a subprocess with `setuptools.setup` replaced by
a function that prints the extension names, so nothing is compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpu_backend import isa
from integration.test_packaging import ISA_LIBS  # what a wheel carries on this machine

REPO = Path(__file__).resolve().parent.parent

_PRINT_EXTENSIONS = """
import json, runpy, setuptools, sys
setuptools.setup = lambda **kw: print(json.dumps(
    [e.name.rsplit("_kernels_", 1)[1] for e in kw.get("ext_modules", [])]))
sys.argv = ["setup.py"]
runpy.run_path("setup.py", run_name="__main__")
"""


def _build(value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CPU_BACKEND_BUILD_ISAS",
                                                           "CPU_BACKEND_SKIP_KERNELS")}
    if value is not None:
        env["CPU_BACKEND_BUILD_ISAS"] = value
    return subprocess.run([sys.executable, "-c", _PRINT_EXTENSIONS], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def _libraries(value: str | None) -> set[str]:
    proc = _build(value)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("value", [None, "all"])
def test_default_and_all_build_every_library(value):
    assert _libraries(value) == ISA_LIBS


def test_native_builds_exactly_what_this_cpu_can_select():
    expected = set(isa.supported_paths())  # one library per path
    assert "portable" in expected
    assert _libraries("native") == expected


def test_a_list_builds_those_libraries():
    assert _libraries(" portable ") == {"portable"}


@pytest.mark.parametrize("value", ["avx3", ","])
def test_a_bad_value_stops_the_build_naming_the_variable(value):
    proc = _build(value)
    assert proc.returncode != 0
    assert f"CPU_BACKEND_BUILD_ISAS={value!r}" in proc.stderr
    assert "'native'" in proc.stderr


_BUILD_WITHOUT_COMPILING = """
import pathlib, runpy, sys
from torch.utils import cpp_extension

def write_empty_library(self, ext):  # stands in for the compiler and linker
    out = pathlib.Path(self.get_ext_fullpath(ext.name))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(b"")

cpp_extension.BuildExtension.build_extension = write_empty_library
sys.argv = ["setup.py", "-q", "build_ext", "--build-lib", sys.argv[1], "--build-temp", sys.argv[2]]
runpy.run_path("setup.py", run_name="__main__")
"""


def test_a_narrower_build_drops_libraries_an_earlier_build_left(tmp_path):
    """`all` then `native` in one build directory: the wheel must not pack the stale libraries."""
    lib_dir = tmp_path / "lib" / "cpu_backend"

    def build(value):
        env = {k: v for k, v in os.environ.items() if k != "CPU_BACKEND_SKIP_KERNELS"}
        env["CPU_BACKEND_BUILD_ISAS"] = value
        proc = subprocess.run([sys.executable, "-c", _BUILD_WITHOUT_COMPILING,
                               str(tmp_path / "lib"), str(tmp_path / "temp")],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return {p.name for p in lib_dir.glob("_kernels_*.so")}

    assert build("all") == {f"_kernels_{name}.so" for name in ISA_LIBS}
    assert build("portable") == {"_kernels_portable.so"}
