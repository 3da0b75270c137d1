"""Fused MoE experts on our linear kernels: token-grouped expert GEMMs.

    w13p, w2p = prepack_experts(w13, w2)        # once, at weight-load time
    out = fused_experts(x, w13p, w2p, topk_weights, topk_ids,
                        n13=w13.shape[1], n2=w2.shape[1])

`w13` [E, 2I, H] holds each expert's gate rows then up rows (the host's fused
layout), `w2` [E, H, I] the down projections. Routing is done before (the
host's CPU router gives `topk_weights` [M, topk] and `topk_ids` [M, topk]).

For each expert the routed (token, slot) pairs are gathered (one stable sort
by expert id), run through gate/up GEMM -> act(gate) * up -> down GEMM on
`cpu_backend::linear` (packed weights, fp32 accumulation), scaled by the
routing weight and scatter-added into an fp32 output, rounded once to x's
dtype. The work is GEMMs of (tokens routed to e) rows instead of one matrix
vector product per (token, slot).

`prepack_experts` packs each expert like our dense linear layers
(`pack_linear_weight`) and stacks them: [E, ceil(N/NR), K, NR]. Unpacked
weights (`packed=False`, `VLLM_CPU_MOE_PREPACK=0`) run the same grouping with
`torch.nn.functional.linear` on the plain [E, N, K] tensors (no repacking at
load, no second copy while packing).

Pure torch plus our ops: no vLLM import (the host adapter is
`cpu_backend.ops.moe_layers`). `fused_experts_reference` is the float64
per-token reference the tests compare against.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from cpu_backend import stats
from cpu_backend.ops import linear as linear_ops

if TYPE_CHECKING:
    import torch

# Gated activations: act(gate) * up, gate = first half of the w13 output.
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def gated_activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    import torch.nn.functional as F

    gate, up = h.float().chunk(2, dim=-1)
    if activation == "silu":
        act = F.silu(gate)
    elif activation == "gelu":
        act = F.gelu(gate)
    elif activation == "gelu_tanh":
        act = F.gelu(gate, approximate="tanh")
    else:
        raise ValueError(f"cpu_backend MoE: activation {activation!r} is not one of {ACTIVATIONS}")
    return (act * up).to(h.dtype)


def prepack_experts(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert packed panels of both projections, stacked on dim 0."""
    import torch

    return (
        torch.stack([linear_ops.pack_linear_weight(w.contiguous()) for w in w13]),
        torch.stack([linear_ops.pack_linear_weight(w.contiguous()) for w in w2]),
    )


def _gemm(x, weight, n, bias, packed):
    import torch.nn.functional as F

    if packed:
        return linear_ops.linear(x, weight, n, bias)
    return F.linear(x, weight, bias)


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    n13: int,
    n2: int,
    activation: str = "silu",
    packed: bool = True,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for every token t.

    `expert_map` (expert parallelism) maps global ids to local ones, -1 =
    not on this rank (skipped). With `apply_router_weight_on_input` the weights
    were already applied to `x` (the host's prepare step does it), so they are
    not applied again. Writes into `out` when given.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"cpu_backend MoE: activation {activation!r} is not one of {ACTIVATIONS}")

    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        h = _gemm(xe, w13[e], n13, None if w13_bias is None else w13_bias[e], packed)
        return _gemm(gated_activation(h, activation), w2[e], n2,
                     None if w2_bias is None else w2_bias[e], packed)

    return grouped_experts(x, topk_weights, topk_ids, w13.shape[0], n2, expert,
                           expert_map=expert_map,
                           apply_router_weight_on_input=apply_router_weight_on_input, out=out)


def grouped_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    n_out: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
    *,
    expert_map: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The token grouping shared by every weight format: `expert(e, rows)`
    runs local expert e on the rows routed to it ([count, K] -> [count, n_out])."""
    import torch

    m = x.shape[0]
    topk = topk_ids.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    ids = topk_ids.reshape(-1).long()
    if expert_map is not None:
        ids = expert_map.long()[ids]
    order = torch.argsort(ids, stable=True)
    valid = ids >= 0
    counts = torch.bincount(ids[valid], minlength=num_experts).tolist()
    start = int((~valid).sum())  # the -1s sort first
    weights = topk_weights.reshape(-1).float()
    acc = torch.zeros(m, n_out, dtype=torch.float32)
    for e, count in enumerate(counts):
        if count == 0:
            continue
        sel = order[start : start + count]
        start += count
        tokens = torch.div(sel, topk, rounding_mode="floor")
        y = expert(e, x.index_select(0, tokens)).float()
        if not apply_router_weight_on_input:
            y = y * weights.index_select(0, sel).unsqueeze(1)
        acc.index_add_(0, tokens, y)
    if out is None:
        return acc.to(x.dtype)
    out.copy_(acc)
    return out


def fused_experts_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token by token, slot by slot, in float64 from the tensors' own values."""
    import torch
    import torch.nn.functional as F

    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = x[t].double() @ w13[e].double().T
            if w13_bias is not None:
                h = h + w13_bias[e].double()
            gate, up = h.chunk(2)
            if activation == "silu":
                act = gate * torch.sigmoid(gate)
            elif activation == "gelu":
                act = 0.5 * gate * (1 + torch.erf(gate / math.sqrt(2)))
            else:
                act = F.gelu(gate, approximate="tanh")
            y = (act * up) @ w2[e].double().T
            if w2_bias is not None:
                y = y + w2_bias[e].double()
            out[t] += float(topk_weights[t, j]) * y
    return out


