"""The interface every KV-cache dtype handler implements.

A handler says how one (token, kv head) row of the paged cache stores a key
and a value: the element dtype, whether each row carries its own scales
(kept as two fp32 after the row's `2 * head_size` elements) or the layer's
per-tensor `k_scale`/`v_scale` apply, how to quantize (cache write) and
dequantize (reads), and which native-kernel format code serves it
(csrc/kv_format.h). The quantize/dequantize methods here are the reference
the native kernels (csrc/kv_cache.cpp, csrc/attention.cpp) are tested
against, and the PyTorch fallback path's implementation.

Adding a format (e.g. int4) is one new module with a handler subclass,
registered in `cpu_backend.kv_cache.HANDLERS`, plus its kernel format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

SCALE_BYTES = 8  # per-row formats: fp32 key scale, fp32 value scale


@dataclass(frozen=True)
class KVCacheDtypeHandler:
    """Base: the cache stores the model's (or a named) float dtype as is."""

    name: str  # the --kv-cache-dtype value
    kernel_format: int = 0  # csrc/kv_format.h KvFormat
    per_row_scales: ClassVar[bool] = False
    per_tensor_scale: ClassVar[bool] = False

    @property
    def quantized(self) -> bool:
        return self.per_row_scales or self.per_tensor_scale

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The cache tensor's dtype (what vLLM allocates for this name)."""
        raise NotImplementedError

    def row_elems(self, head_size: int) -> int:
        """Elements per (token, kv head) row: key, value, then scales."""
        return 2 * head_size + (SCALE_BYTES if self.per_row_scales else 0)

    def quantize(
        self, x: torch.Tensor, tensor_scale: float, storage: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`x [..., D]` -> (stored `[..., D]` in `storage`, per-row scales
        `[...]` float32 or None)."""
        raise NotImplementedError

    def dequantize(
        self, stored: torch.Tensor, row_scale: torch.Tensor | None, tensor_scale: float
    ) -> torch.Tensor:
        """Inverse of `quantize`, in float32 (float formats: unchanged)."""
        raise NotImplementedError
