"""Linear layer on the native kernels: y = x @ W^T + b.

    packed = pack_linear_weight(w)          # once, at weight-load time
    y = linear(x, packed, w.shape[0], b)    # every forward

`pack_linear_weight` repacks W [N, K] (bf16/fp16/fp32) into column panels
[ceil(N/NR), K, NR] of the same dtype (NR = `pack_nr()`: 32 on avx512, 16 on
avx2/portable), zero padded: element (k, j) of panel p is W[p*NR + j, k]. On
the avx512 and AVX2 builds bf16 panels interleave pairs of K rows (VDPBF16PS;
cheaper widening on AVX2) (`pack_pairs(dtype)`; `unpack_linear_weight` undoes
either layout). A packed
weight belongs to the library that made it. `linear` takes x [..., K] (fp32/bf16/fp16) and returns [..., N] in x's
dtype; it accumulates in fp32 and widens the weights in registers.
Ops: torch.ops.cpu_backend.{pack_linear_weight, linear}, with fake (meta)
implementations so torch.compile can trace them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cpu_backend.ops import load

if TYPE_CHECKING:
    import torch



def pack_nr() -> int:
    """Output features per packed panel in the loaded build."""
    load()
    import torch

    return int(torch.ops.cpu_backend.linear_pack_nr())


def pack_pairs(dtype: torch.dtype) -> bool:
    """Whether the loaded build packs `dtype` with pairs of K rows interleaved."""
    load()
    import torch

    return bool(torch.ops.cpu_backend.linear_pack_pairs(dtype))


def unpack_linear_weight(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The [n, K] weight back from `pack_linear_weight` (pure torch, for tests)."""
    import torch

    p, k, nr = packed.shape
    panels = packed
    if pack_pairs(packed.dtype) and k >= 2:
        k2 = k // 2 * 2
        # [p, k2/2, nr, 2] pair rows -> [p, k2, nr]
        pairs = packed[:, :k2].reshape(p, k2 // 2, nr, 2).permute(0, 1, 3, 2).reshape(p, k2, nr)
        panels = torch.cat([pairs, packed[:, k2:]], dim=1) if k2 < k else pairs
    return panels.permute(0, 2, 1).reshape(p * nr, k)[:n]


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    load()
    import torch

    return torch.ops.cpu_backend.pack_linear_weight(weight)


def linear(
    x: torch.Tensor,
    packed_weight: torch.Tensor,
    n: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x @ W^T + bias; the result has x's dtype unless out_dtype is given."""
    load()
    import torch

    return torch.ops.cpu_backend.linear(x, packed_weight, n, bias, out_dtype)


def linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight^T + bias in float64 from the tensors' own (rounded) values."""
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    return y
