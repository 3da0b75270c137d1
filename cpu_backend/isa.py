"""Which instruction-set path this CPU gets: decided here and nowhere else.

Detection reads `/proc/cpuinfo` flags (cheap, no torch import), so it can run
in `register()` and in log lines. `VLLM_CPU_BACKEND_ISA` forces a path that the
CPU supports (e.g. `portable` to test the scalar path on an AVX2 machine).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

from cpu_backend import envs


@dataclass(frozen=True)
class IsaPath:
    """One kernel library: `cpu_backend/_kernels_<name>.so`, csrc/ compiled
    with `macros` and `compile_flags` (setup.py), run where the CPU has every
    one of `cpu_flags` (/proc/cpuinfo names)."""

    cpu_flags: tuple[str, ...]
    macros: tuple[str, ...]
    compile_flags: tuple[str, ...]
    x86_only: bool = True


_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni",
           "-mfma", "-mf16c", "-mavx2")
_AVX512_CPU = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni")

# The one table of ISA paths (setup.py, cpu_backend.ops and the tests read it).
# Most capable first: the first path whose flags the CPU has is selected.
PATHS: dict[str, IsaPath] = {
    # The avx512 library plus AMX tiles for the bf16 and W8A8 int8 GEMMs
    # (csrc/linear_amx.cpp: Sapphire Rapids and newer).
    "amx": IsaPath(("amx_tile", "amx_bf16", "amx_int8", *_AVX512_CPU),
                   ("CPU_BACKEND_ISA_AVX512", "CPU_BACKEND_HAS_AMX"),
                   (*_AVX512, "-mamx-tile", "-mamx-bf16", "-mamx-int8")),
    # -mavx512bf16 (VDPBF16PS) and -mavx512vnni (VPDPBUSD, the W8A8 int8
    # kernel): Skylake-X / Cascade Lake / Ice Lake (no avx512_bf16) take the
    # avx2 path.
    "avx512": IsaPath(_AVX512_CPU, ("CPU_BACKEND_ISA_AVX512",), _AVX512),
    # AVX2 with 256-bit VNNI (Intel Alder Lake and later client parts, Sierra
    # Forest; none of them has AVX-512): the avx2 kernels, with VPDPBUSD and
    # VPDPWSSD in the int8 dot products (W8A8, int8 KV-cache attention).
    "avx_vnni": IsaPath(("avx2", "fma", "f16c", "avx_vnni"),
                        ("CPU_BACKEND_ISA_AVX2", "CPU_BACKEND_HAS_AVX_VNNI"), (*_AVX2, "-mavxvnni")),
    "avx2": IsaPath(("avx2", "fma", "f16c"), ("CPU_BACKEND_ISA_AVX2",), _AVX2),
    # Scalar code the compiler may vectorise, on every CPU (Arm included).
    # -O2 (the last -O wins): with -O3 its attention.cpp alone took 13.5 min
    # of a CI build on 2 cores; -O2 and no forced inlining (vec_common.h) ~1.5.
    "portable": IsaPath((), ("CPU_BACKEND_ISA_PORTABLE",), ("-O2",), x86_only=False),
}
ISA_PATHS = tuple(PATHS)


def buildable_paths(machine: str | None = None) -> list[str]:
    """The libraries a build on `machine` (default: this one) compiles."""
    x86 = (machine or platform.machine()) in ("x86_64", "AMD64")
    return [name for name, p in PATHS.items() if x86 or not p.x86_only]


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def supported_paths(flags: frozenset[str] | None = None) -> list[str]:
    flags = cpu_flags() if flags is None else flags
    return [name for name in buildable_paths() if all(f in flags for f in PATHS[name].cpu_flags)]


def selected_path() -> str:
    """The best supported path, or the one `VLLM_CPU_BACKEND_ISA` forces."""
    supported = supported_paths()
    forced = os.environ.get(envs.BACKEND_ISA, "").strip()
    if not forced:
        return supported[0]
    if forced not in supported:
        raise envs.EnvError(
            envs.BACKEND_ISA, forced, f"one of {supported} (what this CPU supports)"
        )
    return forced


def describe() -> str:
    """e.g. 'avx512 (cpu has avx512_bf16 avx512_vnni)' for the start-up log."""
    extras = [f for f in ("avx_vnni", "avx512_bf16", "avx512_vnni", "amx_int8") if f in cpu_flags()]
    path = selected_path()
    return f"{path} (cpu has {' '.join(extras)})" if extras else path
