"""GGUF weights kept quantized, on our weight-only kernel.

The host (vLLM 0.32) has no GGUF support left: upstream moved it to an
out-of-tree plugin whose kernels are CUDA. This is the quantization config
("cpu_backend_gguf") that config.json of a GGUF model's folder names
(cpu_backend.gguf.model_dir), registered through the host's
`register_quantization_config`, and its layer methods:
- `GGUFLinearMethod` for linear layers: each output shard (q / k / v, gate /
  up) keeps its own block type (a Q4_K_M file mixes Q4_K and Q6_K inside
  one fused layer); consecutive shards of one type are decoded to the
  integer view (cpu_backend.gguf.blocks), repacked once into
  `cpu_backend::wna16_linear`'s layout and run as one call (AVX2, AVX-512 and
  portable builds alike; the 4-, 5- and 6-bit types with int8 activations
  per 32 inputs when the host's VLLM_CPU_INT4_W4A8 is on, as GPTQ's 4-bit
  layers; Q8_0 with fp32 activations);
- `GGUFEmbeddingMethod` for the token embedding and the LM head: the same,
  and the embedding lookup dequantizes the rows it needs from that one copy,
  so a tied, quantized head is stored once.
Layers whose tensors are float in the file (F16 / BF16 / F32) get the host's
unquantized methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.utils import set_weight_attrs

from cpu_backend import envs
from cpu_backend.gguf import blocks
from cpu_backend.gguf.checkpoint import GGUFFileError
from cpu_backend.gguf.model_dir import QUANT_METHOD
from cpu_backend.quantization import formats

_FLOAT_TYPES = {name for name, _ in blocks.FLOAT.values()}
_FLOAT_NAMES = {dtype: name for name, dtype in blocks.FLOAT.values()}
_QKV_SHARDS = {"q": 0, "k": 1, "v": 2}


class GGUFConfig(QuantizationConfig):
    """The block type of every tensor of one GGUF file, by Hugging Face name."""

    def __init__(self, gguf_file: str, tensor_types: dict[str, str]):
        super().__init__()
        self.gguf_file = gguf_file
        self.tensor_types = tensor_types

    def __repr__(self) -> str:
        return f"GGUFConfig({self.gguf_file!r})"

    @classmethod
    def get_name(cls) -> str:
        return QUANT_METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return -1

    @classmethod
    def get_config_filenames(cls) -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GGUFConfig:
        return cls(config["gguf_file"], dict(config["tensor_types"]))

    def _types(self, names: list[str]) -> list[str] | None:
        found = [self.tensor_types.get(n) for n in names]
        return None if None in found else found

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from vllm.model_executor.layers.fused_moe import RoutedExperts
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            VocabParallelEmbedding,
        )

        if isinstance(layer, VocabParallelEmbedding):
            # Some host models build their token embedding without a prefix;
            # a head with no tensor of its own is tied to the embedding.
            types = self._types([f"{prefix}.weight"]) if prefix else None
            if types is None and isinstance(layer, ParallelLMHead):
                types = self._types(["lm_head.weight"])
            if types is None:
                types = self._types(["model.embed_tokens.weight"])
            if types is None or types[0] in _FLOAT_TYPES:
                return None  # the host's unquantized embedding (and its tying)
            return GGUFEmbeddingMethod(types)
        if isinstance(layer, RoutedExperts):
            raise GGUFFileError(f"{self.gguf_file}: MoE layers ({prefix}) are not supported in "
                                "GGUF files by cpu_backend yet")
        if isinstance(layer, LinearBase):
            head, _, leaf = prefix.rpartition(".")
            shards = (self.packed_modules_mapping or {}).get(leaf, [leaf])
            types = self._types([f"{head}.{s}.weight" if head else f"{s}.weight" for s in shards])
            if types is None:  # a fused tensor in the file (Phi-3's qkv_proj)
                types = self._types([f"{prefix}.weight"])
            if types is None:
                raise GGUFFileError(f"{self.gguf_file}: no tensor for layer {prefix} "
                                    f"(looked for the shards {shards})")
            if all(t in _FLOAT_TYPES for t in types):
                return UnquantizedLinearMethod()
            return GGUFLinearMethod(types)
        return None


@dataclass
class _Segment:
    """Consecutive output shards of one type, run by one call."""

    n: int
    weight: torch.Tensor | None = None  # float shards: [n, K]
    qweight: torch.Tensor | None = None  # the rest: cpu_backend::wna16_linear operands
    scales: torch.Tensor | None = None
    zs: torch.Tensor | None = None
    bits: int = 0
    group_size: int = 0
    int8_act: bool = False

    def run(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight is not None:
            return torch.nn.functional.linear(x, self.weight, bias)
        return torch.ops.cpu_backend.wna16_linear(
            x, self.qweight, self.scales, self.zs, self.bits, self.group_size, self.n,
            None, bias, None, self.int8_act)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return self.weight[ids].float()
        return formats.kernel_rows(self.qweight, self.scales, self.zs, self.bits,
                                   self.group_size, ids)


def _segment(parts: list[torch.Tensor], dtype: torch.dtype) -> _Segment:
    n = sum(p.shape[0] for p in parts)
    if parts[0].dtype != torch.uint8:
        return _Segment(n, weight=torch.cat([p.to(dtype) for p in parts]).contiguous())
    views = [blocks.decode(p) for p in parts]
    v = views[0]
    cat = lambda ts: torch.cat(ts) if len(ts) > 1 else ts[0]  # noqa: E731
    q = cat([w.q for w in views])
    scale = cat([w.scale for w in views])
    zs = None if v.min is None else cat([w.min for w in views])
    zero = torch.full_like(scale, v.zero or 0, dtype=torch.int32)
    g_idx = torch.arange(q.shape[1], dtype=torch.int32) // v.group_size
    packed = formats.kernel_layout(q, zero, scale, g_idx, v.bits, drop_symmetric_zs=True, zs=zs)
    return _Segment(n, qweight=packed["qweight"], scales=packed["scales"], zs=packed["zs"],
                    bits=v.bits, group_size=v.group_size,
                    int8_act=v.bits in (4, 6) and envs.int4_w4a8())


class GGUFLinearMethod(LinearMethodBase):
    """Takes each shard's raw blocks at load, repacks after, runs our kernel."""

    def __init__(self, shard_types: list[str]):
        self.shard_types = shard_types

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        layer.cpu_backend_gguf_sizes = list(output_partition_sizes)
        layer.cpu_backend_gguf_k = input_size_per_partition
        layer.cpu_backend_gguf_dtype = params_dtype
        layer.cpu_backend_gguf_raw = {}
        # A placeholder the host's load_weights finds by name; the tensors go
        # to our loader, which keeps them (memory-mapped) until
        # process_weights_after_loading.
        weight = torch.nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        set_weight_attrs(weight, {"weight_loader": lambda p, w, shard=None: self._load(layer, w, shard)})
        layer.register_parameter("weight", weight)

    def _where(self, layer) -> str:
        return getattr(layer, "prefix", "") or type(layer).__name__

    def _load(self, layer, tensor: torch.Tensor, shard) -> None:
        sizes = layer.cpu_backend_gguf_sizes
        index = _QKV_SHARDS.get(shard, shard)
        rows = sum(sizes) if index is None else sizes[index]
        k = layer.cpu_backend_gguf_k
        if tensor.dtype == torch.uint8:
            bt = blocks.block_type_of(tensor)
            got_k, got_type = tensor.shape[1] * bt.block_elems, bt.name
        else:
            got_k, got_type = tensor.shape[-1], _FLOAT_NAMES[tensor.dtype]
        want_type = self.shard_types[index or 0]
        if got_type != want_type and not (got_type in _FLOAT_TYPES and want_type in _FLOAT_TYPES):
            raise GGUFFileError(f"{self._where(layer)}: the GGUF file holds {got_type} where its "
                                f"config says {want_type} (the file changed? delete the folder "
                                "derived from it)")
        pad = rows - tensor.shape[0]
        if got_k != k or pad < 0 or (pad and not self._pads_rows()):
            raise GGUFFileError(
                f"{self._where(layer)}: GGUF tensor{'' if index is None else f' (shard {shard})'} "
                f"holds [{tensor.shape[0]} x {got_k}] weights, the model expects [{rows} x {k}]")
        if pad:  # vocabulary padded to a multiple of 64: zero rows
            tensor = torch.cat([tensor, tensor.new_zeros(pad, *tensor.shape[1:])])
        layer.cpu_backend_gguf_raw[index] = tensor

    def _pads_rows(self) -> bool:
        return False

    def process_weights_after_loading(self, layer) -> None:
        from cpu_backend.ops import load

        load()
        raw = layer.cpu_backend_gguf_raw
        count = len(layer.cpu_backend_gguf_sizes)
        if None in raw:
            parts = [raw[None]]
        else:
            missing = [i for i in range(count) if i not in raw]
            if missing:
                raise GGUFFileError(f"{self._where(layer)}: shard(s) {missing} missing from the "
                                    "GGUF file")
            parts = [raw[i] for i in range(count)]
        segments, run = [], [parts[0]]
        for part in parts[1:]:
            if _kind(part) == _kind(run[-1]):
                run.append(part)
            else:
                segments.append(_segment(run, layer.cpu_backend_gguf_dtype))
                run = [part]
        segments.append(_segment(run, layer.cpu_backend_gguf_dtype))
        layer.cpu_backend_gguf_segments = segments
        del layer.weight
        del layer.cpu_backend_gguf_raw

    def apply(self, layer, x, bias=None):
        segments = layer.cpu_backend_gguf_segments
        if len(segments) == 1:
            return segments[0].run(x, bias)
        outs, at = [], 0
        for s in segments:  # each adds its bias slice before its one rounding
            outs.append(s.run(x, None if bias is None else bias[at:at + s.n]))
            at += s.n
        return torch.cat(outs, dim=-1)


def _kind(t: torch.Tensor):
    return t.dtype if t.dtype != torch.uint8 else t.shape[-1]


class GGUFEmbeddingMethod(GGUFLinearMethod):
    """A quantized token embedding / LM head: `apply` gives logits,
    `embedding` dequantizes the looked-up rows from the same copy."""

    def _pads_rows(self) -> bool:
        return True

    def embedding(self, layer, input_: torch.Tensor) -> torch.Tensor:
        (segment,) = layer.cpu_backend_gguf_segments
        rows = segment.rows(input_.reshape(-1))
        return rows.to(layer.cpu_backend_gguf_dtype).reshape(*input_.shape, -1)

    def tie_weights(self, layer, embed_tokens):
        return embed_tokens
