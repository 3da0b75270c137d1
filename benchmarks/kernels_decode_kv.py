"""Microbenchmark: decode attention over a long paged KV cache, per KV-cache dtype.

    .venv/bin/python benchmarks/kernels_decode_kv.py [--threads 2] [--seqs 16] [--context 2048]
        [--block-size 64] [--dtypes auto,fp8_e5m2,int8_per_token_head]
        [--library /path/to/_kernels_avx512.so]

One layer of SmolLM2-135M's shape (9 query / 3 kv heads, head size 64), `--seqs`
sequences with `--context` cached tokens each and one new query token each,
blocks of `--block-size` tokens (64, the engine's default) in a random order,
bf16 queries. Calls rotate over `--layers` caches (default 8,
~200 MB in bf16 at the defaults) so that, as in an engine whose 30 layers'
caches are far larger than the L3, the cache is read from memory and not
from L3. Prints the median ms per call, the cache bytes read per call and the
resulting GB/s, per dtype. `--library` measures another build of
the kernels (e.g. the one before a change) instead of the selected one; run
both in the same session and compare ratios (the machine may be shared).
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--dtypes", default="auto,fp8_e5m2,int8_per_token_head")
    ap.add_argument("--library", help="a kernels .so to load instead of cpu_backend's own")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--layers", type=int, default=8, help="caches rotated over (1 = L3-resident)")
    args = ap.parse_args(argv)

    import torch

    from cpu_backend.kv_cache import handler_for

    torch.set_num_threads(args.threads)
    if args.library:
        torch.ops.load_library(args.library)
    else:
        from cpu_backend.ops import load

        load()
    heads, kv_heads, head_size, block = 9, 3, 64, args.block_size
    blocks_per_seq = -(-args.context // block)
    num_blocks = args.seqs * blocks_per_seq
    gen = torch.Generator().manual_seed(0)
    block_table = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(args.seqs, -1).contiguous()
    token_req = torch.arange(args.seqs, dtype=torch.int32)
    token_pos = torch.full((args.seqs,), args.context - 1, dtype=torch.int32)
    query = torch.randn(args.seqs, heads, head_size, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(query)
    print(f"decode attention, {args.seqs} x {args.context} cached tokens, {block}-token blocks, {args.threads} threads, "
          f"library {args.library or 'cpu_backend'}")
    for name in args.dtypes.split(","):
        handler = handler_for(name)
        keys = torch.randn(args.seqs * args.context, kv_heads, head_size, generator=gen).to(torch.bfloat16)
        slots = torch.cat([block_table[s].long().repeat_interleave(block)[: args.context] * block
                           + torch.arange(args.context) % block for s in range(args.seqs)])
        caches = []
        for _ in range(args.layers):
            caches.append(torch.zeros(num_blocks, kv_heads, block, handler.row_elems(head_size),
                                      dtype=handler.storage_dtype(torch.bfloat16)))
            torch.ops.cpu_backend.write_kv_cache(keys, keys, caches[-1], slots,
                                                 handler.kernel_format, 0.05, 0.05)
        times = []
        for i in range(args.calls + 2):
            cache = caches[i % args.layers]
            t = time.perf_counter()
            torch.ops.cpu_backend.paged_attention(
                out, query, cache, block_table, token_req, token_pos, head_size**-0.5, 0, 0.0, None,
                handler.kernel_format, 0.05, 0.05)
            times.append(time.perf_counter() - t)
        med = statistics.median(times[2:])
        nbytes = cache.numel() * cache.element_size()
        print(f"{name:>22}: {med * 1e3:7.2f} ms  {nbytes / 1e6:6.1f} MB  {nbytes / med / 1e9:5.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
