"""Our attention backend, registered as `CPU_BACKEND_ATTN`.

Replaces the host's `vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend`
(and, in `metadata`, its metadata builder) for decoder attention. The host backend is tied to
its compiled `_C` kernels, whose AVX2 build lacks features (fp8 KV cache) and
whose scheduling metadata we do not control; ours owns the paged-KV layout,
the per-step metadata and the compute path: our native kernel
(csrc/attention.cpp, runtime ISA dispatch) with a PyTorch fallback
(`paged_torch`) for shapes the kernel does not cover.

Paged KV with block tables; prefill, decode, mixed batches (chunked prefill),
prefix-cache hits (a request whose first tokens are already cached is a
prefill with `context_len > 0`), GQA/MQA, sliding window, soft-cap, ALiBi,
and every KV-cache dtype of `cpu_backend.kv_cache` (fp8 and int8 included,
on every ISA: the host refuses fp8 KV without AVX-512).
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionType, MultipleOf
from vllm.utils.torch_utils import get_dtype_size
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from cpu_backend import kv_cache
from cpu_backend.attention.metadata import CpuBackendMetadataBuilder
from cpu_backend.kv_cache.base import SCALE_BYTES

NAME = "CPU_BACKEND_ATTN"


class CpuBackendAttentionBackend(AttentionBackend):
    # Our forward writes the layer's new keys and values, so the host calls no
    # separate `unified_kv_cache_update` op: one op and one Python round trip
    # fewer per layer and step (~10 us each on a 2-core VM, a third of a small
    # model's attention time in a decode step).
    forward_includes_kv_cache_update: bool = True

    supported_dtypes: ClassVar[list[torch.dtype]] = [
        torch.float32,
        torch.bfloat16,
        torch.float16,
    ]
    # One handler per dtype (cpu_backend.kv_cache): float, fp8 with per-tensor
    # scales, int8/fp8 with per-(token, head) scales.
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(kv_cache.SUPPORTED)

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Per-(token, head) quantized dtypes keep two fp32 scales after each
        row's key and value bytes: the page grows by 8 bytes per row."""
        if spec.state_content_bytes is not None or not spec.kv_quant_mode.is_per_token_head:
            return spec
        elem = get_dtype_size(spec.dtype)
        content = (spec.head_size + spec.head_size_v) * elem + SCALE_BYTES
        return replace(spec, state_content_bytes=content)

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls():
        from cpu_backend.attention.impl import CpuBackendAttentionImpl

        return CpuBackendAttentionImpl

    @staticmethod
    def get_builder_cls():
        return CpuBackendMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [32, 64, 80, 96, 112, 128, 160, 192, 224, 256]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER
