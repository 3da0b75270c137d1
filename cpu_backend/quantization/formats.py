"""GPTQ and AWQ checkpoint tensors <-> integer weights, in pure torch.

Integer view used everywhere here (for one linear layer, K inputs, N outputs):
    q [N, K] int (0 .. 2^bits-1), zero [N, G] int, scale [N, G] float,
    g_idx [K] int (group of input k; k // group_size without act-order),
    weight[n, k] = (q[n, k] - zero[n, g_idx[k]]) * scale[n, g_idx[k]].

GPTQ (AutoGPTQ / GPTQModel, checkpoint_format "gptq", i.e. v1):
    qweight [K/pf, N] int32, pf = 32/bits values packed along K, value j of a
        word in bits [bits*j, bits*(j+1));
    qzeros [G, N/pf] int32 packed along N, storing zero - 1 (the v1 off-by-one;
        "gptq_v2" stores zero itself), wrapped to `bits` bits;
    scales [G, N] float16; g_idx [K] int32.
AWQ (AutoAWQ "GEMM" version, 4-bit only):
    qweight [K, N/8] int32 packed along N in the order AWQ_PACK_ORDER
        (nibble i of word c holds column 8c + AWQ_PACK_ORDER[i]);
    qzeros [G, N/8] int32, same packing, zero itself; scales [G, N] float16.

`quantize_rtn` makes the integer view by round-to-nearest; the kernel layout
for cpu_backend::wna16_linear is made by `kernel_layout`, the one for
cpu_backend::w8a8_linear (int8 weights, per-channel scales) by
`int8_kernel_layout`.
"""

from __future__ import annotations

import torch

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# nibble i of a packed AWQ word -> column offset AWQ_PACK_ORDER[i]; unpacking
# takes column c from nibble AWQ_REVERSE_ORDER[c].
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
KERNEL_NR = 16  # output columns per panel in csrc/linear_wna16.cpp
W8A8_KERNEL_NR = 16  # output columns per panel in csrc/linear_w8a8.cpp
A8_INPUTS = 32  # inputs per int8 activation scale of its W4A8 path (int8_act)


def _shifts(bits: int) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int64)


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned `bits`-bit values (any int dtype) along `dim` into int32."""
    pf = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    assert v.shape[-1] % pf == 0, f"size {v.shape[-1]} is not a multiple of {pf}"
    v = (v & ((1 << bits) - 1)).reshape(*v.shape[:-1], -1, pf)
    words = (v << _shifts(bits)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of pack_int32: int32 words -> unsigned values (int32), `dim` grown by 32/bits."""
    w = words.to(torch.int64).movedim(dim, -1) & 0xFFFFFFFF
    v = (w.unsqueeze(-1) >> _shifts(bits)) & ((1 << bits) - 1)
    v = v.reshape(*w.shape[:-1], -1)
    return v.movedim(-1, dim).to(torch.int32).contiguous()


# ------------------------------------------------------------------ RTN ---


