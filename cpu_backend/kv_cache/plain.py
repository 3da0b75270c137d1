"""`auto`, `bfloat16`, `float16`: the cache holds floats, no scales.

`auto` stores the model's dtype (the native kernels' fast path); a named
float dtype different from the model's runs on the PyTorch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpu_backend.kv_cache.base import KVCacheDtypeHandler

_NAMED = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PlainHandler(KVCacheDtypeHandler):
    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return _NAMED.get(self.name, model_dtype)

    def quantize(self, x, tensor_scale, storage):
        return x.to(storage), None

    def dequantize(self, stored, row_scale, tensor_scale):
        return stored


HANDLERS = [PlainHandler("auto"), PlainHandler("bfloat16"), PlainHandler("float16")]
