"""cpu_backend::w8a8_quantize / w8a8_int_mm / w8a8_linear (csrc/linear_w8a8.cpp)
on every ISA library against a Python reference written from the formulas.

- activation quantization (dynamic per token sym/asym, static sym/asym): q,
  scale and zero point EXACTLY equal to the reference (same fp32 operations,
  round half to even, clamp to [-127, 127]);
- integer product: int32-exact against q.long() @ w.long().T, including the
  extremes that would saturate a naive VPMADDUBSW (q = +-127 with w = -128);
- full linear: the reference is float64 of s_a * s_w * (sum q w - zp * sum w) + b
  computed from the reference's q / s / zp; tolerance
  |y - ref| <= 1e-6 * (s_a s_w (|sum q w| + |zp sum w|) + |b|) + 1e-30, plus one
  output rounding for bf16/fp16 (2^-8 / 2^-11 relative): the kernel converts
  the exact int32 to fp32 once and applies two fp32 multiplies and one add.
Grid: M = 1, 3, 17, 128 (x 2-D, 3-D, column-major at M = 3, row-strided at
M = 128), (N, K) = (16, 64), (40, 36),
(104, 130), (33, 7) (partial panels, K not a multiple of 4), x fp32/bf16/fp16,
with and without bias, the four activation modes; the integer product also at
M = 50 and (N, K) = (48, 192). Every library this CPU runs, amx included (AMX
tiles from 16 rows).
"""

from __future__ import annotations

import json
import sys

import pytest

try:
    from plugin_tests.isa_worker import ISA_PATHS, run_worker
except ImportError:  # run as the worker script
    ISA_PATHS, run_worker = [], None


def ref_quantize(x, scale=None, zp=None, symmetric=True):
    """Reference activation quantization (fp32, as documented in linear_w8a8.cpp)."""
    import torch

    x = x.float().reshape(-1, x.shape[-1])
    if scale is None:
        if symmetric:
            amax = x.abs().amax(-1, keepdim=True)
            s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
            z = torch.zeros_like(s)
        else:
            lo = x.amin(-1, keepdim=True).clamp(max=0)
            hi = x.amax(-1, keepdim=True).clamp(min=0)
            s = torch.where(hi > lo, (hi - lo) / 254, torch.ones_like(hi))
            z = torch.round(-127 - lo / s)
    else:
        s = torch.full((x.shape[0], 1), scale, dtype=torch.float32)
        z = torch.full_like(s, 0 if symmetric or zp is None else zp)
    q = (torch.round(x / s) + z).clamp(-127, 127)
    return q.to(torch.int8), s.reshape(-1), z.reshape(-1).to(torch.int32)