def quantize_rtn(
    weight: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool,
    perm: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Round-to-nearest quantization of weight [N, K] (min/max per group).

    group_size -1: one group per output row. `perm` (act-order): inputs are
    grouped in the order perm (the first group_size of perm form group 0, ...).
    Returns q [N, K], zero [N, G], scale [N, G] (float32), g_idx [K].
    sym: zero = 2^(bits-1) and scale = max|w| / (2^(bits-1) - 1/2) rounded
    the way GPTQ does it (scale = 2 max|w| / maxq).
    """
    w = weight.float()
    n, k = w.shape
    gs = k if group_size == -1 else group_size
    if k % gs:
        raise ValueError(f"group_size={group_size} does not divide in_features={k}")
    order = torch.arange(k) if perm is None else perm.to(torch.int64)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // gs).to(torch.int32)
    wg = w[:, order].reshape(n, k // gs, gs)
    maxq = (1 << bits) - 1
    wmin = wg.amin(-1).clamp(max=0)
    wmax = wg.amax(-1).clamp(min=0)
    if sym:
        amax = torch.maximum(wmin.abs(), wmax)
        scale = 2 * amax / maxq
        zero = torch.full_like(scale, float((maxq + 1) // 2))
    else:
        scale = (wmax - wmin) / maxq
        zero = torch.round(-wmin / torch.where(scale == 0, 1.0, scale))
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    # the checkpoint stores scales as fp16: quantize against that value
    scale = scale.half().float()
    q = torch.clamp(torch.round(wg / scale.unsqueeze(-1)) + zero.unsqueeze(-1), 0, maxq)
    q_sorted = q.reshape(n, k).to(torch.int32)
    q_out = torch.empty_like(q_sorted)
    q_out[:, order] = q_sorted
    return {"q": q_out, "zero": zero.to(torch.int32), "scale": scale, "g_idx": g_idx}


def dequantize(q, zero, scale, g_idx) -> torch.Tensor:
    """The float32 weight [N, K] of the integer view."""
    gi = g_idx.to(torch.int64)
    return (q.float() - zero.float()[:, gi]) * scale.float()[:, gi]


# ----------------------------------------------------------------- GPTQ ---


def gptq_pack(q, zero, scale, g_idx, bits: int, checkpoint_format: str = "gptq") -> dict:
    """Integer view -> GPTQ tensors (qweight, qzeros, scales, g_idx)."""
    zstore = zero - 1 if checkpoint_format == "gptq" else zero
    return {
        "qweight": pack_int32(q.t(), bits, dim=0),
        "qzeros": pack_int32(zstore.t(), bits, dim=1),
        "scales": scale.t().contiguous().half(),
        "g_idx": g_idx.to(torch.int32).contiguous(),
    }


def gptq_unpack(qweight, qzeros, scales, g_idx, bits: int, checkpoint_format: str = "gptq") -> dict:
    """GPTQ tensors -> integer view (q [N, K], zero [N, G], scale [N, G], g_idx)."""
    q = unpack_int32(qweight, bits, dim=0).t().contiguous()
    z = unpack_int32(qzeros, bits, dim=1)[:, : scales.shape[1]]
    if checkpoint_format == "gptq":
        z = (z + 1) & ((1 << bits) - 1)
    return {"q": q, "zero": z.t().contiguous(), "scale": scales.t().float().contiguous(),
            "g_idx": g_idx.to(torch.int32)}


# ------------------------------------------------------------------ AWQ ---


def _awq_interleave(cols: torch.Tensor, order) -> torch.Tensor:
    k, n = cols.shape
    return cols.reshape(k, n // 8, 8)[:, :, list(order)].reshape(k, n)


def awq_pack(q, zero, scale, bits: int = 4) -> dict:
    """Integer view -> AutoAWQ GEMM tensors (qweight, qzeros, scales)."""
    assert bits == 4
    return {
        "qweight": pack_int32(_awq_interleave(q.t(), AWQ_PACK_ORDER), bits, dim=1),
        "qzeros": pack_int32(_awq_interleave(zero.t(), AWQ_PACK_ORDER), bits, dim=1),
        "scales": scale.t().contiguous().half(),
    }


def awq_unpack(qweight, qzeros, scales, bits: int = 4) -> dict:
    """AutoAWQ GEMM tensors -> integer view (g_idx is k // group_size)."""
    q = _awq_interleave(unpack_int32(qweight, bits, dim=1), AWQ_REVERSE_ORDER)
    z = _awq_interleave(unpack_int32(qzeros, bits, dim=1), AWQ_REVERSE_ORDER)
    k, g = q.shape[0], scales.shape[0]
    g_idx = (torch.arange(k) // (k // g)).to(torch.int32)
    return {"q": q.t().contiguous(), "zero": z.t().contiguous(),
            "scale": scales.t().float().contiguous(), "g_idx": g_idx}


# ---------------------------------------------------- compressed-tensors ---


def ct_pack(q, zero, scale, bits: int, sym: bool, dtype=torch.bfloat16) -> dict:
    """Integer view -> compressed-tensors pack-quantized tensors. The library
    stores signed values q - 2^(bits-1) re-offset by +2^(bits-1), i.e. our
    unsigned q; the zero point likewise (absent when symmetric)."""
    n, k = q.shape
    out = {
        "weight_packed": pack_int32(q, bits, dim=1),
        "weight_scale": scale.to(dtype).contiguous(),
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
    if not sym:
        out["weight_zero_point"] = pack_int32(zero, bits, dim=0)
    return out


def ct_unpack(weight_packed, weight_scale, weight_zero_point, bits: int) -> dict:
    """compressed-tensors pack-quantized tensors -> integer view."""
    q = unpack_int32(weight_packed, bits, dim=1)
    n, g = weight_scale.shape
    if weight_zero_point is None:
        zero = torch.full((n, g), 1 << (bits - 1), dtype=torch.int32)
    else:
        zero = unpack_int32(weight_zero_point, bits, dim=0)[:n]
    k = q.shape[1]
    return {"q": q, "zero": zero, "scale": weight_scale.float(),
            "g_idx": (torch.arange(k) // (k // g)).to(torch.int32)}


# --------------------------------------------------------- kernel layout ---


def kernel_layout(q, zero, scale, g_idx, bits: int, drop_symmetric_zs: bool = False,
                  zs: torch.Tensor | None = None) -> dict:
    """Integer view -> the operands of cpu_backend::wna16_linear.

    Returns qweight [P, B, 64] uint8, scales / zs [P, G, 16] float32,
    group_size, and perm [K] int64 or None (None when g_idx is k // group_size).
    With drop_symmetric_zs and every zero 2^(bits-1), zs is empty instead: the
    kernel derives -2^(bits-1) * scale itself (the same fp32 values), and each
    decode step reads 4 bytes per group and column fewer.
    Panel p holds output columns 16p .. 16p+15 (columns >= N are zero, scale 0).
    Its inputs, sorted by group, are cut into words of KW = 32 / bits
    consecutive inputs (each group padded with zero weights to a multiple of
    KW); block b is 16 little-endian 32-bit words, word c = sum over i < KW of
    q[16p + c, KW*b + i] << (bits*i). One 64-byte load thus gives KW inputs of
    16 columns, and the kernel takes field i out with one AND (or one shift).
    `zs` [N, G] (optional) gives the zero term itself, for formats whose
    weight is q * scale + min with a float min (GGUF's Q4_1, Q4_K, ...);
    `zero` is then ignored.
    bits=6 (q below 64, GGUF's 5- and 6-bit types) is the 8-bit layout whose
    symmetric zero is 32; wna16_linear runs it with int8 activations too.
    Raises ValueError when the groups of g_idx are not all the same size.
    """
    n, k = q.shape
    g = scale.shape[1]
    gi = g_idx.to(torch.int64)
    counts = torch.bincount(gi, minlength=g)
    if g == 0 or k % g or not bool((counts == k // g).all()):
        raise ValueError("g_idx: every group must hold in_features / num_groups inputs")
    gs = k // g
    perm = torch.sort(gi, stable=True).indices
    identity = bool((perm == torch.arange(k)).all())
    qs = (q if identity else q[:, perm]).to(torch.uint8)
    field = 8 if bits == 6 else bits  # bits=6: values below 64 in 8-bit fields
    kw = 32 // field
    gsp = -(-gs // kw) * kw  # group padded to whole words
    p = -(-n // KERNEL_NR)
    pad = p * KERNEL_NR - n
    qs = qs.reshape(n, g, gs)
    qs = torch.nn.functional.pad(qs, (0, gsp - gs, 0, 0, 0, pad))  # [P*16, G, gsp]
    words = qs.reshape(p * KERNEL_NR, g * gsp // kw, 4, 8 // field)  # [.., B, byte, field in byte]
    if bits == 4:
        words = words[..., 0] | (words[..., 1] << 4)
    else:
        words = words[..., 0]
    blocks = words.reshape(p, KERNEL_NR, -1, 4).permute(0, 2, 1, 3)  # [P, B, 16, 4]
    s = torch.nn.functional.pad(scale.float(), (0, 0, 0, pad))
    if zs is None and drop_symmetric_zs and bool((zero == 1 << (bits - 1)).all()):
        zs = torch.empty(0, dtype=torch.float32)
    else:
        zs = -zero.float() * scale.float() if zs is None else zs.float()
        zs = torch.nn.functional.pad(zs, (0, 0, 0, pad))
        zs = zs.reshape(p, KERNEL_NR, g).permute(0, 2, 1).contiguous()
    return {
        "qweight": blocks.reshape(p, -1, 64).contiguous(),
        "scales": s.reshape(p, KERNEL_NR, g).permute(0, 2, 1).contiguous(),
        "zs": zs,
        "group_size": gs,
        "perm": None if identity else perm.contiguous(),
    }


def kernel_rows(qweight, scales, zs, bits: int, group_size: int, rows: torch.Tensor) -> torch.Tensor:
    """float32 [len(rows), K]: output rows (weight rows n) of a kernel_layout
    without act-order (perm None), dequantized as kernel_layout's input gave
    them: (q - 2^(bits-1)) * scale with an empty zs, else q * scale + zs.
    An embedding lookup on a quantized, tied LM head reads its rows this way,
    so one copy of the matrix serves both."""
    p_count, blocks_, _ = qweight.shape
    g = scales.shape[1]
    p, c = rows // KERNEL_NR, rows % KERNEL_NR
    words = qweight.reshape(p_count, blocks_, KERNEL_NR, 4)[p, :, c]  # [R, B, 4] bytes
    if bits == 4:
        words = torch.stack((words & 0x0F, words >> 4), dim=-1)
    q = words.reshape(len(rows), g, -1)[..., :group_size].float()  # drop group padding
    s = scales[p, :, c].unsqueeze(-1)
    if zs.numel() == 0:
        w = (q - (1 << (bits - 1))) * s
    else:
        w = q * s + zs[p, :, c].unsqueeze(-1)
    return w.reshape(len(rows), g * group_size)


def int8_kernel_layout(weight: torch.Tensor, w_scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """int8 weight [N, K] and per-channel scale [N] -> the kernel's operands:
    qweight [ceil(N/16), ceil(K/4), 64] int8 (panel p, k-quad k4: column j's
    weights for k = 4 k4 .. 4 k4 + 3 at bytes 4j .. 4j+3; padding zero),
    wsum [16 P] int32 (sum over k of each column), w_scale [16 P] fp32."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(f"W8A8 weight must be int8 [N, K], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    p, k4 = -(-n // W8A8_KERNEL_NR), -(-k // 4)
    w = torch.zeros(p * W8A8_KERNEL_NR, k4 * 4, dtype=torch.int8)
    w[:n, :k] = weight
    qweight = w.view(p, W8A8_KERNEL_NR, k4, 4).permute(0, 2, 1, 3).reshape(p, k4, 4 * W8A8_KERNEL_NR)
    scale = torch.zeros(p * W8A8_KERNEL_NR, dtype=torch.float32)
    scale[:n] = w_scale.reshape(-1).float()
    return {"qweight": qweight.contiguous(), "wsum": w.sum(1, dtype=torch.int32),
            "w_scale": scale, "n": n}
