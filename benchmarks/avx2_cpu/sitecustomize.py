"""Make torch report an AVX2-only CPU, so the host picks what it runs on one.

Only for benchmarks under ``--avx2-emulation`` on a CPU with AVX-512/AMX: this
directory goes first on ``PYTHONPATH`` of the benchmarked processes (and of the
engine processes they spawn), and Python imports this file at start-up.

The host decides its kernels from torch's CPU capabilities
(``torch.cpu._is_avx512_supported()`` and friends): which build of its ``_C``
library to load (``_C_AVX2`` on a CPU without AVX-512), the attention ISA, whether
AMX GEMMs are used. ``ONEDNN_MAX_CPU_ISA`` / ``ATEN_CPU_CAPABILITY`` limit
oneDNN and ATen but not these queries, so without this file the host loaded its
AVX-512/AMX ``_C`` beside an AVX2-limited oneDNN (and died on an AMX instruction
the kernel had not enabled). With it both backends run what an AVX2 CPU runs.

Nothing of the host is touched: the capability mapping torch builds from cpuinfo
loses its AVX-512, AVX10 and AMX entries when ``torch.cpu`` is first imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_MASKED_PREFIXES = ("avx512", "avx10", "amx")


def _mask(capabilities: dict) -> dict:
    return {k: (False if k.startswith(_MASKED_PREFIXES) else v) for k, v in capabilities.items()}


def _patch_torch_cpu(module) -> None:
    import torch

    query = torch._C._cpu._get_cpu_capability
    torch._C._cpu._get_cpu_capability = lambda: _mask(query())
    module.get_capabilities.cache_clear()


class _AfterTorchCpu(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torch.cpu`` through the normal finders, patches it once executed."""

    def find_spec(self, name, path, target=None):
        if name != "torch.cpu":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _patch_torch_cpu(module)


sys.meta_path.insert(0, _AfterTorchCpu())
