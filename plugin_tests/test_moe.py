"""Our fused-MoE experts (cpu_backend.ops.moe) against a float64 per-token reference.

Routing comes from the host's CPU router (`select_experts` in
`fused_moe/router/cpu_router.py`, what the engine runs): softmax top-k with
renormalize on and off, and grouped sigmoid top-k with a correction bias.
Shapes include hidden/intermediate sizes that are not multiples of 32 (the
host's CPU experts refuse those), token counts that the expert count does not
divide, experts that receive no token, and tokens whose experts all live on
another rank (expert_map -1: zero output).

Reference: `fused_experts_reference`, token by token in float64 from the very
values the kernel sees (x, weights already rounded to their dtype). Bounds on
the whole output, relative to its largest reference value R:
    fp32:  max |y - ref| <= 1e-5 * R    (fp32 accumulation over K <= 96)
    bf16:  max |y - ref| <= 2.5e-2 * R  (three bf16 roundings on the way:
           gate/up GEMM output, act*up, down GEMM output; 2^-8 each, plus the
           final rounding)
Both with the weights prepacked (VLLM_CPU_MOE_PREPACK=1) and plain (=0).
"""

from __future__ import annotations

import pytest

from cpu_backend import stats

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def moe():
    from cpu_backend.ops import load, moe

    load()
    return moe


def _route(logits, topk, mode):
    from vllm.model_executor.layers.fused_moe.router.cpu_router import select_experts

    hidden = torch.zeros(logits.shape[0], 1)
    if mode == "softmax":
        return select_experts(hidden, logits, topk, False, renormalize=True)
    if mode == "softmax_no_renorm":
        return select_experts(hidden, logits, topk, False, renormalize=False)
    assert mode == "grouped_sigmoid"
    bias = torch.linspace(-0.1, 0.1, logits.shape[1])
    return select_experts(hidden, logits, topk, True, renormalize=True, topk_group=1,
                          num_expert_group=2, scoring_func="sigmoid",
                          e_score_correction_bias=bias)


