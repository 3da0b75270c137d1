"""A GGUF file as the host's model classes want it: Hugging Face tensor names.

`GGUFCheckpoint` reads the file's header (`read_header`: its scalar
metadata and tensor table; the `gguf` package's reader also builds an array
per tokenizer string, seconds for a 150k-token vocabulary, in every process
that opens the file), checks it before an engine starts (GGUFFileError:
damaged or truncated file, architecture we cannot map, block type we do not
run) and yields `(hf_name, tensor)` pairs for the host's `model.load_weights`,
views of a copy-on-write memory map (nothing is read until a tensor is used):
- quantized tensors as their raw blocks, uint8 [rows, blocks, block_bytes]
  (the block size names the type; cpu_backend.gguf.blocks), rows untouched;
- float tensors (norms, biases, F16/BF16/F32 matrices) as float tensors.

What llama.cpp's converter changed is undone exactly as transformers' GGUF
loader undoes it: the q and k rows of "llama" files were permuted for its
rotary layout (a permutation of whole rows, so of whole blocks: exact on
quantized data too), and Gemma norms were stored as 1 + w.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from dataclasses import dataclass
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
_PERMUTED_QK = ("llama",)  # as transformers undoes it (LlamaTensorProcessor)
_NORMS_PLUS_ONE = ("gemma2", "gemma3")
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")
_TOP_NAME = re.compile(r"^([a-z_]+)\.(weight|bias)$")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_id: int
    shape: tuple[int, ...]  # as torch sees it: the fastest dimension last
    offset: int  # from the start of the file
    nbytes: int

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        try:
            return GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"type {self.type_id}"


# GGUF value types (gguf.GGUFValueType) -> struct format of a scalar
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def advance(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise ValueError("metadata runs past the end of the file")
        self.pos += n

    def string(self) -> str:
        n = self.take("<Q")
        self.advance(n)
        return self.buf[self.pos - n:self.pos].decode("utf-8", errors="replace")

    def value(self, vtype: int):
        """A scalar or string value; an array (the tokenizer's) is skipped: None."""
        if vtype in _SCALAR:
            return self.take(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        self.skip(vtype)
        return None

    def skip(self, vtype: int) -> None:
        """Past a value without decoding it."""
        if vtype in _SCALAR:
            self.advance(struct.calcsize(_SCALAR[vtype]))
        elif vtype == _STRING:
            self.advance(self.take("<Q"))
        elif vtype == _ARRAY:
            etype, count = self.take("<I"), self.take("<Q")
            if etype in _SCALAR:
                self.advance(count * struct.calcsize(_SCALAR[etype]))
            else:
                for _ in range(count):
                    self.skip(etype)
        else:
            raise ValueError(f"unknown metadata value type {vtype}")


def read_header(path: str) -> tuple[dict, list[TensorInfo]]:
    """(scalar metadata, tensor table) of a GGUF file (format versions 2 and 3).
    Array values (the tokenizer's) are skipped. Raises ValueError/struct.error
    on a damaged or truncated header."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        cur = _Cursor(buf)  # the mmap itself: slices are copies, so it always closes
        if buf[:4] != b"GGUF":
            raise ValueError("no GGUF magic")
        cur.pos = 4
        version = cur.take("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}")
        n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
        fields = {}
        for _ in range(n_kv):
            key = cur.string()
            value = cur.value(cur.take("<I"))
            if value is not None:
                fields[key] = value
        raw = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
            raw.append((name, dims, cur.take("<I"), cur.take("<Q")))
        align = int(fields.get("general.alignment", 32))
        start = -(-cur.pos // align) * align
    finally:
        buf.close()
    tensors = []
    for name, dims, type_id, offset in raw:
        count = math.prod(dims)
        if type_id in blocks.QUANTIZED:
            bt = blocks.QUANTIZED[type_id]
            nbytes = count // bt.block_elems * bt.block_bytes
        elif type_id in blocks.FLOAT:
            nbytes = count * blocks.FLOAT[type_id][1].itemsize
        else:
            nbytes = 0  # a type we do not run: GGUFCheckpoint names it
        tensors.append(TensorInfo(name, type_id, tuple(reversed(dims)), start + offset, nbytes))
    return fields, tensors


class GGUFCheckpoint:
    """One GGUF file: metadata, checks, tensors under Hugging Face names."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.path.abspath(os.fspath(path))
        if not os.path.isfile(self.path):
            raise GGUFFileError(f"{self.path}: no such GGUF file")
        size = os.path.getsize(self.path)
        try:
            self.fields, self.tensors = read_header(self.path)
        except (ValueError, struct.error, OSError) as e:
            raise GGUFFileError(f"{self.path} ({size} bytes) is not a readable GGUF file: it is "
                                f"truncated or damaged ({type(e).__name__}: {e})") from None
        self.architecture = str(self.fields.get("general.architecture", ""))
        if self.architecture not in ARCHITECTURES:
            raise GGUFFileError(
                f"{self.path}: GGUF architecture {self.architecture!r} is not supported by "
                f"cpu_backend (supported: {', '.join(sorted(ARCHITECTURES))})")
        self._check_tensors(size)

    def metadata(self, key: str, default=None):
        return self.fields.get(f"{self.architecture}.{key}", default)

    def _check_tensors(self, size: int) -> None:
        for t in self.tensors:
            if t.type_id not in blocks.QUANTIZED and t.type_id not in blocks.FLOAT:
                raise GGUFFileError(
                    f"{self.path}: tensor {t.name} has block type {t.type_name}, which "
                    f"cpu_backend does not run (supported: {', '.join(blocks.supported_type_names())})")
            if t.offset + t.nbytes > size:
                raise GGUFFileError(f"{self.path}: truncated: tensor {t.name} ends at byte "
                                    f"{t.offset + t.nbytes}, the file has {size}")
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
        for t in self.tensors:
            name = self.hf_name(t.name)
            if name is not None:
                out[name] = t.type_name
        return out

    @cached_property
    def _data(self) -> torch.Tensor:
        """The whole file as uint8, copy-on-write (the file is never written)."""
        return torch.from_numpy(np.memmap(self.path, dtype=np.uint8, mode="c"))

    def _tensor(self, t: TensorInfo) -> torch.Tensor:
        data = self._data[t.offset:t.offset + t.nbytes]
        if t.type_id in blocks.QUANTIZED:
            bt = blocks.QUANTIZED[t.type_id]
            rows = math.prod(t.shape[:-1])
            return data.reshape(rows, t.shape[-1] // bt.block_elems, bt.block_bytes)
        return data.view(blocks.FLOAT[t.type_id][1]).reshape(t.shape)

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
        for t in self.tensors:
            name = self.hf_name(t.name)
            if name is not None:
                yield name, self._undo_converter(name, self._tensor(t))