def _worker() -> dict:
    import os

    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from cpu_backend import ops
    from cpu_backend.quantization.formats import int8_kernel_layout as kernel_layout

    isa = ops.load()
    gen = torch.Generator().manual_seed(8)
    failures, cases = [], 0
    rel_out = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
    modes = [("dyn-sym", None, None, True), ("dyn-asym", None, None, False),
             ("static-sym", 0.02, None, True), ("static-asym", 0.03, -20, False)]

    # integer product at the extremes (saturation check) and random; panels of
    # 16 columns: 1, 3 and 7 (avx512 pairs them from two rows on, an odd one
    # left alone) and 4
    # (48, 192): K a multiple of 64, read in place by the AMX tiles (amx
    # library) for whole 32-row blocks, M = 50 adds a partial block after one.
    for n, k in ((16, 64), (40, 36), (33, 7), (104, 130), (64, 40), (48, 192)):
        w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
        w[0] = -128
        lay = kernel_layout(w, torch.ones(n))
        for m in (1, 3, 17, 50, 128):
            q = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen)
            q[0] = 127
            if m > 1:
                q[1] = -127
            got = torch.ops.cpu_backend.w8a8_int_mm(q, lay["qweight"], lay["wsum"], n)
            want = (q.long() @ w.long().T).int()
            cases += 1
            if not torch.equal(got, want):
                failures.append(f"int_mm {m}x{k}x{n}: max diff {(got - want).abs().max()}")

    for n, k in ((16, 64), (40, 36), (104, 130), (33, 7)):
        w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
        ws = torch.rand(n, generator=gen) * 0.01 + 1e-3
        lay = kernel_layout(w, ws)
        for m in (1, 3, 17, 128):
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                shape = (m, k) if m != 17 else (1, m, k)  # 3-D x too
                x = (torch.randn(shape, generator=gen) * 2).to(dt)
                if m == 3:  # column-major x: the kernel copies it to rows
                    x = x.t().contiguous().t()
                elif m == 128:  # row-strided x: read in place
                    x = torch.nn.functional.pad(x, (0, 5))[:, :k]
                bias = torch.randn(n, generator=gen).to(dt) if m in (3, 17) else None
                for label, scale, zp, sym in modes:
                    tag = f"{label} {m}x{k}x{n} {dt}"
                    cases += 1
                    rq, rs, rz = ref_quantize(x, scale, zp, sym)
                    kq, ks, kz = torch.ops.cpu_backend.w8a8_quantize(x, scale, zp, sym)
                    if not (torch.equal(kq, rq) and torch.equal(ks, rs) and torch.equal(kz, rz)):
                        failures.append(f"quantize {tag}: q diff {(kq.int() - rq.int()).abs().max()}, "
                                        f"s diff {(ks - rs).abs().max()}, zp diff {(kz - rz).abs().max()}")
                        continue
                    y = torch.ops.cpu_backend.w8a8_linear(x, lay["qweight"], lay["wsum"], lay["w_scale"],
                                                          n, scale, zp, sym, bias)
                    acc = rq.double() @ w.double().T
                    corr = rz.double()[:, None] * w.double().sum(1)[None, :]
                    sc = rs.double()[:, None] * ws.double()[None, :]
                    want = sc * (acc - corr)
                    mag = sc * (acc.abs() + corr.abs())
                    if bias is not None:
                        want = want + bias.double()
                        mag = mag + bias.double().abs()
                    want = want.reshape(*shape[:-1], n)
                    mag = mag.reshape(*shape[:-1], n)
                    tol = 1e-6 * mag + 1e-30 + rel_out[dt] * want.abs()
                    err = (y.double() - want).abs()
                    if y.dtype != dt or y.shape != want.shape or not bool((err <= tol).all()):
                        failures.append(f"linear {tag}: max err {float(err.max()):.3g}")
                    # the form writing into a given tensor (step graphs' buffers): the same values
                    into = torch.full_like(y, float("nan"))
                    torch.ops.cpu_backend.w8a8_linear_out(into, x, lay["qweight"], lay["wsum"],
                                                          lay["w_scale"], n, scale, zp, sym, bias)
                    if not torch.equal(into, y):
                        failures.append(f"linear {tag}: w8a8_linear_out differs from w8a8_linear")
    return {"isa": isa, "failures": failures, "cases": cases}


# amx: the avx512 library plus AMX tiles, which this kernel uses from 16 rows.
@pytest.mark.parametrize("isa_path", ["amx", *ISA_PATHS])
def test_w8a8_kernels_match_reference(isa_path):
    result = run_worker(__file__, isa_path)
    assert result["cases"] >= 200
    assert result["failures"] == [], result["failures"][:20]


def test_w8a8_linear_rejects_bad_operands():
    import torch

    from cpu_backend import ops
    from cpu_backend.quantization.formats import int8_kernel_layout as kernel_layout

    ops.load()
    lay = kernel_layout(torch.zeros(20, 8, dtype=torch.int8), torch.ones(20))
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.cpu_backend.w8a8_linear(torch.randn(2, 12), lay["qweight"], lay["wsum"],
                                          lay["w_scale"], 20)
    with pytest.raises(RuntimeError, match="n=40"):
        torch.ops.cpu_backend.w8a8_linear(x, lay["qweight"], lay["wsum"], lay["w_scale"], 40)
    with pytest.raises(RuntimeError, match="input_scale must be > 0"):
        torch.ops.cpu_backend.w8a8_linear(x, lay["qweight"], lay["wsum"], lay["w_scale"], 20, 0.0)
    with pytest.raises(RuntimeError, match="qweight must be"):
        torch.ops.cpu_backend.w8a8_linear(x, lay["qweight"].float(), lay["wsum"], lay["w_scale"], 20)
    with pytest.raises(RuntimeError, match=r"w8a8_linear_out: out must be .* shape \[2, 20\]"):
        torch.ops.cpu_backend.w8a8_linear_out(torch.empty(2, 21), x, lay["qweight"], lay["wsum"],
                                              lay["w_scale"], 20)
    with pytest.raises(ValueError, match="int8"):
        kernel_layout(torch.zeros(4, 4), torch.ones(4))


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    print(json.dumps(_worker()))
