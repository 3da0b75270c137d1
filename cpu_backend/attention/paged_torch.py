"""Paged attention in plain PyTorch ops: the first implementation and the
reference that native kernels are tested against.

KV-cache layout (vLLM's `KVCacheLayout.LBHNC`, one tensor per layer):
`[num_blocks, num_kv_heads, block_size, row]`, a row holding a token's key then
its value (then two fp32 scales for per-row quantized dtypes; the dtype
handlers in `cpu_backend.kv_cache` say how rows are stored). Positions are
absolute token indices in a request; slot = block_id * block_size + position
% block_size.

Masking rules, as in vLLM and transformers:
- causal: a query at position p sees keys at positions t <= p;
- sliding window w: also t > p - w (w keys, the query's own included);
- logit soft-cap c: scores = c * tanh(scores / c) before masking;
- ALiBi: scores += slope[h] * (t - p).
Scores and softmax are computed in float32 whatever the cache dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cpu_backend.kv_cache import KVCacheDtypeHandler, handler_for
from cpu_backend.kv_cache.base import SCALE_BYTES

PLAIN = handler_for("auto")


@dataclass(frozen=True)
class AttentionParams:
    scale: float
    sliding_window: int | None = None  # None or <= 0: no window
    softcap: float | None = None  # None or 0: no soft-cap
    alibi_slopes: torch.Tensor | None = None  # [num_heads] float32

    @property
    def window(self) -> int | None:
        return self.sliding_window if self.sliding_window and self.sliding_window > 0 else None

    @property
    def needs_explicit_scores(self) -> bool:
        return bool(self.softcap) or self.alibi_slopes is not None


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value views `[num_blocks, num_kv_heads, block_size, head_size]`
    of a float cache (no scales)."""
    return kv_sources(kv_cache, kv_cache.shape[-1] // 2)


class DequantizedCache:
    """Keys (or values) of a quantized cache, dequantized to float32 on read:
    `cache[block_ids]` -> `[..., num_kv_heads, block_size, head_size]`."""

    def __init__(self, stored, row_scales, handler: KVCacheDtypeHandler, tensor_scale: float):
        self.stored, self.row_scales = stored, row_scales
        self.handler, self.tensor_scale = handler, tensor_scale
        self.shape = stored.shape

    def __getitem__(self, block_ids: torch.Tensor) -> torch.Tensor:
        scales = self.row_scales[block_ids] if self.row_scales is not None else None
        return self.handler.dequantize(self.stored[block_ids], scales, self.tensor_scale)


def _row_scales(kv_cache: torch.Tensor, head_size: int) -> torch.Tensor:
    """The fp32 (key, value) scales after each row: `[..., 2]`."""
    tail = kv_cache[..., 2 * head_size : 2 * head_size + SCALE_BYTES]
    return tail.view(torch.uint8).view(torch.float32)


def kv_sources(
    kv_cache: torch.Tensor,
    head_size: int,
    handler: KVCacheDtypeHandler = PLAIN,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
):
    """What `decode`/`gather_kv` read keys and values from: views of a float
    cache, or `DequantizedCache`s of a quantized one."""
    key = kv_cache[..., :head_size]
    value = kv_cache[..., head_size : 2 * head_size]
    if not handler.quantized:
        return key, value
    scales = _row_scales(kv_cache, head_size) if handler.per_row_scales else None
    return (
        DequantizedCache(key, scales[..., 0] if scales is not None else None, handler, k_scale),
        DequantizedCache(value, scales[..., 1] if scales is not None else None, handler, v_scale),
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    handler: KVCacheDtypeHandler = PLAIN,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store `key`/`value` `[num_tokens, num_kv_heads, head_size]` at their
    slots, quantized by `handler`. Negative slots mark padding tokens and are
    skipped.
    """
    num_tokens = slot_mapping.shape[0]
    key, value = key[:num_tokens], value[:num_tokens]
    if num_tokens and bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    block_size = kv_cache.shape[2]
    head_size = key.shape[-1]
    slots = slot_mapping.long()
    blocks, offsets = slots // block_size, slots % block_size
    k, k_rows = handler.quantize(key, k_scale, kv_cache.dtype)
    v, v_rows = handler.quantize(value, v_scale, kv_cache.dtype)
    # Advanced indices on dims 0 and 2 put the token axis first: [T, H, D].
    kv_cache[blocks, :, offsets, :head_size] = k
    kv_cache[blocks, :, offsets, head_size : 2 * head_size] = v
    if handler.per_row_scales:
        scales = torch.stack([k_rows, v_rows], dim=-1).contiguous()  # [T, H, 2] fp32
        tail = slice(2 * head_size, 2 * head_size + SCALE_BYTES)
        kv_cache[blocks, :, offsets, tail] = scales.view(torch.uint8).view(kv_cache.dtype)


def gather_kv(cache, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """Keys (or values) of one request: `[num_kv_heads, length, head_size]`."""
    blocks = cache[block_ids]  # [nb, H, bs, D]
    num_heads, head_size = blocks.shape[1], blocks.shape[3]
    return blocks.transpose(0, 1).reshape(num_heads, -1, head_size)[:, :length]


def _scores_bias_and_mask(
    scores: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    key_len: torch.Tensor | None,
    params: AttentionParams,
) -> torch.Tensor:
    """Apply soft-cap, ALiBi and the causal/window/length mask to float32
    `scores [..., H, Q, K]`; `query_pos [..., Q]`, `key_pos [K]`,
    `key_len [...]` (keys at or past it are padding)."""
    if params.softcap:
        scores = params.softcap * torch.tanh(scores / params.softcap)
    distance = key_pos - query_pos.unsqueeze(-1)  # [..., Q, K], t - p
    if params.alibi_slopes is not None:
        slopes = params.alibi_slopes.to(scores.dtype).view(-1, 1, 1)
        scores = scores + slopes * distance.unsqueeze(-3).to(scores.dtype)
    allowed = distance <= 0
    if params.window is not None:
        allowed &= distance > -params.window
    if key_len is not None:
        allowed &= key_pos < key_len.view(*key_len.shape, 1, 1)
    return scores.masked_fill(~allowed.unsqueeze(-3), float("-inf"))


def attend_explicit(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_pos: torch.Tensor,
    key_len: torch.Tensor | None,
    params: AttentionParams,
) -> torch.Tensor:
    """Attention with scores materialized in float32.

    query `[..., Hq, Q, D]`, key/value `[..., Hkv, K, D]`, query_pos `[..., Q]`.
    Returns `[..., Hq, Q, D]` in float32.
    """
    num_q_heads, num_kv_heads = query.shape[-3], key.shape[-3]
    group = num_q_heads // num_kv_heads
    if group > 1:
        key = key.repeat_interleave(group, dim=-3)
        value = value.repeat_interleave(group, dim=-3)
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * params.scale
    key_pos = torch.arange(key.shape[-2], device=query.device)
    scores = _scores_bias_and_mask(scores, query_pos, key_pos, key_len, params)
    probs = torch.softmax(scores, dim=-1)
    # Rows with no visible key (padding queries) give NaN; make them zero.
    probs = torch.nan_to_num(probs, nan=0.0)
    return torch.matmul(probs, value.float())


def decode(
    query: torch.Tensor,
    key_cache,
    value_cache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    params: AttentionParams,
) -> torch.Tensor:
    """One new token per request, batched: query `[R, Hq, D]` -> `[R, Hq, D]`.

    `seq_lens [R]` counts each request's tokens including the new one, whose
    key and value are already in the cache.
    """
    block_size = key_cache.shape[2]
    num_blocks = -(-max_seq_len // block_size)
    block_ids = block_table[:, :num_blocks]
    num_reqs, num_kv_heads, head_size = query.shape[0], key_cache.shape[1], key_cache.shape[3]

    def gather(cache) -> torch.Tensor:  # [R, Hkv, nb*bs, D]
        return cache[block_ids].transpose(1, 2).reshape(num_reqs, num_kv_heads, -1, head_size)

    query_pos = (seq_lens - 1).view(num_reqs, 1)
    out = attend_explicit(
        query.unsqueeze(-2), gather(key_cache), gather(value_cache), query_pos, seq_lens, params
    )
    return out.squeeze(-2)


def prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    context_len: int,
    params: AttentionParams,
) -> torch.Tensor:
    """One request's new tokens over its whole context.

    query `[Q, Hq, D]`; key/value `[Hkv, context_len + Q, D]` (cached prefix
    followed by the new tokens). Returns `[Q, Hq, D]` in the query's dtype.
    """
    num_new = query.shape[0]
    q = query.transpose(0, 1)  # [Hq, Q, D]
    query_pos = torch.arange(context_len, context_len + num_new, device=query.device)
    if params.needs_explicit_scores:
        out = attend_explicit(q, key, value, query_pos, None, params).to(query.dtype)
        return out.transpose(0, 1)
    if context_len == 0 and params.window is None:
        out = F.scaled_dot_product_attention(
            q, key.to(q.dtype), value.to(q.dtype),
            is_causal=True, scale=params.scale, enable_gqa=True,
        )
        return out.transpose(0, 1)
    key_pos = torch.arange(key.shape[1], device=query.device)
    distance = key_pos - query_pos.unsqueeze(-1)
    allowed = distance <= 0
    if params.window is not None:
        allowed &= distance > -params.window
    out = F.scaled_dot_product_attention(
        q, key.to(q.dtype), value.to(q.dtype),
        attn_mask=allowed, scale=params.scale, enable_gqa=True,
    )
    return out.transpose(0, 1)
