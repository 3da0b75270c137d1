"""Native paged attention and KV write (cpu_backend.ops.attention) against the
PyTorch reference `cpu_backend.attention.paged_torch` (itself tested against a
float64 loop in test_paged_attention.py).

Each ISA library this CPU can run is tested in its own subprocess (this file
run as a script with `--worker ISA`), since a process holds one library.

Grid: head sizes 64/80/96/128/256 (and 32), GQA ratios 1-8, block sizes 16/32/64,
fp32/bf16/fp16, requests mixing a fresh prefill, a chunk over a cached prefix
(odd lengths, crossing block boundaries), and decodes; variants plain, sliding
window, soft-cap, ALiBi, sharp (10x the score scale). The kernel cuts prefill runs into query blocks of
64 // G tokens (csrc/attention.cpp); the long requests (70 tokens over a
cached prefix of 37, a fresh 130-token prefill) span several blocks whose
lengths are not multiples of the block, and several key tiles.

Tolerances (both compute in fp32; they differ in summation order and, for
bf16/fp16, only in the final rounding of the output):
    fp32: atol 1e-5; bf16: atol 1.6e-2 (2 ulp at |x| ~ 1); fp16: atol 2e-3.
    "sharp" in fp32: atol 5e-5, since a probability's rounding error grows
    with its score (exp(s) carries |s| x 2^-24 of relative error; |s| ~ 40);
    likewise ALiBi in fp32, whose bias reaches 0.5 x context (|s| ~ 750 at
    1500 keys): atol 1e-5 + 1e-7 x that bias.
"""

from __future__ import annotations

import json
import sys

import pytest

try:
    from plugin_tests.isa_worker import ISA_PATHS, run_worker
except ImportError:  # run as the worker script
    ISA_PATHS, run_worker = [], None

TOL = {"float32": 1e-5, "bfloat16": 1.6e-2, "float16": 2e-3}
# head_size, num_heads, num_kv_heads, block_size
SHAPES = [(64, 9, 3, 64), (80, 8, 1, 16), (96, 8, 2, 32), (128, 16, 2, 16), (256, 4, 1, 32),
          (32, 4, 4, 16), (64, 8, 8, 16), (128, 12, 2, 16), (96, 10, 2, 32), (64, 7, 1, 128)]
# "sharp": scores spread over ~+-30 logits, so later keys often exceed the
# running max by more than the decode kernel's slack (kMaxSlack) and most
# probabilities underflow; "alibi" raises the newest keys' scores chunk by chunk.
VARIANTS = {"plain": {}, "window": {"window": 7}, "softcap": {"softcap": 5.0}, "alibi": {"alibi": True},
            "sharp": {"sharpness": 10.0}}


def _worker() -> dict:
    import torch

    from cpu_backend import ops
    from cpu_backend.attention import paged_torch
    from cpu_backend.ops import attention as native

    isa = ops.load()
    failures, worst = [], {}
    gen = torch.Generator().manual_seed(7)
    # (context_len, new tokens) per request: a mixed batch, then decode-only
    # batches of few long requests, which the kernel splits along the keys
    # (split_decodes in csrc/attention.cpp: fewer than 4 items per thread,
    # parts of >= 128 keys; 1 and 8 threads cover no split and up to 16 parts).
    batches = [(None, lambda bs: [(0, 13), (bs + 3, 5), (2 * bs + 1, 1), (bs - 1, 1), (0, 1), (37, 70), (0, 130)]),
               (2, lambda bs: [(700, 1)]),
               (8, lambda bs: [(1500, 1), (300, 1)]),
               (1, lambda bs: [(700, 1)])]
    for threads, make_reqs in batches:
        if threads:
            torch.set_num_threads(threads)
        _check_batches(make_reqs, gen, failures, worst)
    # KV write: native equals the reference write, padding slots skipped.
    for dtype in (torch.float32, torch.bfloat16):
        cache_a = torch.zeros(4, 2, 16, 64, dtype=dtype)
        cache_b = cache_a.clone()
        key = torch.randn(5, 2, 32).to(dtype)
        value = torch.randn(5, 2, 32).to(dtype)
        slots = torch.tensor([0, 17, -1, 63, 5])
        paged_torch.write_kv(key, value, cache_a, slots)
        native.write_kv_cache(key, value, cache_b, slots)
        if not torch.equal(cache_a, cache_b):
            failures.append(f"write_kv_cache {dtype} differs from the reference")
    return {"isa": isa, "failures": failures, "worst": worst}


