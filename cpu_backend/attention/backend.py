"""Our attention backend, registered as `CPU_BACKEND_ATTN`.

Replaces the host's `vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend`
(and its metadata builder) for decoder attention. The host backend is tied to
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

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.utils.torch_utils import get_dtype_size
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from cpu_backend import kv_cache
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


@dataclass
class CpuBackendAttentionMetadata:
    """What one step's attention needs, computed once and shared by all layers."""

    num_actual_tokens: int
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens]
    # Requests with exactly one new token, run as one batch.
    decode_token_idx: torch.Tensor  # [num_decodes] long: rows of query/output
    decode_req_idx: torch.Tensor  # [num_decodes] long: rows of block_table
    decode_seq_lens: torch.Tensor  # [num_decodes] long
    decode_max_seq_len: int
    decodes_are_leading: bool  # decode rows are 0..num_decodes-1: slice, no gather
    # Every other request: (request row, first token row, num new tokens, seq_len).
    prefills: list[tuple[int, int, int, int]]
    # Per query token, for the native kernel: its request row and position.
    token_req: torch.Tensor  # [num_actual_tokens] int32
    token_pos: torch.Tensor  # [num_actual_tokens] int32

    @property
    def num_decodes(self) -> int:
        return self.decode_token_idx.shape[0]


class CpuBackendMetadataBuilder(AttentionMetadataBuilder[CpuBackendAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Ask the runner to put single-token requests first, so decode rows are
        # a slice of the batch rather than a gather.
        self._init_reorder_batch_threshold(1)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> CpuBackendAttentionMetadata:
        # The step's lengths are a few numbers on the CPU: numpy, where each
        # torch op on them costs a few microseconds of dispatch (one build
        # per decode step).
        cm = common_attn_metadata
        num_reqs = cm.num_reqs
        starts = cm.query_start_loc_cpu[: num_reqs + 1].numpy().astype(np.int64)
        query_lens = np.diff(starts)
        seq_lens = cm.seq_lens[:num_reqs].numpy().astype(np.int64)

        is_decode = query_lens == 1
        decode_req_idx = np.flatnonzero(is_decode)
        decode_token_idx = starts[decode_req_idx]
        decode_seq_lens = seq_lens[decode_req_idx]
        num_decodes = len(decode_req_idx)

        num_tokens = int(starts[-1])
        token_req = np.repeat(np.arange(num_reqs, dtype=np.int64), query_lens)
        token_pos = (seq_lens - query_lens)[token_req] + np.arange(num_tokens) - starts[token_req]

        prefills = [(int(r), int(starts[r]), int(query_lens[r]), int(seq_lens[r]))
                    for r in np.flatnonzero(~is_decode & (query_lens > 0))]

        return CpuBackendAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping.long(),  # the write kernel takes int64
            decode_token_idx=torch.from_numpy(decode_token_idx),
            decode_req_idx=torch.from_numpy(decode_req_idx.astype(np.int64)),
            decode_seq_lens=torch.from_numpy(decode_seq_lens),
            decode_max_seq_len=int(decode_seq_lens.max()) if num_decodes else 0,
            decodes_are_leading=bool(num_decodes == 0 or int(decode_token_idx[-1]) == num_decodes - 1),
            prefills=prefills,
            token_req=torch.from_numpy(token_req.astype(np.int32)),
            token_pos=torch.from_numpy(token_pos.astype(np.int32)),
        )
