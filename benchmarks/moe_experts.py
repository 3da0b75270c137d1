"""Fused-MoE experts: ours (prepacked / plain weights) vs the host's portable CPU
experts (`cpu_fused_moe`, isa "vec"), one MoE layer, median of 7 timed calls.

    python -m benchmarks.moe_experts [--threads 1]

Shape: 8 experts, top-2, hidden 1024, intermediate 1408 (a Qwen-MoE-like
expert), tokens 1 / 16 / 128, bf16 and fp32. Prints milliseconds and our
speed relative to the host's (ratio > 1: ours faster), plus the largest
difference between the two outputs. No pass/fail: numbers on a shared
machine are noisy.
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> None:
    import torch

    from cpu_backend.ops import load, moe

    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    load()
    if args.threads:
        torch.set_num_threads(args.threads)
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    torch.manual_seed(0)
    e, topk, h, i = 8, 2, 1024, 1408
    for dtype in (torch.bfloat16, torch.float32):
        w13 = (torch.randn(e, 2 * i, h) / h**0.5).to(dtype)
        w2 = (torch.randn(e, h, i) / i**0.5).to(dtype)
        p13, p2 = moe.prepack_experts(w13, w2)
        h13, h2 = cpu_prepack_moe_weight(w13, "vec"), cpu_prepack_moe_weight(w2, "vec")
        for m in (1, 16, 128):
            x = torch.randn(m, h).to(dtype)
            tw = torch.softmax(torch.randn(m, topk), -1)
            ti = torch.randint(0, e, (m, topk), dtype=torch.int32)

            def host():
                out = torch.empty(m, h, dtype=dtype)
                cpu_fused_moe(out, x, h13, h2, None, None, tw, ti, "silu", "vec", False)
                return out

            fns = {
                "ours_prepack": lambda: moe.fused_experts(x, p13, p2, tw, ti, n13=2 * i, n2=h),
                "ours_plain": lambda: moe.fused_experts(x, w13, w2, tw, ti, n13=2 * i, n2=h,
                                                        packed=False),
                "host_vec": host,
            }
            ms = {}
            for name, fn in fns.items():
                fn()
                ts = []
                for _ in range(7):
                    t = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t)
                ms[name] = sorted(ts)[3] * 1e3
            diff = (host().float() - fns["ours_prepack"]().float()).abs().max().item()
            print(f"{str(dtype):15} tokens {m:4}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
                  + f"; host/ours_prepack {ms['host_vec'] / ms['ours_prepack']:.2f}x; max diff {diff:.3g}")


if __name__ == "__main__":
    main()