def _check_batches(make_reqs, gen, failures, worst) -> None:
    """Every shape, dtype and variant on the batch make_reqs(block_size): native vs reference."""
    import torch

    from cpu_backend.attention import paged_torch
    from cpu_backend.ops import attention as native

    for head_size, num_heads, num_kv_heads, block_size in SHAPES:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for name, variant in VARIANTS.items():
                reqs = make_reqs(block_size)
                num_blocks = sum(-(-(c + n) // block_size) for c, n in reqs) + 2
                kv_cache = torch.randn(num_blocks, num_kv_heads, block_size, 2 * head_size, generator=gen).to(dtype)
                perm = torch.randperm(num_blocks, generator=gen).tolist()
                block_table = torch.zeros(len(reqs), max(16, -(-max(c + n for c, n in reqs) // block_size)),
                                          dtype=torch.int32)
                for r, (c, n) in enumerate(reqs):
                    ids = [perm.pop() for _ in range(-(-(c + n) // block_size))]
                    block_table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
                total = sum(n for _, n in reqs)
                query = torch.randn(total, num_heads, head_size, generator=gen).to(dtype)
                token_req = torch.cat([torch.full((n,), r, dtype=torch.int32) for r, (_, n) in enumerate(reqs)])
                token_pos = torch.cat([torch.arange(c, c + n, dtype=torch.int32) for c, n in reqs])
                alibi = torch.linspace(-0.5, -0.05, num_heads) if variant.get("alibi") else None
                params = paged_torch.AttentionParams(
                    scale=head_size**-0.5 * variant.get("sharpness", 1.0), sliding_window=variant.get("window"),
                    softcap=variant.get("softcap"), alibi_slopes=alibi,
                )
                out = torch.empty_like(query)
                native.paged_attention(out, query, kv_cache, block_table, token_req, token_pos,
                                       params.scale, variant.get("window"), variant.get("softcap"), alibi)
                key_cache, value_cache = paged_torch.split_kv_cache(kv_cache)
                start = 0
                for r, (c, n) in enumerate(reqs):
                    ids = block_table[r, : -(-(c + n) // block_size)]
                    k = paged_torch.gather_kv(key_cache, ids, c + n)
                    v = paged_torch.gather_kv(value_cache, ids, c + n)
                    ref = paged_torch.prefill(query[start:start + n].float(), k.float(), v.float(), c, params)
                    err = float((out[start:start + n].float() - ref).abs().max())
                    key = str(dtype).removeprefix("torch.")
                    worst[key] = max(worst.get(key, 0.0), err)
                    tol = TOL[key]
                    if key == "float32" and "sharpness" in variant:
                        tol = 5e-5
                    elif key == "float32" and alibi is not None:  # scores up to 0.5 x context (below)
                        tol = 1e-5 + 1e-7 * 0.5 * (c + n)
                    if not err <= tol:
                        failures.append(f"{head_size}/{num_heads}/{num_kv_heads}/bs{block_size} {key} {name} "
                                        f"{reqs} req{r}: {err:.3g}")
                    start += n


@pytest.mark.parametrize("isa_path", ISA_PATHS)
def test_native_attention_matches_reference(isa_path):
    result = run_worker(__file__, isa_path)
    assert result["failures"] == [], result["failures"][:20]
    print(isa_path, "worst abs error by dtype:", result["worst"])


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    print(json.dumps(_worker()))
