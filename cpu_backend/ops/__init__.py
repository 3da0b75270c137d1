"""Native kernels (csrc/): one shared library per ISA, loaded lazily.

setup.py builds `_kernels_<path>.so` for every path of `cpu_backend.isa.PATHS`
(amx, avx512, avx_vnni, avx2, portable) into this package's parent directory
(`cpu_backend/`). `load()` loads the one for `cpu_backend.isa.selected_path()` with
`torch.ops.load_library`, once per process: the libraries register the same
`torch.ops.cpu_backend.*` ops, so a process holds exactly one of them (to test
another ISA, start another process with `VLLM_CPU_BACKEND_ISA` set).

`import cpu_backend.ops` is cheap: torch is imported by `load()`.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

NOT_BUILT = (
    "cpu_backend native kernels are not built: reinstall with pip install --no-build-isolation ."
)

_lock = threading.Lock()
_loaded: str | None = None  # the build loaded in this process, e.g. "avx2"
_fakes_registered = False


class KernelsNotBuilt(RuntimeError):
    """The library for the selected ISA is not next to the imported package."""


def library_file(lib: str) -> Path | None:
    """Where `_kernels_<lib>.so` is, or None.

    First next to the imported `cpu_backend` package. A source checkout that
    shadows the installed package (pytest run from the repository root puts it
    first on sys.path) has no libraries unless built in place
    (`python setup.py build_ext --inplace`); then the installed copy's
    libraries, found through the other sys.path entries, are used.
    """
    name = f"_kernels_{lib}.so"
    package_dir = Path(__file__).resolve().parent.parent
    candidates = [package_dir / name]
    for entry in sys.path:
        candidate = Path(entry or ".").resolve() / "cpu_backend" / name
        if candidate not in candidates:
            candidates.append(candidate)
    return next((c for c in candidates if c.is_file()), None)


def _already_loaded() -> str | None:
    import torch

    try:
        return str(torch.ops.cpu_backend.isa())
    except (AttributeError, RuntimeError):
        return None


def load() -> str:
    """Load the kernels for this CPU (idempotent, thread-safe); the build's name.

    Returns what the loaded library reports ("amx", "avx512", "avx_vnni", "avx2"
    or "portable"). Raises KernelsNotBuilt when the library is missing.
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        from cpu_backend import isa

        lib = isa.selected_path()  # one library per path of isa.PATHS
        loaded = _already_loaded()
        if loaded is None:
            path = library_file(lib)
            if path is None:
                raise KernelsNotBuilt(
                    f"{NOT_BUILT} (_kernels_{lib}.so is not in {Path(__file__).resolve().parent.parent})"
                )
            import torch

            torch.ops.load_library(str(path))
            loaded = str(torch.ops.cpu_backend.isa())
        _register_fakes()
        _loaded = loaded
        return _loaded


def _register_fakes() -> None:
    """Shape functions of the dense linear ops (cpu_backend.ops.linear), for
    torch.compile; called by load() with the lock held, once per process."""
    global _fakes_registered
    if _fakes_registered:
        return
    import torch

    nr = int(torch.ops.cpu_backend.linear_pack_nr())

    @torch.library.register_fake("cpu_backend::pack_linear_weight")
    def _(weight):
        n, k = weight.shape
        return weight.new_empty(((n + nr - 1) // nr, k, nr))

    @torch.library.register_fake("cpu_backend::linear")
    def _(x, packed_weight, n, bias=None, out_dtype=None):
        return x.new_empty((*x.shape[:-1], n), dtype=out_dtype or x.dtype)

    @torch.library.register_fake("cpu_backend::linear_out")
    def _(out, x, packed_weight, n, bias=None):
        return None

    _fakes_registered = True


def loaded_isa() -> str | None:
    """The build loaded in this process, or None before `load()`."""
    return _loaded
