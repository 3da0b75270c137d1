"""One step's attention metadata, built once per step and shared by every layer.

Replaces the host's `vllm.v1.attention.backends.cpu_attn.CPUAttentionMetadataBuilder`
(with its metadata): ours splits decode rows from prefills in numpy and
precomputes each query token's request row and position for our kernel.
Kept apart from `backend` so that `impl` reads it without importing the
backend that names `impl` (no import loop).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.attention.backend import AttentionMetadataBuilder, CommonAttentionMetadata


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
