"""RMSNorm on the native kernels (csrc/norm.cpp), as implementations of vLLM's
IR ops `rms_norm` and `fused_add_rms_norm` under the provider name
`cpu_backend`.

Replaces, through the host's IR-op registry (no CustomOp subclassing), the
`native` PyTorch implementations in `vllm/ir/ops/layernorm.py`, which run
5-7 separate eager ops per call. Our platform puts this provider first in
`get_default_ir_op_priority`; arguments it does not cover (`variance_size`,
a weight of another dtype, other strided inputs) fall through to `native`.
Covered beside rows in x's dtype: an fp32 weight with bf16/fp16 x (the host's
`GemmaRMSNorm` passes `weight.float() + 1`, Gemma's `x * (1 + w)` form), and a
[tokens, heads, head_dim] view (Qwen3's and Gemma3's per-head q/k norms, taken
from the fused qkv output); without them those models ran every such norm as
the native ops.
"""

import torch
from torch import Tensor
from vllm import ir

from cpu_backend.ops import load

PROVIDER = "cpu_backend"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _rows_ok(t: torch.Tensor) -> bool:
    return t.dtype in _DTYPES and t.dim() >= 1 and t.stride(-1) == 1 and (
        t.dim() == 2 or t.is_contiguous()
    )


def _heads_ok(t: torch.Tensor) -> bool:
    """[tokens, heads, head_dim] with a contiguous head_dim: the per-head q/k
    norms of Qwen3 and Gemma3 get a view into the fused qkv output."""
    return t.dtype in _DTYPES and t.dim() == 3 and t.stride(-1) == 1


def _weight_ok(x, weight) -> bool:
    return weight is None or weight.dtype in (x.dtype, torch.float32)


def _supports(x, weight, epsilon, variance_size=None) -> bool:
    return variance_size is None and (_rows_ok(x) or _heads_ok(x)) and _weight_ok(x, weight)


def _supports_add(x, x_residual, weight, epsilon, variance_size=None) -> bool:
    return (
        variance_size is None
        and _rows_ok(x)
        and _weight_ok(x, weight)
        and _rows_ok(x_residual)
        and x_residual.shape == x.shape
        and x_residual.dtype == x.dtype
    )


@ir.ops.rms_norm.register_impl(PROVIDER, supports_args=_supports)
def rms_norm(
    x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> Tensor:
    load()
    x2 = x if x.dim() == 3 and not x.is_contiguous() else x.reshape(-1, x.shape[-1])
    out = torch.empty(x2.shape, dtype=x.dtype)
    torch.ops.cpu_backend.rms_norm(out, x2, weight, float(epsilon))
    return out.view(x.shape)


@ir.ops.fused_add_rms_norm.register_impl(PROVIDER, supports_args=_supports_add, inplace=True)
def fused_add_rms_norm(
    x: Tensor,
    x_residual: Tensor,
    weight: Tensor | None,
    epsilon: float,
    variance_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    load()
    torch.ops.cpu_backend.fused_add_rms_norm(
        x.view(-1, x.shape[-1]), x_residual.view(-1, x.shape[-1]), weight, float(epsilon)
    )
    return x, x_residual
