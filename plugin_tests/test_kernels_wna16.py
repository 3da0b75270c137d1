"""cpu_backend::wna16_linear (csrc/linear_wna16.cpp) on every ISA library
against a float64 reference: x @ dequant(W)^T + b, with dequant from the
GPTQ / AWQ reference dequantizers (plugin_tests/quant_reference.py) of
tensors packed by cpu_backend.quantization.formats.

Tolerance: the kernel widens x to fp32 and accumulates in fp32 (weights are
exact small integers times a fp32 scale, plus zs = -zero*scale rounded once):
|y - ref| <= 1e-4 * (|x| @ |W|^T + |b|) + 1e-5 for fp32 output; bf16/fp16
outputs add one rounding of the result (2^-8 / 2^-11 relative).
Grid: bits 4/8, group -1/32/64/128, sym/asym, act-order (g_idx) or not,
M = 1, 3, 13 (over one quantized microkernel), 17 (the dense path of the avx2 and portable
builds, from 16 rows: several chunks, a partial one), N = 48, 40 and 104 (partial panels), K = 128/256,
x fp32/bf16/fp16, with and without bias; AWQ 4-bit through the same path (bf16 x, also with
float32 output, what the LM head asks for; on the odd-K cases too; row-strided and transposed x); odd K
(37, 39, 66 in groups of 33, 6 in groups of 2) against the integer view directly.

bits=6 (values below 64 in 8-bit fields, GGUF's 5- and 6-bit types): groups of
16, 32, 64, symmetric (zero 32, no zs) and with float min terms, M = 1, 3, 17,
fp32/bf16 x, with fp32 and with int8 activations (the latter against the same
int8 reference as W4A8).

Symmetric weights packed without zs (kernel_layout(drop_symmetric_zs=True):
the kernel derives -2^(bits-1) * scale): bit for bit the output of the same
layout with zs, for every symmetric case of the grid (both activation
paths, every M and dtype); asymmetric weights keep their zs.

W4A8 (int8_act=True): every 4-bit case of the grid above and the AWQ ones
again, against x quantized by the independent reference
(quant_reference.int8_activations_per32: per 32 inputs in the kernel's perm
order) times the same dequantized weights, same tolerance (the products are
exact integers, the scaling fp32); plus all-zero and all-negative blocks.
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
    import os

    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from cpu_backend import ops
    from cpu_backend.quantization import formats
    from plugin_tests import quant_reference as ref

    isa = ops.load()
    gen = torch.Generator().manual_seed(5)
    failures, cases, worst, sym_cases = [], 0, 0.0, 0
    rel_out = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}

    def check(label, x, w_ref, bias, lay, bits, n, out_dtype=None, int8_act=False):
        nonlocal cases, worst
        y = torch.ops.cpu_backend.wna16_linear(x, lay["qweight"], lay["scales"], lay["zs"], bits,
                                               lay["group_size"], n, lay["perm"], bias, out_dtype,
                                               int8_act)
        xr = ref.int8_activations_per32(x, lay["perm"]) if int8_act else x.double()
        want = xr @ w_ref.T
        mag = xr.abs() @ w_ref.abs().T
        if bias is not None:
            want = want + bias.double()
            mag = mag + bias.double().abs()
        out_dtype = out_dtype or x.dtype
        tol = 1e-4 * mag + 1e-5 + rel_out[out_dtype] * want.abs()
        err = (y.double() - want).abs()
        cases += 1
        worst = max(worst, float((err / tol).max()))
        if y.dtype != out_dtype or y.shape != want.shape or not bool((err <= tol).all()):
            failures.append(f"{label}: max err {float(err.max()):.3g}")
        # the form writing into a given tensor (step graphs' buffers): the very same values
        into = torch.full_like(y, float("nan"))
        torch.ops.cpu_backend.wna16_linear_out(into, x, lay["qweight"], lay["scales"], lay["zs"], bits,
                                               lay["group_size"], n, lay["perm"], bias, int8_act)
        if not torch.equal(into, y):
            failures.append(f"{label}: wna16_linear_out differs from wna16_linear")

    def same_without_zs(label, x, lay, lay0, bits, n, bias, int8_act=False):
        nonlocal sym_cases
        args = (bits, lay["group_size"], n, lay["perm"], bias, None, int8_act)
        y = torch.ops.cpu_backend.wna16_linear(x, lay["qweight"], lay["scales"], lay["zs"], *args)
        y0 = torch.ops.cpu_backend.wna16_linear(x, lay0["qweight"], lay0["scales"], lay0["zs"], *args)
        sym_cases += 1
        if not torch.equal(y, y0):
            failures.append(f"{label} without zs: max diff {float((y.double() - y0.double()).abs().max()):.3g}")

    for bits in (4, 8):
        for gs in (-1, 32, 64, 128):
            for sym in (True, False):
                for act in (False, True):
                    for n, k in ((48, 128), (40, 256), (104, 256)):
                        w = torch.randn(n, k, generator=gen) * 0.05
                        perm = torch.randperm(k, generator=gen) if act else None
                        v = formats.quantize_rtn(w, bits, gs, sym, perm)
                        t = formats.gptq_pack(v["q"], v["zero"], v["scale"], v["g_idx"], bits)
                        w_ref = ref.gptq_dequantize(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits)
                        back = formats.gptq_unpack(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits)
                        lay = formats.kernel_layout(back["q"], back["zero"], back["scale"], back["g_idx"], bits)
                        lay0 = formats.kernel_layout(back["q"], back["zero"], back["scale"], back["g_idx"], bits,
                                                     drop_symmetric_zs=True)
                        if (lay0["zs"].numel() == 0) != sym:
                            failures.append(f"gptq b{bits} g{gs} sym{sym}: zs of {lay0['zs'].numel()} values")
                        for m in (1, 3, 13, 17):
                            for dt in (torch.float32, torch.bfloat16, torch.float16):
                                x = torch.randn(m, k, generator=gen).to(dt)
                                bias = torch.randn(n, generator=gen).to(dt) if m == 3 else None
                                label = f"gptq b{bits} g{gs} sym{sym} act{act} {m}x{k}x{n} {dt}"
                                check(label, x, w_ref, bias, lay, bits, n)
                                if sym:
                                    same_without_zs(label, x, lay, lay0, bits, n, bias)
                                if bits == 4:
                                    check(f"gptq W4A8 g{gs} sym{sym} act{act} {m}x{k}x{n} {dt}",
                                          x, w_ref, bias, lay, bits, n, int8_act=True)
                                    if sym:
                                        same_without_zs(f"W4A8 {label}", x, lay, lay0, bits, n, bias, True)
    for gs in (-1, 32, 64, 128):
        w = torch.randn(64, 256, generator=gen) * 0.05
        v = formats.quantize_rtn(w, 4, gs, False)
        t = formats.awq_pack(v["q"], v["zero"], v["scale"])
        w_ref = ref.awq_dequantize(t["qweight"], t["qzeros"], t["scales"], gs)
        back = formats.awq_unpack(t["qweight"], t["qzeros"], t["scales"])
        lay = formats.kernel_layout(back["q"], back["zero"], back["scale"], back["g_idx"], 4)
        for m in (1, 9):
            x = torch.randn(2, m, 256, generator=gen).bfloat16()  # 3-D x
            check(f"awq g{gs} m{m}", x, w_ref, None, lay, 4, 64)
            check(f"awq g{gs} m{m} float32 out", x, w_ref, None, lay, 4, 64, torch.float32)
            check(f"awq W4A8 g{gs} m{m} float32 out", x, w_ref, None, lay, 4, 64, torch.float32, True)
    # bits=6: values below 64 in 8-bit fields (GGUF's 5- and 6-bit types), zero
    # 32 when symmetric, float min terms (zs) otherwise; fp32 and int8 activations
    for gs in (16, 32, 64):
        for sym in (True, False):
            n, k = 40, 256
            q = torch.randint(0, 64, (n, k), generator=gen, dtype=torch.int32)
            scale = torch.rand(n, k // gs, generator=gen) * 0.01 + 1e-3
            zero = torch.full((n, k // gs), 32, dtype=torch.int32)
            g_idx = (torch.arange(k) // gs).to(torch.int32)
            mins = None if sym else torch.randn(n, k // gs, generator=gen) * 0.1
            gi = g_idx.long()
            if sym:
                w6_ref = (q.double() - 32) * scale.double()[:, gi]
            else:
                w6_ref = q.double() * scale.double()[:, gi] + mins.double()[:, gi]
            lay6 = formats.kernel_layout(q, zero, scale, g_idx, 6, drop_symmetric_zs=True, zs=mins)
            if (lay6["zs"].numel() == 0) != sym:
                failures.append(f"b6 g{gs} sym{sym}: zs of {lay6['zs'].numel()} values")
            for m in (1, 3, 17):
                for dt in (torch.float32, torch.bfloat16):
                    x = torch.randn(m, k, generator=gen).to(dt)
                    bias = torch.randn(n, generator=gen).to(dt) if m == 3 else None
                    for a8 in (False, True):
                        check(f"b6 g{gs} sym{sym} a8={a8} {m}x{k}x{n} {dt}", x, w6_ref, bias, lay6, 6, n,
                              None, a8)
    # x not contiguous (the last AWQ layout): rows of a wider tensor, a transposed one
    for m in (1, 17):
        wide = torch.randn(m, 512, generator=gen).bfloat16()[:, 128:384]
        transposed = torch.randn(256, m, generator=gen).bfloat16().t()
        for name, x in (("row-strided", wide), ("transposed", transposed)):
            for a8 in (False, True):
                check(f"awq {name} x m{m} W4A8={a8}", x, w_ref, None, lay, 4, 64, None, a8)
    # W4A8: an all-zero block (scale 1), and blocks whose max sits at -max
    w = torch.randn(32, 128, generator=gen) * 0.05
    v = formats.quantize_rtn(w, 4, 64, False)
    gi = v["g_idx"].long()
    w_ref = (v["q"].double() - v["zero"].double()[:, gi]) * v["scale"].double()[:, gi]
    lay = formats.kernel_layout(v["q"], v["zero"], v["scale"], v["g_idx"], 4)
    x = torch.randn(4, 128, generator=gen)
    x[0, :32] = 0
    x[1, 32:64] = -x[1, 32:64].abs()
    x[2] = 0
    check("W4A8 zero and negative blocks", x, w_ref, None, lay, 4, 32, int8_act=True)
    # odd K (not a multiple of the kernel's k unroll) straight from the integer view
    for bits in (4, 8):
        for k, gs in ((37, -1), (39, -1), (66, 33), (6, 2)):
            w = torch.randn(24, k, generator=gen)
            v = formats.quantize_rtn(w, bits, gs, False)
            gi = v["g_idx"].long()
            w_ref = (v["q"].double() - v["zero"].double()[:, gi]) * v["scale"].double()[:, gi]
            lay = formats.kernel_layout(v["q"], v["zero"], v["scale"], v["g_idx"], bits)
            for m in (1, 2, 5, 17):
                for dt in (torch.float32, torch.bfloat16):
                    x = torch.randn(m, k, generator=gen).to(dt)
                    check(f"odd K b{bits} k{k} g{gs} m{m} {dt}", x, w_ref, None, lay, bits, 24)
                    if dt == torch.bfloat16:
                        check(f"odd K b{bits} k{k} g{gs} m{m} {dt} float32 out", x, w_ref, None, lay, bits, 24,
                              torch.float32)
    return {"isa": isa, "failures": failures, "cases": cases, "worst_err_over_tol": worst,
            "sym_cases": sym_cases}


@pytest.mark.parametrize("isa_path", ISA_PATHS)
def test_wna16_linear_matches_reference(isa_path):
    result = run_worker(__file__, isa_path)
    assert result["cases"] >= 1224 + 585 + 72
    assert result["sym_cases"] >= 864
    assert result["failures"] == [], result["failures"][:20]


def test_wna16_linear_rejects_bad_operands():
    import torch

    from cpu_backend import ops

    ops.load()
    q = torch.zeros(1, 8, 64, dtype=torch.uint8)  # 16 columns, K = 2 groups of 32, 4-bit
    s = torch.zeros(1, 2, 16)
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match=r"zs may be empty for symmetric weights\), got \[1, 2, 8\]"):
        torch.ops.cpu_backend.wna16_linear(x, q, s, torch.zeros(1, 2, 8), 4, 32, 16)
    with pytest.raises(RuntimeError, match="bits must be 4, 6 or 8"):
        torch.ops.cpu_backend.wna16_linear(x, q, s, s, 3, 32, 16)
    with pytest.raises(RuntimeError, match="group_size=48"):
        torch.ops.cpu_backend.wna16_linear(x, q, s, s, 4, 48, 16)
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.cpu_backend.wna16_linear(torch.randn(1, 63), q, s, s, 4, 32, 16)
    q8 = torch.zeros(1, 16, 64, dtype=torch.uint8)  # the same K in 8-bit
    with pytest.raises(RuntimeError, match="int8_act needs 4-bit weights .* got bits=8"):
        torch.ops.cpu_backend.wna16_linear(x, q8, s, s, 8, 32, 16, int8_act=True)
    q6 = torch.zeros(1, 12, 64, dtype=torch.uint8)  # K = 48 in groups of 16: not whole units of 32
    s6 = torch.zeros(1, 3, 16)
    with pytest.raises(RuntimeError, match="int8_act needs .* got bits=6 group_size=16 K=48"):
        torch.ops.cpu_backend.wna16_linear(torch.randn(1, 48), q6, s6, s6, 6, 16, 16, int8_act=True)
    with pytest.raises(RuntimeError, match=r"wna16_linear_out: out must be .* shape \[1, 16\], got \[1, 17\]"):
        torch.ops.cpu_backend.wna16_linear_out(torch.empty(1, 17), x, q, s, s, 4, 32, 16)
    with pytest.raises(RuntimeError, match=r"wna16_linear_out: out must be a contiguous float32/bfloat16/float16 .* Int"):
        torch.ops.cpu_backend.wna16_linear_out(torch.empty(1, 16, dtype=torch.int32), x, q, s, s, 4, 32, 16)
    with pytest.raises(RuntimeError, match="int8_act needs 4-bit weights in groups of a multiple of 32"):
        torch.ops.cpu_backend.wna16_linear(torch.randn(1, 32), torch.zeros(1, 4, 64, dtype=torch.uint8),
                                           torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), 4, 16, 16,
                                           int8_act=True)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    print(json.dumps(_worker()))