def _weights(e, i, h, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    return w13, w2


def _run(moe, x, w13, w2, tw, ti, packed, **kw):
    if packed:
        a, b = moe.prepack_experts(w13, w2)
    else:
        a, b = w13, w2
    return moe.fused_experts(x, a, b, tw, ti, n13=w13.shape[1], n2=w2.shape[1],
                             packed=packed, **kw)


def _check(y, ref, dtype):
    bound = (1e-5 if dtype == torch.float32 else 2.5e-2) * ref.abs().max().item()
    err = (y.double() - ref).abs().max().item()
    assert y.dtype == dtype
    assert err <= bound, f"max |y - ref| {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [True, False], ids=["prepack", "plain"])
@pytest.mark.parametrize(
    "m,e,topk,h,i,mode",
    [
        (1, 4, 2, 64, 96, "softmax"),
        (37, 4, 2, 64, 96, "softmax"),
        (37, 8, 2, 48, 40, "softmax_no_renorm"),
        (5, 8, 1, 64, 96, "softmax"),  # most experts get no token
        (23, 8, 2, 64, 64, "grouped_sigmoid"),
    ],
)
def test_fused_experts_matches_reference(moe, dtype, packed, m, e, topk, h, i, mode):
    g = torch.Generator().manual_seed(m * 100 + e)
    x = torch.randn(m, h, generator=g).to(dtype)
    tw, ti = _route(torch.randn(m, e, generator=g), topk, mode)
    w13, w2 = _weights(e, i, h, dtype, seed=m + e)
    y = _run(moe, x, w13, w2, tw, ti, packed)
    _check(y, moe.fused_experts_reference(x, w13, w2, tw, ti), dtype)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_activations_and_biases(moe, activation):
    m, e, topk, h, i = 19, 4, 2, 32, 48
    g = torch.Generator().manual_seed(7)
    x = torch.randn(m, h, generator=g)
    tw, ti = _route(torch.randn(m, e, generator=g), topk, "softmax")
    w13, w2 = _weights(e, i, h, torch.float32, seed=3)
    b13, b2 = torch.randn(e, 2 * i, generator=g), torch.randn(e, h, generator=g)
    ref = moe.fused_experts_reference(x, w13, w2, tw, ti, activation, b13, b2)
    for packed in (True, False):
        y = _run(moe, x, w13, w2, tw, ti, packed, activation=activation,
                 w13_bias=b13, w2_bias=b2)
        _check(y, ref, torch.float32)


def test_expert_map_skips_experts_of_other_ranks(moe):
    """Expert parallelism: global experts 0-3 on this rank as local 0-3,
    4-7 elsewhere (-1). Tokens routed only to 4-7 get zeros."""
    m, e, topk, h, i = 12, 8, 2, 32, 32
    g = torch.Generator().manual_seed(11)
    x = torch.randn(m, h, generator=g)
    ti = torch.randint(0, e, (m, topk), generator=g, dtype=torch.int32)
    ti[0] = torch.tensor([5, 6], dtype=torch.int32)  # nothing local
    ti[1] = torch.tensor([1, 1 + 4], dtype=torch.int32)  # one local
    tw = torch.rand(m, topk, generator=g)
    w13, w2 = _weights(4, i, h, torch.float32, seed=5)
    expert_map = torch.tensor([0, 1, 2, 3, -1, -1, -1, -1], dtype=torch.int32)
    local = ti < 4
    ref = moe.fused_experts_reference(x, w13, w2, tw * local, torch.where(local, ti, 0))
    y = _run(moe, x, w13, w2, tw, ti, True, expert_map=expert_map)
    _check(y, ref, torch.float32)
    assert torch.count_nonzero(y[0]) == 0


def test_router_weight_on_input_is_not_applied_twice(moe):
    m, e, h, i = 9, 4, 32, 32
    g = torch.Generator().manual_seed(13)
    x = torch.randn(m, h, generator=g)
    tw, ti = _route(torch.randn(m, e, generator=g), 1, "softmax_no_renorm")
    w13, w2 = _weights(e, i, h, torch.float32, seed=9)
    ref = moe.fused_experts_reference(x, w13, w2, torch.ones_like(tw), ti)
    y = _run(moe, x, w13, w2, tw, ti, True, apply_router_weight_on_input=True)
    _check(y, ref, torch.float32)


def test_bad_activation_is_named(moe):
    x = torch.zeros(1, 32)
    w13, w2 = _weights(1, 32, 32, torch.float32, seed=1)
    with pytest.raises(ValueError, match="activation 'relu2'"):
        _run(moe, x, w13, w2, torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32), False,
             activation="relu2")


def test_prepack_env(monkeypatch):
    from cpu_backend.envs import EnvError
    from cpu_backend.ops.moe_layers import prepack_enabled, register_moe

    monkeypatch.delenv("VLLM_CPU_MOE_PREPACK", raising=False)
    assert prepack_enabled() is True  # vLLM's documented default
    monkeypatch.setenv("VLLM_CPU_MOE_PREPACK", "0")
    assert prepack_enabled() is False
    monkeypatch.setenv("VLLM_CPU_MOE_PREPACK", "yes")
    with pytest.raises(EnvError, match="VLLM_CPU_MOE_PREPACK='yes' is invalid"):
        register_moe()


def test_registration_replaces_the_host_method():
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    from cpu_backend.ops.moe_layers import CpuBackendUnquantizedFusedMoEMethod, register_moe

    assert register_moe() == "UnquantizedFusedMoEMethod"
    assert register_moe() == "UnquantizedFusedMoEMethod"  # idempotent
    assert op_registry_oot["UnquantizedFusedMoEMethod"] is CpuBackendUnquantizedFusedMoEMethod
    assert issubclass(CpuBackendUnquantizedFusedMoEMethod, UnquantizedFusedMoEMethod)


