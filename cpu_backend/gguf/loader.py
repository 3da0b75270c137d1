"""Load format "gguf": the weights of a GGUF model's folder come from its file.

Registered through the host's `register_model_loader`; the host 0.32 has no
GGUF loader of its own (upstream moved it to an out-of-tree plugin). Our
platform selects this format for any model whose config names the
"cpu_backend_gguf" quantization (CpuBackendPlatform.check_and_update_config).
The tensors are handed to the host model's own `load_weights` under their
Hugging Face names (cpu_backend.gguf.checkpoint), quantized ones as raw
blocks that our GGUF layer methods keep (cpu_backend.gguf.quant); nothing is
converted on disk.
"""

from __future__ import annotations

import os

import torch
from vllm.config import ModelConfig
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from cpu_backend.gguf.checkpoint import GGUFCheckpoint, GGUFFileError

LOAD_FORMAT = "gguf"


def gguf_file_of(model_config: ModelConfig) -> str:
    quant = getattr(model_config.hf_config, "quantization_config", None) or {}
    path = quant.get("gguf_file") if isinstance(quant, dict) else None
    if not path:
        raise GGUFFileError(f"{model_config.model}: load format {LOAD_FORMAT!r} needs a model "
                            "folder made for a GGUF file (serve the .gguf file itself)")
    return path


class GGUFModelLoader(BaseModelLoader):
    def download_model(self, model_config: ModelConfig) -> None:
        path = gguf_file_of(model_config)  # local only: nothing to download
        if not os.path.isfile(path):
            raise GGUFFileError(f"{path}: the GGUF file of {model_config.model} is gone")

    def load_weights(self, model: torch.nn.Module, model_config: ModelConfig) -> None:
        ckpt = GGUFCheckpoint(gguf_file_of(model_config))
        dtype = model_config.dtype
        # float tensors (norms, biases) in the model's dtype, as the host would
        # copy them, without its warning per tensor
        weights = ((name, t.to(dtype) if t.is_floating_point() else t)
                   for name, t in ckpt.weights())
        loaded = model.load_weights(weights)
        if loaded is None:
            return
        expected = {name for name, _ in model.named_parameters()}
        missing = sorted(expected - set(loaded))
        if missing:
            raise GGUFFileError(f"{ckpt.path}: no tensor for the model's parameter(s) "
                                f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
