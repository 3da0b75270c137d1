"""Paged attention (cpu_backend.attention.paged_torch) against a dense reference.

The reference below attends query by query over an unpaged float64 copy of the
keys and values, applying the masking rules written out in its body. Inputs
are scattered into a paged cache with a shuffled block table, so block
boundaries and non-contiguous blocks are exercised.

Tolerances: float32 compute vs float64 reference, atol 2e-5 (fp32 inputs) and
2e-2 (bf16 inputs, which carry ~3 significant digits).
"""

from __future__ import annotations

import math

import pytest
import torch

from cpu_backend.attention import paged_torch
from cpu_backend.attention.paged_torch import AttentionParams


def reference_attention(q, k, v, context_len, scale, window=None, softcap=None, alibi=None):
    """q [Q, Hq, D]; k, v [L, Hkv, D] with L = context_len + Q. float64 loops."""
    num_q, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(num_q):
        p = context_len + i
        for h in range(num_heads):
            kh, vh = k[:, h // group].double(), v[:, h // group].double()
            scores = (kh @ q[i, h].double()) * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            t = torch.arange(k.shape[0], dtype=torch.float64)
            if alibi is not None:
                scores = scores + float(alibi[h]) * (t - p)
            visible = t <= p
            if window:
                visible &= t > p - window
            scores[~visible] = -math.inf
            out[i, h] = torch.softmax(scores, 0) @ vh
    return out


def make_paged(ks, vs, block_size, num_heads, head_size, dtype, seed=0):
    """Scatter per-request keys/values into a shuffled paged cache."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-k.shape[0] // block_size) for k in ks]
    total = sum(blocks_per_req) + 3  # spare blocks stay garbage
    order = torch.randperm(total, generator=gen).tolist()
    kv_cache = torch.randn(total, num_heads, block_size, 2 * head_size, generator=gen).to(dtype)
    max_blocks = max(blocks_per_req)
    block_table = torch.zeros(len(ks), max_blocks + 2, dtype=torch.int32)
    for r, (k, v) in enumerate(zip(ks, vs)):
        ids = [order.pop() for _ in range(blocks_per_req[r])]
        block_table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        slots = torch.tensor(
            [ids[t // block_size] * block_size + t % block_size for t in range(k.shape[0])]
        )
        paged_torch.write_kv(k, v, kv_cache, slots)
    return kv_cache, block_table


CASES = [
    # head_size, num_heads, num_kv_heads, block_size
    (64, 4, 4, 16),
    (64, 9, 3, 64),
    (80, 8, 1, 16),
    (96, 8, 2, 32),
    (128, 16, 2, 16),
    (256, 4, 1, 32),
]


@pytest.mark.parametrize("head_size,num_heads,num_kv_heads,block_size", CASES)
@pytest.mark.parametrize(
    "variant",
    [{}, {"window": 7}, {"softcap": 5.0}, {"alibi": True}],
    ids=["plain", "window", "softcap", "alibi"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_and_prefill_match_reference(
    head_size, num_heads, num_kv_heads, block_size, variant, dtype
):
    torch.manual_seed(head_size + num_heads + block_size)
    scale = head_size**-0.5
    alibi = torch.linspace(-0.5, -0.05, num_heads) if variant.get("alibi") else None
    params = AttentionParams(
        scale=scale, sliding_window=variant.get("window"), softcap=variant.get("softcap"),
        alibi_slopes=alibi,
    )
    atol = 2e-5 if dtype == torch.float32 else 2e-2
    # (context_len, new tokens): fresh prefill, prefix hit, odd lengths, decode.
    shapes = [(0, 13), (block_size, 5), (2 * block_size + 3, 1), (block_size - 1, 1), (0, 1)]
    ks = [torch.randn(c + n, num_kv_heads, head_size).to(dtype) for c, n in shapes]
    vs = [torch.randn(c + n, num_kv_heads, head_size).to(dtype) for c, n in shapes]
    qs = [torch.randn(n, num_heads, head_size).to(dtype) for _, n in shapes]
    kv_cache, block_table = make_paged(ks, vs, block_size, num_kv_heads, head_size, dtype)
    key_cache, value_cache = paged_torch.split_kv_cache(kv_cache)

    expected = [
        reference_attention(q, k, v, c, scale, variant.get("window"), variant.get("softcap"), alibi)
        for q, k, v, (c, _) in zip(qs, ks, vs, shapes)
    ]
    # Prefill path, one request at a time, keys read back from the paged cache.
    for r, (c, n) in enumerate(shapes):
        seq_len = c + n
        ids = block_table[r, : -(-seq_len // block_size)]
        k = paged_torch.gather_kv(key_cache, ids, seq_len)
        v = paged_torch.gather_kv(value_cache, ids, seq_len)
        got = paged_torch.prefill(qs[r], k, v, c, params)
        torch.testing.assert_close(got.double(), expected[r], atol=atol, rtol=0)
    # Decode path, batched over the single-token requests.
    decode_rows = [r for r, (_, n) in enumerate(shapes) if n == 1]
    seq_lens = torch.tensor([sum(shapes[r]) for r in decode_rows])
    got = paged_torch.decode(
        torch.cat([qs[r] for r in decode_rows]), key_cache, value_cache,
        block_table[decode_rows], seq_lens, int(seq_lens.max()), params,
    )
    for i, r in enumerate(decode_rows):
        torch.testing.assert_close(got[i : i + 1].double(), expected[r], atol=atol, rtol=0)


def test_write_kv_skips_padding_slots():
    kv_cache = torch.zeros(2, 1, 4, 4)
    key = torch.ones(3, 1, 2)
    value = torch.full((3, 1, 2), 2.0)
    paged_torch.write_kv(key, value, kv_cache, torch.tensor([5, -1, 0]))
    assert kv_cache[1, 0, 1].tolist() == [1, 1, 2, 2]
    assert kv_cache[0, 0, 0].tolist() == [1, 1, 2, 2]
    assert kv_cache.sum().item() == 2 * 6


def test_write_kv_casts_to_cache_dtype():
    kv_cache = torch.zeros(1, 2, 16, 8, dtype=torch.bfloat16)
    key = torch.randn(3, 2, 4)
    paged_torch.write_kv(key, key, kv_cache, torch.tensor([0, 1, 15]))
    torch.testing.assert_close(kv_cache[0, :, 15, :4].float(), key[2].bfloat16().float())
