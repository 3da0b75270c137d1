"""Vector math (csrc/vec/vec_math.h), gated activations (csrc/activation.cpp)
and rotary embedding (csrc/rotary.cpp) against torch / the host's native
forwards, on every ISA library (one subprocess per ISA, see isa_worker.py).

Tolerances:
- exp: <= 2 ulp (of the fp32 result) against float64 exp where the result is
  a normal fp32; subnormal results within 2^-148 absolute; -inf -> 0,
  +inf and x > 88.73 -> inf, NaN -> NaN exactly.
- tanh <= 2e-7, erf <= 5e-7 absolute (float64 reference); silu, gelu,
  gelu_tanh: |err| <= 4e-7 * max(1, |x|). GELU's far negative tail
  (x < -3, where 1 + erf(x/sqrt2) cancels) is thus accurate in absolute terms
  only: |err| < 1e-6 on values below 4e-3.
- silu_and_mul / gelu_and_mul (none, tanh) against the host's
  SiluAndMul/GeluAndMul.forward_native (both round the activation, then the
  product, to the dtype): |diff| <= rel * |ref| + 2e-6 * (1 + |b|), b the
  multiplier, rel = 1e-6 (fp32), 2 ulps worst case (2^-6 bf16, 2^-9 fp16): torch's own
  bf16/fp16 GELU can round to the other neighbour, and the tail above.
- rotary_embedding against the host's RotaryEmbedding.forward_static (which
  computes in the query dtype, rounding each product; ours rounds once):
  |diff| <= 2 ulps of the dtype at the largest |input| (inputs ~N(0, 1)).
"""

from __future__ import annotations

import json
import math
import sys
import types

import pytest

try:
    from plugin_tests.isa_worker import ISA_PATHS, run_worker
except ImportError:  # run as the worker script
    ISA_PATHS, run_worker = [], None

DTYPES = ("float32", "bfloat16", "float16")


def _math_failures() -> tuple[list[str], dict]:
    import torch

    failures, worst = [], {}
    unary = torch.ops.cpu_backend.vec_unary
    # exp over the whole useful range and beyond, with the special values
    x = torch.cat([
        torch.linspace(-120.0, 100.0, 200_003),
        torch.linspace(-1.0, 1.0, 20_001),
        torch.tensor([float("-inf"), float("inf"), float("nan"), 0.0, -0.0, 88.72, 88.73, -87.33, -103.9]),
    ])
    got = unary(x, "exp").double()
    want = torch.exp(x.double())
    normal = (want >= torch.finfo(torch.float32).tiny) & (want <= torch.finfo(torch.float32).max)
    ulp = torch.exp2(torch.floor(torch.log2(want[normal])) - 23)
    ulps = ((got[normal] - want[normal]).abs() / ulp).max().item()
    worst["exp_ulp"] = ulps
    if not ulps <= 2.0:
        failures.append(f"exp: {ulps:.2f} ulp")
    sub = (want < torch.finfo(torch.float32).tiny) & torch.isfinite(x)
    sub_err = (got[sub] - want[sub]).abs().max().item()
    if not sub_err <= 2.0**-148:
        failures.append(f"exp subnormal range: abs err {sub_err:.3g}")
    specials = unary(torch.tensor([float("-inf"), float("inf"), float("nan"), 88.73, 200.0, -200.0]), "exp")
    if not (specials[0] == 0 and specials[1] == float("inf") and torch.isnan(specials[2])
            and specials[3] == float("inf") and specials[4] == float("inf") and specials[5] == 0):
        failures.append(f"exp specials: {specials.tolist()}")
    # tanh / erf / silu / gelu
    x = torch.cat([torch.linspace(-12.0, 12.0, 100_001), torch.linspace(-1e-3, 1e-3, 1001)])
    xd = x.double()
    refs = {
        "tanh": (torch.tanh(xd), 2e-7, False),
        "erf": (torch.erf(xd), 5e-7, False),
        "silu": (torch.nn.functional.silu(xd), 4e-7, True),
        "gelu": (torch.nn.functional.gelu(xd), 4e-7, True),
        "gelu_tanh": (torch.nn.functional.gelu(xd, approximate="tanh"), 4e-7, True),
    }
    for fn, (ref, tol, relative) in refs.items():
        err = (unary(x, fn).double() - ref).abs()
        if relative:
            err = err / xd.abs().clamp(min=1.0)
        worst[fn] = err.max().item()
        if not worst[fn] <= tol:
            failures.append(f"{fn}: {worst[fn]:.3g} > {tol}")
    return failures, worst


