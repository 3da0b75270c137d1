"""A GGUF file as the host's model classes want it: Hugging Face tensor names.

`GGUFCheckpoint` opens the file with the `gguf` package's reader (a memory
map: nothing is read until a tensor is used), checks it before an engine
starts (GGUFFileError: damaged or truncated file, architecture we cannot map,
block type we do not run) and yields `(hf_name, tensor)` pairs for the host's
`model.load_weights`:
- quantized tensors as their raw blocks, uint8 [rows, blocks, block_bytes]
  (the block size names the type; cpu_backend.gguf.blocks), rows untouched;
- float tensors (norms, biases, F16/BF16/F32 matrices) as float tensors.

What llama.cpp's converter changed is undone exactly as transformers' GGUF
loader undoes it: Llama/Mistral q and k rows were permuted for its rotary
layout (a permutation of whole rows, so of whole blocks: exact on quantized
data too), and Gemma norms were stored as 1 + w.
"""

from __future__ import annotations

import os
import re
from functools import cached_property
from typing import Iterator

import numpy as np
import torch

from cpu_backend.gguf import blocks


class GGUFFileError(ValueError):
    """A GGUF file we cannot serve; the message names the file and the reason."""


# GGUF tensor name (without ".weight" / ".bias") -> Hugging Face module name,
# per family. Layer tensors are "blk.{i}.<name>".
_COMMON_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA_LAYER = {
    **_COMMON_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_LAYER = {**_COMMON_LAYER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors the host's models do not take: rotary tables they compute from the config.
_SKIPPED = re.compile(r"^(rope_freqs|rope_factors_long|rope_factors_short)\.weight$")

# general.architecture -> layer map; the ones whose q/k rows llama.cpp permuted.
ARCHITECTURES = {
    "llama": _COMMON_LAYER,
    "mistral": _COMMON_LAYER,
    "qwen2": _COMMON_LAYER,
    "qwen3": _COMMON_LAYER,
    "gemma2": _GEMMA_LAYER,
    "gemma3": _GEMMA_LAYER,
    "phi3": _PHI3_LAYER,
}
_PERMUTED_QK = ("llama", "mistral")
_NORMS_PLUS_ONE = ("gemma2", "gemma3")
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")
_TOP_NAME = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


class GGUFCheckpoint:
    """One GGUF file: metadata, checks, tensors under Hugging Face names."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.path.abspath(os.fspath(path))
        if not os.path.isfile(self.path):
            raise GGUFFileError(f"{self.path}: no such GGUF file")
        from gguf import GGUFReader

        try:
            self.reader = GGUFReader(self.path, "c")  # copy-on-write: writable arrays, file untouched
        except (ValueError, IndexError, OSError, KeyError) as e:
            size = os.path.getsize(self.path)
            raise GGUFFileError(f"{self.path} ({size} bytes) is not a readable GGUF file: it is "
                                f"truncated or damaged ({type(e).__name__}: {e})") from None
        self.architecture = str(_field(self.reader, "general.architecture", ""))
        if self.architecture not in ARCHITECTURES:
            raise GGUFFileError(
                f"{self.path}: GGUF architecture {self.architecture!r} is not supported by "
                f"cpu_backend (supported: {', '.join(sorted(ARCHITECTURES))})")
        self._check_tensors()

    def metadata(self, key: str, default=None):
        return _field(self.reader, f"{self.architecture}.{key}", default)

    def _check_tensors(self) -> None:
        size = os.path.getsize(self.path)
        for t in self.reader.tensors:
            tid = int(t.tensor_type)
            if tid not in blocks.QUANTIZED and tid not in blocks.FLOAT:
                raise GGUFFileError(
                    f"{self.path}: tensor {t.name} has block type {t.tensor_type.name}, which "
                    f"cpu_backend does not run (supported: {', '.join(blocks.supported_type_names())})")
            if t.data_offset + t.n_bytes > size:
                raise GGUFFileError(f"{self.path}: truncated: tensor {t.name} ends at byte "
                                    f"{t.data_offset + t.n_bytes}, the file has {size}")
            self.hf_name(t.name)  # every tensor must map

    def hf_name(self, gguf_name: str) -> str | None:
        """The Hugging Face parameter name of a GGUF tensor (None: not loaded)."""
        if _SKIPPED.match(gguf_name):
            return None
        layer_map = ARCHITECTURES[self.architecture]
        if m := _LAYER_NAME.match(gguf_name):
            module = layer_map.get(m.group(2))
            if module is not None:
                return f"model.layers.{m.group(1)}.{module}.{m.group(3)}"
        elif (m := _TOP_NAME.match(gguf_name)) and m.group(1) in _TOP:
            return f"{_TOP[m.group(1)]}.{m.group(2)}"
        raise GGUFFileError(f"{self.path}: tensor {gguf_name!r} of a {self.architecture} model "
                            "has no counterpart in the Hugging Face model cpu_backend loads")

    @cached_property
    def tensor_types(self) -> dict[str, str]:
        """hf_name -> block type name ("Q4_K", "F32", ...) of every loaded tensor."""
        out = {}
        for t in self.reader.tensors:
            name = self.hf_name(t.name)
            if name is not None:
                out[name] = t.tensor_type.name
        return out

    def _tensor(self, t) -> torch.Tensor:
        tid = int(t.tensor_type)
        shape = [int(x) for x in reversed(t.shape)]  # GGUF lists the fastest dimension first
        data = np.asarray(t.data)
        if tid in blocks.QUANTIZED:
            bt = blocks.QUANTIZED[tid]
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            return torch.from_numpy(data).reshape(rows, shape[-1] // bt.block_elems, bt.block_bytes)
        _, dtype = blocks.FLOAT[tid]
        out = torch.from_numpy(data)
        if out.dtype != dtype:  # BF16 comes as bytes
            out = out.view(dtype)
        return out.reshape(shape)

    def _undo_converter(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.architecture in _PERMUTED_QK and (".q_proj." in name or ".k_proj." in name):
            heads = int(self.metadata("attention.head_count"))
            if ".k_proj." in name:
                heads = int(self.metadata("attention.head_count_kv", heads))
            rows = tensor.shape[0]
            # llama.cpp stored each head's rows as [pair, half]; HF has [half, pair]
            tensor = tensor.reshape(heads, rows // heads // 2, 2, *tensor.shape[1:])
            tensor = tensor.transpose(1, 2).reshape(rows, *tensor.shape[3:])
        if self.architecture in _NORMS_PLUS_ONE and name.endswith("norm.weight"):
            tensor = tensor.float() - 1
        return tensor

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, tensor) for every tensor the model loads, in file order."""
        for t in self.reader.tensors:
            name = self.hf_name(t.name)
            if name is not None:
                yield name, self._undo_converter(name, self._tensor(t))
