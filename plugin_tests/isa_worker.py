"""Run a test module's worker in a subprocess per ISA library.

A process holds exactly one kernel library (cpu_backend.ops.load), so each
ISA path is tested in its own interpreter with VLLM_CPU_BACKEND_ISA set: the
test file, run as a script with `--worker`, prints one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cpu_backend import isa

# amx is the avx512 library plus AMX tiles for the bf16 and int8 GEMMs: the
# tests of those kernels add it; the others run the avx512 code there.
ISA_PATHS = [p for p in isa.buildable_paths() if p != "amx"]


def run_worker(test_file: str, isa_path: str, timeout: float = 600) -> dict:
    from cpu_backend import isa

    if isa_path not in isa.supported_paths():
        pytest.skip(f"this CPU cannot run {isa_path}")
    proc = subprocess.run(
        [sys.executable, test_file, "--worker"],
        env={**os.environ, "VLLM_CPU_BACKEND_ISA": isa_path},
        capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["isa"] == isa_path
    return result
