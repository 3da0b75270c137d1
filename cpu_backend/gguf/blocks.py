"""GGUF block types -> the integer view our weight-only kernel runs.

Each GGUF block type stores a row of K weights as K / block_elems blocks of
block_bytes bytes. Every type we load is, group by group, an affine map of
small unsigned integers, so it becomes the integer view of
`cpu_backend.quantization.formats` without rounding anything:

    weight = (q - zero) * scale      (zero-point types: zero is one integer)
    weight = q * scale + min         (Q4_1, Q5_1, Q4_K, Q5_K: a float min)

with q stored in 4 bits (Q4_0, Q4_1, Q4_K), as "6 bits" (the 5- and 6-bit
types: values below 64 in 8-bit fields, which the kernel multiplies with
int8 activations too; Q5_0 shifted so that its zero is 32, the kernel's
symmetric case, which needs no zero term in memory) or 8 bits (Q8_0, zero
128). Scales and mins are the
float32 products llama.cpp's `dequantize_row_*` forms (d * sc, dmin * m), so
`dequantize(view)` equals the reference dequantization bit for bit
(plugin_tests/test_gguf_blocks.py checks it against the `gguf` package's
numpy dequantizers). Everything here is vectorised torch on uint8 tensors
shaped [rows, blocks, block_bytes].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK_K = 256  # elements of a K-quant super-block


@dataclass(frozen=True)
class BlockType:
    name: str
    block_elems: int
    block_bytes: int
    bits: int  # the kernel's bits for q: 4, 6 (values below 64 in 8-bit fields) or 8
    group_size: int  # inputs per scale


# GGML type ids (ggml.h) of what we load; the float types stay as they are.
QUANTIZED = {
    2: BlockType("Q4_0", 32, 18, 4, 32),
    3: BlockType("Q4_1", 32, 20, 4, 32),
    6: BlockType("Q5_0", 32, 22, 6, 32),
    7: BlockType("Q5_1", 32, 24, 6, 32),
    8: BlockType("Q8_0", 32, 34, 8, 32),
    12: BlockType("Q4_K", QK_K, 144, 4, 32),
    13: BlockType("Q5_K", QK_K, 176, 6, 32),
    14: BlockType("Q6_K", QK_K, 210, 6, 16),
}
FLOAT = {0: ("F32", torch.float32), 1: ("F16", torch.float16), 30: ("BF16", torch.bfloat16)}
BY_BLOCK_BYTES = {t.block_bytes: t for t in QUANTIZED.values()}  # all distinct
BY_NAME = {t.name: t for t in QUANTIZED.values()}


def supported_type_names() -> list[str]:
    return [t.name for t in QUANTIZED.values()] + [name for name, _ in FLOAT.values()]


@dataclass
class IntView:
    """weight[n, k] = (q - zero) * scale[n, k // group_size], or
    q * scale + min when `min` is given."""

    q: torch.Tensor  # [N, K] uint8
    scale: torch.Tensor  # [N, G] float32
    bits: int
    group_size: int
    zero: int | None = None
    min: torch.Tensor | None = None  # [N, G] float32

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        g = self.scale.shape[1]
        q = self.q.float().reshape(n, g, k // g)
        s = self.scale.unsqueeze(-1)
        w = (q - self.zero) * s if self.min is None else q * s + self.min.unsqueeze(-1)
        return w.reshape(n, k)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 (little-endian half) -> [...] float32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: the n low nibbles, then the n high ones."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _high_bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """[..., 4] bytes of a little-endian uint32 -> [..., count] of its bits 0..count-1."""
    word = qh.contiguous().view(torch.int32)  # [..., 1]
    return ((word >> torch.arange(count, dtype=torch.int32)) & 1).to(torch.uint8)


def _k4_scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins packed in 12 bytes (get_scale_min_k4)."""
    lo = s[..., 0:4]
    mid = s[..., 4:8]
    hi = s[..., 8:12]
    sc = torch.cat((lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)), dim=-1)
    m = torch.cat((mid & 63, (hi >> 4) | ((mid >> 6) << 4)), dim=-1)
    return sc.float(), m.float()


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1)


def _q4_0(b):
    d = _f16(b[..., 0:2])
    return IntView(_flat(_nibbles(b[..., 2:18])), d, 4, 32, zero=8)


def _q4_1(b):
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    return IntView(_flat(_nibbles(b[..., 4:20])), d, 4, 32, min=m)


def _q5(qh, qs):
    return _nibbles(qs) | (_high_bits(qh, 32) << 4)


def _q5_0(b):
    d = _f16(b[..., 0:2])
    q = _q5(b[..., 2:6], b[..., 6:22]) + 16  # (q5 - 16) = (q5 + 16) - 32
    return IntView(_flat(q), d, 6, 32, zero=32)


def _q5_1(b):
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    return IntView(_flat(_q5(b[..., 4:8], b[..., 8:24])), d, 6, 32, min=m)


def _q8_0(b):
    d = _f16(b[..., 0:2])
    q = (b[..., 2:34].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    return IntView(_flat(q), d, 8, 32, zero=128)


def _k_scales(b):
    """d * sc and -(dmin * m) per 32 inputs of a Q4_K / Q5_K block."""
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _k4_scales_mins(b[..., 4:16])
    return _flat(d.unsqueeze(-1) * sc), _flat(-(dmin.unsqueeze(-1) * m))


def _q4_k(b):
    scale, mn = _k_scales(b)
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 32)  # 4 chunks of 64 inputs
    return IntView(_flat(_nibbles(qs)), scale, 4, 32, min=mn)


def _q5_k(b):
    scale, mn = _k_scales(b)
    qh = b[..., 16:48].unsqueeze(-2)  # [.., 1, 32]: bit 2c / 2c+1 for chunk c
    qs = b[..., 48:176].reshape(*b.shape[:-1], 4, 32)
    shifts = torch.arange(8, dtype=torch.uint8).reshape(4, 2, 1)
    high = ((qh.unsqueeze(-2) >> shifts) & 1).reshape(*b.shape[:-1], 4, 64)
    return IntView(_flat(_nibbles(qs) | (high << 4)), scale, 6, 32, min=mn)


def _q6_k(b):
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 64)
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32)
    sc = b[..., 192:208].view(torch.int8).float()
    d = _f16(b[..., 208:210])
    low = _nibbles(ql)  # [.., 2, 128]
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)) & 3
    q = low | (high.reshape(*b.shape[:-1], 2, 128) << 4)  # q6 in 0..63
    return IntView(_flat(q), _flat(d.unsqueeze(-1) * sc), 6, 16, zero=32)


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
             "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def block_type_of(raw: torch.Tensor) -> BlockType:
    """The type of raw blocks [rows, blocks, block_bytes] (block sizes are all distinct)."""
    if raw.dim() != 3 or raw.dtype != torch.uint8 or raw.shape[-1] not in BY_BLOCK_BYTES:
        raise ValueError(f"not GGUF blocks: {tuple(raw.shape)} {raw.dtype}")
    return BY_BLOCK_BYTES[raw.shape[-1]]


def decode(raw: torch.Tensor) -> IntView:
    """Raw blocks [rows, blocks, block_bytes] uint8 -> IntView of [rows, blocks * block_elems]."""
    return _DECODERS[block_type_of(raw).name](raw)


def dequantize(raw: torch.Tensor) -> torch.Tensor:
    """float32 [rows, K] exactly as llama.cpp's dequantize_row_* gives it."""
    return decode(raw).dequantize()