# ---------------------------------------------------------------- torch ops ---
# The grouping is data dependent (tokens per expert): under torch.compile
# (vLLM compiles MLA models such as DeepSeek-V2 with fullgraph) it must be one
# opaque op, as the host's `cpu_fused_moe` is. Python custom ops with fake
# (shape-only) implementations.
import torch  # noqa: E402



@torch.library.custom_op("cpu_backend::moe_experts", mutates_args=())
def moe_experts_op(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, n13: int, n2: int, activation: str, packed: bool,
    w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None,
    expert_map: torch.Tensor | None, apply_router_weight_on_input: bool,
) -> torch.Tensor:
    stats.count("moe_experts")
    return fused_experts(x, w13, w2, topk_weights, topk_ids, n13=n13, n2=n2,
                         activation=activation, packed=packed, w13_bias=w13_bias,
                         w2_bias=w2_bias, expert_map=expert_map,
                         apply_router_weight_on_input=apply_router_weight_on_input)


@moe_experts_op.register_fake
def _(x, w13, w2, topk_weights, topk_ids, n13, n2, activation, packed, w13_bias, w2_bias,
      expert_map, apply_router_weight_on_input):
    return x.new_empty((x.shape[0], n2))


@torch.library.custom_op("cpu_backend::moe_experts_wna16", mutates_args=())
def moe_experts_wna16_op(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    qweight13: list[torch.Tensor], scales13: list[torch.Tensor], zs13: list[torch.Tensor],
    perm13: list[torch.Tensor], qweight2: list[torch.Tensor], scales2: list[torch.Tensor],
    zs2: list[torch.Tensor], perm2: list[torch.Tensor], bits: int, group_size13: int,
    group_size2: int, n13: int, n2: int, activation: str, expert_map: torch.Tensor | None,
    apply_router_weight_on_input: bool,
) -> torch.Tensor:
    """Weight-only experts on cpu_backend::wna16_linear; an empty perm = none."""
    stats.count("moe_experts")

    def gemm(xe, q, s, z, p, gs, n):
        return torch.ops.cpu_backend.wna16_linear(xe, q, s, z, bits, gs, n,
                                                  p if p.numel() else None, None)

    def expert(e, xe):
        h = gemm(xe, qweight13[e], scales13[e], zs13[e], perm13[e], group_size13, n13)
        return gemm(gated_activation(h, activation), qweight2[e], scales2[e], zs2[e], perm2[e],
                    group_size2, n2)

    return grouped_experts(x, topk_weights, topk_ids, len(qweight13), n2, expert,
                           expert_map=expert_map,
                           apply_router_weight_on_input=apply_router_weight_on_input)


@moe_experts_wna16_op.register_fake
def _(x, topk_weights, topk_ids, qweight13, scales13, zs13, perm13, qweight2, scales2, zs2,
      perm2, bits, group_size13, group_size2, n13, n2, activation, expert_map,
      apply_router_weight_on_input):
    return x.new_empty((x.shape[0], n2))


@torch.library.custom_op("cpu_backend::moe_experts_w8a8", mutates_args=())
def moe_experts_w8a8_op(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    qweight13: list[torch.Tensor], wsum13: list[torch.Tensor], w_scale13: list[torch.Tensor],
    qweight2: list[torch.Tensor], wsum2: list[torch.Tensor], w_scale2: list[torch.Tensor],
    n13: int, n2: int, input_symmetric: bool, activation: str, w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None, expert_map: torch.Tensor | None,
    apply_router_weight_on_input: bool,
) -> torch.Tensor:
    """int8 W8A8 experts on cpu_backend::w8a8_linear, activations quantized per
    token (dynamic) at each GEMM."""
    stats.count("moe_experts")

    def gemm(xe, q, s, w, n, bias):
        return torch.ops.cpu_backend.w8a8_linear(xe, q, s, w, n, None, None, input_symmetric,
                                                 bias)

    def expert(e, xe):
        h = gemm(xe, qweight13[e], wsum13[e], w_scale13[e], n13,
                 None if w13_bias is None else w13_bias[e])
        return gemm(gated_activation(h, activation), qweight2[e], wsum2[e], w_scale2[e], n2,
                    None if w2_bias is None else w2_bias[e])

    return grouped_experts(x, topk_weights, topk_ids, len(qweight13), n2, expert,
                           expert_map=expert_map,
                           apply_router_weight_on_input=apply_router_weight_on_input)


@moe_experts_w8a8_op.register_fake
def _(x, topk_weights, topk_ids, qweight13, wsum13, w_scale13, qweight2, wsum2, w_scale2, n13,
      n2, input_symmetric, activation, w13_bias, w2_bias, expert_map,
      apply_router_weight_on_input):
    return x.new_empty((x.shape[0], n2))
