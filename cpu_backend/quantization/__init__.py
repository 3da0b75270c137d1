"""Quantized checkpoints on our kernels.

`register()` (idempotent) adds our quantization configs to the host
(`config.py`). It runs as the `vllm.general_plugins` entry point
`cpu_backend_quantization`, which the host loads in every process (front end,
engine core, workers) before it reads a model's config; our worker calls it
too. `w8a8.py` is the compressed-tensors W8A8 INT8 config, scheme and kernel.
`formats.py` is the pure-torch GPTQ/AWQ format code shared by the loader and
the checkpoint writer (`python -m cpu_backend.tools.quantize`). GGUF files
(cpu_backend.gguf) register their config and their load format "gguf" here too.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config
    from vllm.model_executor.model_loader import register_model_loader

    from cpu_backend.gguf import loader as gguf_loader
    from cpu_backend.gguf import quant as gguf_quant
    from cpu_backend.quantization import config, w8a8

    for cls in (config.CpuBackendGPTQConfig, config.CpuBackendAWQConfig,
                config.CpuBackendCompressedTensorsWNA16Config,
                w8a8.CpuBackendCompressedTensorsW8A8Config, gguf_quant.GGUFConfig):
        register_quantization_config(cls.get_name())(cls)
    register_model_loader(gguf_loader.LOAD_FORMAT)(gguf_loader.GGUFModelLoader)
    _registered = True
