"""RMSNorm on the native kernels (csrc/norm.cpp), as implementations of vLLM's
IR ops `rms_norm` and `fused_add_rms_norm` under the provider name
`cpu_backend`.

Replaces, through the host's IR-op registry (no CustomOp subclassing), the
`native` PyTorch implementations in `vllm/ir/ops/layernorm.py`, which run
5-7 separate eager ops per call. Our platform puts this provider first in
`get_default_ir_op_priority`; arguments it does not cover (`variance_size`,
a weight of another dtype, non-row-contiguous input) fall through to `native`.
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


def _supports(x, weight, epsilon, variance_size=None) -> bool:
    return variance_size is None and _rows_ok(x) and (weight is None or weight.dtype == x.dtype)


def _supports_add(x, x_residual, weight, epsilon, variance_size=None) -> bool:
    return (
        _supports(x, weight, epsilon, variance_size)
        and _rows_ok(x_residual)
        and x_residual.shape == x.shape
        and x_residual.dtype == x.dtype
    )


@ir.ops.rms_norm.register_impl(PROVIDER, supports_args=_supports)
def rms_norm(
    x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> Tensor:
    load()
    x2 = x.reshape(-1, x.shape[-1])
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
