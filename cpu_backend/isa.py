"""Which instruction-set path this CPU gets: decided here and nowhere else.

Detection reads `/proc/cpuinfo` flags (cheap, no torch import), so it can run
in `register()` and in log lines. `VLLM_CPU_BACKEND_ISA` forces a path that the
CPU supports (e.g. `portable` to test the scalar path on an AVX2 machine).
"""

from __future__ import annotations

import functools
import os
import platform

from cpu_backend import envs

# Most capable first. Each path needs all of its flags.
_PATHS: dict[str, tuple[str, ...]] = {
    # The avx512 library is built with -mavx512bf16 (VDPBF16PS) and
    # -mavx512vnni (VPDPBUSD, the W8A8 int8 kernel): Skylake-X / Cascade Lake /
    # Ice Lake (no avx512_bf16) take the avx2 path.
    "amx": ("amx_tile", "amx_bf16", "amx_int8", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
            "avx512_vnni"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"),
    # AVX2 with 256-bit VNNI (Intel Alder Lake and later client parts, Sierra
    # Forest; none of them has AVX-512): the avx2 kernels, with VPDPBUSD and
    # VPDPWSSD in the int8 dot products (W8A8, int8 KV-cache attention).
    "avx_vnni": ("avx2", "fma", "f16c", "avx_vnni"),
    "avx2": ("avx2", "fma", "f16c"),
    "portable": (),
}
ISA_PATHS = tuple(_PATHS)


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
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["portable"]
    return [name for name, need in _PATHS.items() if all(f in flags for f in need)]


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
