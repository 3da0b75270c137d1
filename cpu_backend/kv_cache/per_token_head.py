"""`int8_per_token_head`, `fp8_per_token_head`: one byte per element and a
scale per (token, kv head), for keys and values separately, computed at
write time (no calibration): s = max|x| / qmax, stored = q(x * (1 / s)).

int8 is symmetric (round half to even, clamp to +-127); fp8 is e4m3fn with
qmax 448. The two fp32 scales follow the row's key and value bytes.
These are vLLM's own dtype names (`--kv-cache-dtype int8_per_token_head`);
the host serves them only on GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from cpu_backend.kv_cache.base import KVCacheDtypeHandler


@dataclass(frozen=True)
class PerTokenHeadHandler(KVCacheDtypeHandler):
    per_row_scales: ClassVar[bool] = True

    @property
    def is_int8(self) -> bool:
        return self.name.startswith("int8")

    @property
    def qmax(self) -> float:
        return 127.0 if self.is_int8 else torch.finfo(torch.float8_e4m3fn).max

    def storage_dtype(self, model_dtype):
        return torch.int8 if self.is_int8 else torch.uint8

    def quantize(self, x, tensor_scale, storage):
        x = x.float()
        scale = x.abs().amax(dim=-1) / self.qmax
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        y = x * inv.unsqueeze(-1)
        if self.is_int8:
            q = torch.round(y).clamp(-127, 127).to(torch.int8)
        else:
            q = y.clamp(-self.qmax, self.qmax).to(torch.float8_e4m3fn).view(torch.uint8)
        return q.view(storage), scale

    def dequantize(self, stored, row_scale, tensor_scale):
        if self.is_int8:
            values = stored.view(torch.int8).float()
        else:
            values = stored.view(torch.uint8).view(torch.float8_e4m3fn).float()
        return values * row_scale.unsqueeze(-1)


HANDLERS = [
    PerTokenHeadHandler("int8_per_token_head", kernel_format=3),
    PerTokenHeadHandler("fp8_per_token_head", kernel_format=4),
]
