"""KV-cache dtype handlers: one per `--kv-cache-dtype` value we serve.

    handler_for("fp8_e5m2").quantize(...)

The attention backend lists `SUPPORTED` as its KV-cache dtypes; the impl
asks `handler_for(layer.kv_cache_dtype)` how to write and read the cache.
"""

from __future__ import annotations

from cpu_backend.kv_cache import fp8, per_token_head, plain
from cpu_backend.kv_cache.base import KVCacheDtypeHandler

HANDLERS: dict[str, KVCacheDtypeHandler] = {
    h.name: h for module in (plain, fp8, per_token_head) for h in module.HANDLERS
}
SUPPORTED: list[str] = list(HANDLERS)


def handler_for(cache_dtype: str) -> KVCacheDtypeHandler:
    try:
        return HANDLERS[cache_dtype]
    except KeyError:
        raise ValueError(
            f"--kv-cache-dtype {cache_dtype} is not supported by cpu_backend: "
            f"use one of {SUPPORTED}."
        ) from None
