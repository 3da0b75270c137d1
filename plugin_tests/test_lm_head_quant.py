"""The int8 LM head copy (cpu_backend/quantization/lm_head.py) and its logits
on the loaded kernel library, against an independent float64 reference:
per vocabulary row s = 2 max|w| / 255 (rounded to fp16, as the writer's
scales are), q = clamp(round(w / s), -128, 127), logits = x @ (q s)^T + b.

Tolerances: every dequantized weight within 0.6 s of the original (s / 2, or
a little more for the largest |w| of a row once s is rounded down to fp16 and
q clamped to 127); logits as in test_kernels_wna16.py: 1e-4 of
|x| @ |W|^T plus one rounding of a bf16 output (none for float32 logits
from bf16 x, what the LM head asks for). The vocabulary (8232 rows)
spans two quantization chunks and ends in a partial panel of 16.
"""

from __future__ import annotations

import torch

from cpu_backend import ops
from cpu_backend.quantization import lm_head


def reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized weight, scale per row), float64."""
    amax = w.double().abs().amax(1, keepdim=True)
    s = torch.where(amax > 0, 2 * amax / 255, torch.ones_like(amax)).half().double()
    q = torch.clamp(torch.round(w.double() / s), -128, 127)
    return q * s, s


def test_int8_head_logits_match_reference():
    ops.load()
    gen = torch.Generator().manual_seed(3)
    n, k = lm_head.CHUNK_ROWS + 40, 96
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    w[7] = 0  # an all-zero row (scale 1)
    head = lm_head.quantize_head(w, "int8")
    assert (head.bits, head.group_size, head.out_features) == (8, k, n)
    assert head.nbytes() < w.numel() * w.element_size() * 0.6

    w_ref, s = reference(w)
    assert bool(((w_ref - w.double()).abs() <= 0.6 * s).all())
    for m, dtype, out_dtype in ((1, torch.bfloat16, None), (5, torch.bfloat16, None), (3, torch.float32, None),
                                (2, torch.bfloat16, torch.float32)):
        x = torch.randn(m, k, generator=gen).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype) if m == 3 else None
        got = head.logits(x, bias, out_dtype)
        dtype = out_dtype or dtype
        want = x.double() @ w_ref.T
        mag = x.double().abs() @ w_ref.abs().T
        if bias is not None:
            want, mag = want + bias.double(), mag + bias.double().abs()
        rel_out = 2.0**-8 if dtype == torch.bfloat16 else 0.0
        tol = 1e-4 * mag + 1e-5 + rel_out * want.abs()
        assert got.dtype == dtype and got.shape == (m, n)
        assert bool(((got.double() - want).abs() <= tol).all()), f"{m} {dtype}"


def test_unknown_mode_is_refused():
    import pytest

    with pytest.raises(ValueError, match="int4"):
        lm_head.quantize_head(torch.zeros(16, 32), "int4")


def test_auto_quantizes_the_head_of_quantized_checkpoints_only():
    from types import SimpleNamespace

    quantized = SimpleNamespace()  # any quantization config: the model is quantized
    assert lm_head.resolve_mode("auto", None) == "none"
    assert lm_head.resolve_mode("auto", quantized) == "int8"
    for setting in ("none", "int8"):  # an explicit setting wins either way
        assert lm_head.resolve_mode(setting, None) == setting
        assert lm_head.resolve_mode(setting, quantized) == setting
