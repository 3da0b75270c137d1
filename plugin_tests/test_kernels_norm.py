"""Native RMSNorm / fused add + RMSNorm (cpu_backend.ops.norm) against vLLM's
own `native` implementations of the IR ops, on every ISA library.

The kernel rounds where the native code rounds; only the summation order of
the mean of squares differs. That can move the normalized value by one ulp
before the weight multiply, which rounds again: two ulps at most.
fp32: |diff| <= 2e-6 * max|ref|; bf16/fp16: |diff| <= 2 ulps of |ref|
(2^-6 and 2^-9 relative, worst case) + 1e-6. The residual written back is bit-exact.
Shapes: hidden 576/896/1000 (not a multiple of 16)/64, 1-33 rows, row-strided x,
and [rows, 8 heads, hidden / 8] views into a wider row (per-head q/k norms).
Weights in x's dtype, and in fp32 with bf16/fp16 x (Gemma's `1 + w`, as the host's
GemmaRMSNorm passes it: one rounding, of the fp32 product, as in the native code).
"""

from __future__ import annotations

import json
import sys

import pytest

try:
    from plugin_tests.isa_worker import ISA_PATHS, run_worker
except ImportError:  # run as the worker script
    ISA_PATHS, run_worker = [], None


def _worker() -> dict:
    import torch
    from vllm import ir

    from cpu_backend import ops
    from cpu_backend.ops import norm

    isa = ops.load()
    failures = []
    gen = torch.Generator().manual_seed(3)
    native_rms = ir.ops.rms_norm.impls["native"].impl_fn
    native_add = ir.ops.fused_add_rms_norm.impls["native"].impl_fn
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for hidden in (576, 896, 1000, 64):
            for rows in (1, 7, 33):
                base = torch.randn(rows, hidden + 8, generator=gen).to(dtype)
                x = base[:, :hidden]  # row-strided view
                r = torch.randn(rows, hidden, generator=gen).to(dtype)
                w = torch.randn(hidden, generator=gen).to(dtype)
                label = f"{dtype} h{hidden} r{rows}"

                def close(a, b):
                    a, b = a.double(), b.double()
                    if dtype == torch.float32:
                        return float((a - b).abs().max()) <= 2e-6 * max(1.0, float(b.abs().max()))
                    ulp = 2.0**-6 if dtype == torch.bfloat16 else 2.0**-9  # 2 ulps, worst case
                    return bool(((a - b).abs() <= ulp * b.abs() + 1e-6).all())

                if not close(norm.rms_norm.impl_fn(x, None, 1e-5), native_rms(x, None, 1e-5)):
                    failures.append(f"rms_norm no weight {label}")
                # x's dtype, and (bf16/fp16) Gemma's fp32 weight 1 + w
                def weights(w):
                    return {"": w} if dtype == torch.float32 else {"": w, "fp32 weight ": w.float() + 1.0}

                for kind, wt in weights(w).items():
                    if not close(norm.rms_norm.impl_fn(x, wt, 1e-6), native_rms(x, wt, 1e-6)):
                        failures.append(f"rms_norm {kind}{label}")
                    want_x, want_r = native_add(x.clone(), r.clone(), wt, 1e-6)
                    got_x, got_r = x.clone(), r.clone()
                    norm.fused_add_rms_norm.impl_fn(got_x, got_r, wt, 1e-6)
                    if not (close(got_x, want_x) and torch.equal(got_r, want_r)):
                        failures.append(f"fused_add_rms_norm {kind}{label}")
                # Per-head rows of a fused qkv output (Qwen3/Gemma3 q/k norms):
                # [rows, heads, head_dim] viewed out of a wider row.
                if hidden % 8 == 0:
                    heads, hd = 8, hidden // 8
                    qkv = torch.randn(rows, hidden * 2, generator=gen).to(dtype)
                    q = qkv[:, hidden // 2:hidden // 2 + hidden].unflatten(-1, (heads, hd))
                    wh = torch.randn(hd, generator=gen).to(dtype)
                    for kind, wt in weights(wh).items():
                        if not norm._supports(q, wt, 1e-6):
                            failures.append(f"per-head rows not covered {kind}{label}")
                        elif not close(norm.rms_norm.impl_fn(q, wt, 1e-6), native_rms(q, wt, 1e-6)):
                            failures.append(f"rms_norm per-head rows {kind}{label}")
    return {"isa": isa, "failures": failures}


@pytest.mark.parametrize("isa_path", ISA_PATHS)
def test_native_rms_norm_matches_vllm_native(isa_path):
    result = run_worker(__file__, isa_path)
    assert result["failures"] == [], result["failures"][:20]


def test_unsupported_arguments_fall_through_to_native():
    import torch

    from cpu_backend.ops import norm

    x = torch.randn(4, 64)
    assert norm._supports(x, torch.ones(64), 1e-6)
    assert not norm._supports(x, torch.ones(64), 1e-6, variance_size=32)
    assert not norm._supports(x, torch.ones(64, dtype=torch.bfloat16), 1e-6)
    assert norm._supports(x.bfloat16(), torch.ones(64), 1e-6)  # Gemma's fp32 1 + w
    assert not norm._supports(x.t(), None, 1e-6)
    assert not norm._supports(torch.randn(4, 8, 3).transpose(1, 2), None, 1e-6)  # head_dim strided


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    print(json.dumps(_worker()))
