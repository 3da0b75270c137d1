"""Independent dequantizers of the real tools' formats, for tests.

Written from the tools' own dequantization code, not from
cpu_backend.quantization.formats: AutoGPTQ's torch path (shift, mask, zeros + 1
for checkpoint_format "gptq") and AutoAWQ's `dequantize_gemm`
(awq/utils/packing_utils.py: unpack, reverse the order map, subtract zeros).
Both return the float64 weight [out_features, in_features].
"""

from __future__ import annotations

import torch


def gptq_dequantize(qweight, qzeros, scales, g_idx, bits, v1=True):
    wf = torch.arange(0, 32, bits, dtype=torch.int64)
    mask = (1 << bits) - 1
    qz = qzeros.to(torch.int64) & 0xFFFFFFFF
    zeros = (qz.unsqueeze(2) >> wf.view(1, 1, -1)) & mask
    zeros = zeros.reshape(qzeros.shape[0], -1)[:, : scales.shape[1]]
    if v1:
        zeros = (zeros + 1) & mask  # v1 stores zero - 1 (GPTQModel's v1 -> v2 rule)
    qw = qweight.to(torch.int64) & 0xFFFFFFFF
    weight = (qw.unsqueeze(1) >> wf.view(1, -1, 1)) & mask  # [K/pf, pf, N]
    weight = weight.reshape(-1, qweight.shape[1])  # [K, N]
    g = g_idx.to(torch.int64)
    w = scales.double()[g] * (weight.double() - zeros.double()[g])
    return w.t().contiguous()


AWQ_REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]


def awq_dequantize(qweight, qzeros, scales, group_size, bits=4):
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    iw = ((qweight.to(torch.int64)[:, :, None] >> shifts[None, None, :]) & 0xF).view(qweight.shape[0], -1)
    iz = ((qzeros.to(torch.int64)[:, :, None] >> shifts[None, None, :]) & 0xF).view(qzeros.shape[0], -1)
    order = torch.arange(iw.shape[-1]).view(-1, 32 // bits)[:, AWQ_REVERSE].reshape(-1)
    iw, iz = iw[:, order], iz[:, order]
    gs = qweight.shape[0] if group_size == -1 else group_size
    iz = torch.repeat_interleave(iz, gs, dim=0)
    sc = torch.repeat_interleave(scales.double(), gs, dim=0)
    return ((iw.double() - iz.double()) * sc).t().contiguous()


def ct_dequantize(weight_packed, weight_scale, weight_zero_point, bits, shape):
    """compressed-tensors pack-quantized, unpacked by the library itself
    (compressed_tensors 0.17 `unpack_from_int32`: signed values), then
    (q - zero_point) * scale per group."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    n, k = shape
    q = unpack_from_int32(weight_packed, bits, torch.Size([n, k]), packed_dim=1).double()
    g = weight_scale.shape[1]
    if weight_zero_point is None:
        zp = torch.zeros(n, g, dtype=torch.float64)
    else:
        zp = unpack_from_int32(weight_zero_point, bits, torch.Size([n, g]), packed_dim=0).double()
    gs = k // g
    zp = torch.repeat_interleave(zp, gs, dim=1)
    sc = torch.repeat_interleave(weight_scale.double(), gs, dim=1)
    return (q - zp) * sc


def int8_activations_per32(x, perm=None):
    """The activations the W4A8 path (wna16_linear's int8_act) multiplies, in
    float64: inputs taken in `perm` order (GPTQ act-order; None = as stored),
    cut into blocks of 32, each quantized to round(x / s) with s = max|x| / 127
    in float32 (1 for an all-zero block), then put back in input order."""
    xf = x.float().reshape(-1, x.shape[-1])
    xp = xf[:, perm] if perm is not None else xf
    blocks = xp.reshape(xp.shape[0], -1, 32)
    s = blocks.abs().amax(-1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    deq = (torch.round(blocks / s).clamp(-127, 127).double() * s.double()).reshape(xp.shape)
    out = torch.empty_like(deq)
    if perm is not None:
        out[:, perm] = deq
    else:
        out = deq
    return out.reshape(x.shape)