def _gated_failures(gen) -> list[str]:
    import torch
    from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul

    failures = []
    for name in DTYPES:
        dtype = getattr(torch, name)
        for rows, d in ((1, 1), (3, 17), (7, 100), (2, 600), (33, 1536)):
            base = torch.randn(rows, 2 * d + 6, generator=gen) * 3
            x = base[:, : 2 * d].to(dtype)  # row-strided
            cases = {
                "silu": (lambda o, x: torch.ops.cpu_backend.silu_and_mul(o, x), SiluAndMul.forward_native(x)),
            }
            for approx in ("none", "tanh"):
                host = types.SimpleNamespace(approximate=approx)
                cases[f"gelu_{approx}"] = (
                    lambda o, x, a=approx: torch.ops.cpu_backend.gelu_and_mul(o, x, a),
                    GeluAndMul.forward_native(host, x),
                )
            for label, (op, ref) in cases.items():
                out = torch.empty(rows, d, dtype=dtype)
                op(out, x)
                a, b = out.double(), ref.double()
                mult = x[:, d:].double().abs()
                rel = {torch.float32: 1e-6, torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9}[dtype]
                if not bool(((a - b).abs() <= rel * b.abs() + 2e-6 * (1 + mult)).all()):
                    failures.append(f"{label}_and_mul {name} {rows}x{d}: max diff {(a - b).abs().max():.3g}")
    return failures


def _cos_sin_cache(rotary_dim: int, max_pos: int, dtype):
    import torch

    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    freqs = torch.einsum("i,j -> ij", torch.arange(max_pos, dtype=torch.float), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def _rotary_failures(gen) -> list[str]:
    import torch
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    mantissa = {"float32": 23, "bfloat16": 7, "float16": 10}
    failures = []
    max_pos = 4096
    for name in DTYPES:
        dtype = getattr(torch, name)
        # head_size, rotary_dim, neox, q heads, kv heads
        for hs, rot, neox, hq, hk in ((64, 64, True, 8, 2), (128, 64, True, 4, 4), (128, 64, False, 4, 1),
                                       (80, 80, False, 3, 1), (96, 24, True, 2, 2), (256, 256, True, 2, 1)):
            cache = _cos_sin_cache(rot, max_pos, dtype)
            for tokens in (1, 7, 33):
                positions = torch.randint(0, max_pos, (tokens,), generator=gen)
                qkv = torch.randn(tokens, (hq + 2 * hk) * hs, generator=gen).to(dtype)
                q, k = qkv[:, : hq * hs], qkv[:, hq * hs : (hq + hk) * hs]  # row-strided views
                want_q, want_k = RotaryEmbedding.forward_static(positions, q.clone(), k.clone(), hs, rot, cache, neox)
                # int64 positions are read in place; others (int32 here) through a copy
                pos_arg = positions.int() if tokens == 7 else positions
                torch.ops.cpu_backend.rotary_embedding(pos_arg, q, k, hs, cache, neox)
                label = f"{name} hs{hs} rot{rot} {'neox' if neox else 'gptj'} t{tokens}"
                # 2 ulps at the largest input magnitude
                tol = 2.0 ** (math.floor(math.log2(float(qkv.float().abs().max()))) - mantissa[name] + 1)
                for what, got, want in (("q", q, want_q), ("k", k, want_k)):
                    err = float((got.double() - want.double()).abs().max())
                    if not err <= tol:
                        failures.append(f"rotary {what} {label}: {err:.3g}")
                # 3-D query, no key
                q3 = torch.randn(tokens, hq, hs, generator=gen).to(dtype)
                want_q3, _ = RotaryEmbedding.forward_static(positions, q3.clone(), None, hs, rot, cache, neox)
                torch.ops.cpu_backend.rotary_embedding(positions, q3, None, hs, cache, neox)
                err = float((q3.double() - want_q3.double()).abs().max())
                tol3 = 2.0 ** (math.floor(math.log2(float(want_q3.float().abs().max()))) - mantissa[name] + 2)
                if not err <= tol3:
                    failures.append(f"rotary q3 (no key) {label}: {err:.3g}")
    return failures


def _worker() -> dict:
    import torch

    from cpu_backend import ops

    isa = ops.load()
    gen = torch.Generator().manual_seed(5)
    failures, worst = _math_failures()
    failures += _gated_failures(gen)
    failures += _rotary_failures(gen)
    return {"isa": isa, "failures": failures, "worst": worst}


@pytest.mark.parametrize("isa_path", ISA_PATHS)
def test_vector_math_activations_and_rotary_match_references(isa_path):
    result = run_worker(__file__, isa_path)
    assert result["failures"] == [], result["failures"][:20]
    print(isa_path, "worst:", result["worst"])


def test_bad_arguments_name_the_problem():
    import torch

    from cpu_backend import ops

    ops.load()
    cache = _cos_sin_cache(64, 16, torch.float32)
    q = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="outside the cos/sin cache"):
        torch.ops.cpu_backend.rotary_embedding(torch.tensor([0, 16]), q, None, 64, cache, True)
    with pytest.raises(RuntimeError, match=r"query must be \[tokens, heads \* head_size\]"):
        torch.ops.cpu_backend.rotary_embedding(torch.tensor([0, 1]), q.view(2, 1, 1, 64), None, 64, cache, True)
    with pytest.raises(RuntimeError, match="not a multiple of head_size 48"):
        torch.ops.cpu_backend.rotary_embedding(torch.tensor([0, 1]), q, None, 48, _cos_sin_cache(48, 16, torch.float32), True)
    with pytest.raises(RuntimeError, match="approximate must be"):
        torch.ops.cpu_backend.gelu_and_mul(torch.empty(2, 32), q, "erf")
    with pytest.raises(RuntimeError, match="out must be"):
        torch.ops.cpu_backend.silu_and_mul(torch.empty(2, 64), q)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    print(json.dumps(_worker()))
