"""`fp8_e5m2`, `fp8_e4m3` (and `fp8`, vLLM's alias of e4m3): one byte per
element with the layer's per-tensor `k_scale` / `v_scale` (1.0 unless the
checkpoint provides scales).

stored = fp8(clamp(x / scale, +-max)), saturating where vLLM's CUDA cache
write would overflow to inf/NaN; e4m3 is the OCP `float8_e4m3fn` variant.
vLLM allocates these caches as uint8; the bytes are fp8 bit patterns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from cpu_backend.kv_cache.base import KVCacheDtypeHandler

FP8_DTYPES = {"fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass(frozen=True)
class Fp8PerTensorHandler(KVCacheDtypeHandler):
    fp8: str = "fp8_e4m3"
    per_tensor_scale: ClassVar[bool] = True

    @property
    def fp8_dtype(self) -> torch.dtype:
        return FP8_DTYPES[self.fp8]

    def storage_dtype(self, model_dtype):
        return torch.uint8

    def quantize(self, x, tensor_scale, storage):
        limit = torch.finfo(self.fp8_dtype).max
        q = (x.float() / tensor_scale).clamp(-limit, limit).to(self.fp8_dtype)
        return q.view(torch.uint8).view(storage), None

    def dequantize(self, stored, row_scale, tensor_scale):
        return stored.view(torch.uint8).view(self.fp8_dtype).float() * tensor_scale


HANDLERS = [
    Fp8PerTensorHandler("fp8_e5m2", kernel_format=1, fp8="fp8_e5m2"),
    Fp8PerTensorHandler("fp8_e4m3", kernel_format=2, fp8="fp8_e4m3"),
    Fp8PerTensorHandler("fp8", kernel_format=2, fp8="fp8_e4m3"),
]
