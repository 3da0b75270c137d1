"""Paged attention and KV-cache write on the native kernels (csrc/attention.cpp).

    write_kv_cache(key, value, kv_cache, slot_mapping, kv_format, k_scale, v_scale)
    paged_attention(out, query, kv_cache, block_table, token_req, token_pos,
                    scale, sliding_window, softcap, alibi_slopes,
                    kv_format, k_scale, v_scale)

Each query token t attends the keys of request `token_req[t]` at positions
max(0, token_pos[t] - window + 1) .. token_pos[t]: one call serves decode,
prefill, chunked prefill and prefix hits. Layouts and masking rules are those
of `cpu_backend.attention.paged_torch`, the reference these kernels are tested
against. `kv_format` is a KV-cache dtype handler's `kernel_format`
(`cpu_backend.kv_cache`, csrc/kv_format.h); `k_scale`/`v_scale` are the
layer's per-tensor scales, used by the fp8 formats.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cpu_backend.ops import load

if TYPE_CHECKING:
    import torch

SUPPORTED_HEAD_SIZE_MULTIPLE = 16
MAX_HEAD_SIZE = 256
MAX_GROUP = 16
MAX_BLOCK_SIZE = 256


def supports(head_size: int, num_heads: int, num_kv_heads: int, block_size: int) -> bool:
    """Whether the native kernel covers this layer shape (else use paged_torch)."""
    return (
        head_size % SUPPORTED_HEAD_SIZE_MULTIPLE == 0
        and head_size <= MAX_HEAD_SIZE
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and block_size <= MAX_BLOCK_SIZE
    )


def write_kv_cache(
    key, value, kv_cache, slot_mapping, kv_format: int = 0, k_scale: float = 1.0, v_scale: float = 1.0
) -> None:
    load()
    import torch

    torch.ops.cpu_backend.write_kv_cache(
        key, value, kv_cache, slot_mapping.long(), int(kv_format), float(k_scale), float(v_scale)
    )


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_req: torch.Tensor,
    token_pos: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    kv_format: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    load()
    import torch

    torch.ops.cpu_backend.paged_attention(
        out, query, kv_cache, block_table, token_req, token_pos, float(scale),
        int(sliding_window or 0), float(softcap or 0.0), alibi_slopes,
        int(kv_format), float(k_scale), float(v_scale),
    )