def test_torch_op_is_opaque_to_torch_compile(moe):
    """vLLM compiles some models (MLA) with fullgraph=True: the data-dependent
    grouping must be one op with a fake implementation."""
    m, e, h, i = 7, 4, 32, 48
    g = torch.Generator().manual_seed(17)
    x = torch.randn(m, h, generator=g)
    tw, ti = _route(torch.randn(m, e, generator=g), 2, "softmax")
    w13, w2 = _weights(e, i, h, torch.float32, seed=2)
    p13, p2 = moe.prepack_experts(w13, w2)

    def layer(x, tw, ti):
        return torch.ops.cpu_backend.moe_experts(x, p13, p2, tw, ti, 2 * i, h, "silu", True,
                                                 None, None, None, False) * 2

    before = stats.get("moe_experts")
    y = torch.compile(layer, fullgraph=True, dynamic=True)(x, tw, ti)
    _check(y / 2, moe.fused_experts_reference(x, w13, w2, tw, ti), torch.float32)
    assert stats.get("moe_experts") > before


def _w8a8_reference(x, w13q, s13, w2q, s2, tw, ti, symmetric, b13=None, b2=None):
    """int8 W8A8 experts token by token in float64: each GEMM's input rows
    fake-quantized per token (plugin_tests/test_kernels_w8a8.ref_quantize),
    weights q * per-channel scale, act * up rounded to x's dtype as in the op."""
    from plugin_tests.test_kernels_w8a8 import ref_quantize

    def fq(v):
        q, s, z = ref_quantize(v, symmetric=symmetric)
        return (q.double() - z.double()[:, None]) * s.double()[:, None]

    out = torch.zeros(x.shape[0], w2q.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ti.shape[1]):
            e = int(ti[t, j])
            h = fq(x[t:t + 1]) @ (w13q[e].double() * s13[e].double()).T
            if b13 is not None:
                h = h + b13[e].double()
            gate, up = h.to(x.dtype).double().chunk(2, dim=-1)
            a = (gate * torch.sigmoid(gate) * up).to(x.dtype)
            y = fq(a) @ (w2q[e].double() * s2[e].double()).T
            if b2 is not None:
                y = y + b2[e].double()
            out[t] += float(tw[t, j]) * y[0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_w8a8_experts_match_fake_quant_reference(moe, dtype, symmetric, bias):
    """cpu_backend::moe_experts_w8a8 (the W8A8 MoE method's op) on weights in
    the kernel layout the method builds (formats.int8_kernel_layout), sizes off the
    16-column panel and 4-byte k-quad. Bound: max |y - ref| <= 1e-3 R in fp32
    (an activation exactly on a rounding tie may quantize one step apart),
    2.5e-2 R in bf16 (as the unquantized experts)."""
    from cpu_backend.quantization.formats import int8_kernel_layout as kernel_layout

    m, e, topk, h, i = 21, 4, 2, 44, 38
    g = torch.Generator().manual_seed(23 + symmetric)
    x = torch.randn(m, h, generator=g).to(dtype)
    tw, ti = _route(torch.randn(m, e, generator=g), topk, "softmax")
    w13q = torch.randint(-127, 128, (e, 2 * i, h), generator=g, dtype=torch.int8)
    w2q = torch.randint(-127, 128, (e, h, i), generator=g, dtype=torch.int8)
    s13 = torch.rand(e, 2 * i, 1, generator=g) / (127 * h**0.5)
    s2 = torch.rand(e, h, 1, generator=g) / (127 * i**0.5)
    b13 = torch.randn(e, 2 * i, generator=g).to(dtype) if bias else None
    b2 = torch.randn(e, h, generator=g).to(dtype) if bias else None
    p13 = [kernel_layout(w13q[k], s13[k].reshape(-1)) for k in range(e)]
    p2 = [kernel_layout(w2q[k], s2[k].reshape(-1)) for k in range(e)]
    y = torch.ops.cpu_backend.moe_experts_w8a8(
        x, tw, ti, [p["qweight"] for p in p13], [p["wsum"] for p in p13],
        [p["w_scale"] for p in p13], [p["qweight"] for p in p2], [p["wsum"] for p in p2],
        [p["w_scale"] for p in p2], 2 * i, h, symmetric, "silu", b13, b2, None, False)
    ref = _w8a8_reference(x, w13q, s13, w2q, s2, tw, ti, symmetric, b13, b2)
    bound = (1e-3 if dtype == torch.float32 else 2.5e-2) * ref.abs().max().item()
    err = (y.double() - ref).abs().max().item()
    assert y.dtype == dtype and y.shape == (m, h)
    assert err <= bound, f"max |y - ref| {err:.3g} > {bound:.3g}"
