"""vllm-cpu-backend: a CPU platform plugin for vLLM.

`register()` is the `vllm.platform_plugins` entry point. vLLM calls it in every
process (API server, engine core, workers), so it imports nothing heavy.
"""

from __future__ import annotations

import glob
import os

PLATFORM_QUALNAME = "cpu_backend.platform.CpuBackendPlatform"
PLUGIN_NAME = "cpu_backend"

# Device nodes of accelerators that have a vLLM platform of their own.
_ACCELERATOR_DEVICE_GLOBS = (
    "/dev/nvidia[0-9]*",  # CUDA
    "/dev/kfd",  # ROCm
    "/dev/accel[0-9]*",  # TPU and other accel-class drivers
    "/dev/neuron[0-9]*",  # AWS Neuron
    "/dev/davinci[0-9]*",  # Ascend NPU
)


def _explicitly_selected() -> bool:
    allowed = os.environ.get("VLLM_PLUGINS")
    return allowed is not None and PLUGIN_NAME in [p.strip() for p in allowed.split(",")]


def accelerator_present() -> bool:
    return any(glob.glob(pattern) for pattern in _ACCELERATOR_DEVICE_GLOBS)


def register() -> str | None:
    """Our platform's qualname on a CPU-only host or when `VLLM_PLUGINS` names us.

    With an accelerator present we stay out unless selected explicitly, so that
    installing us beside a GPU build never takes the GPU away.
    """
    if _explicitly_selected() or not accelerator_present():
        return PLATFORM_QUALNAME
    return None
