"""Quantized KV-cache dtypes: the handlers of `cpu_backend.kv_cache` (the
reference) and the native write / attention kernels reading them, per ISA.

Checked, for fp8_e5m2 and fp8_e4m3 (per-tensor scale 0.5), int8_per_token_head
and fp8_per_token_head, with fp32/bf16/fp16 models:
- the reference quantizer's error bound (int8: |err| <= scale/2 per row;
  fp8: relative error <= 2^-3 (e5m2) / 2^-4 (e4m3) above the subnormal range);
- native KV write: bytes identical to the reference write (padding skipped);
- native attention over a quantized cache equals the PyTorch path reading the
  same bytes (tolerances as for float caches: fp32 2e-5, bf16 1.6e-2,
  fp16 2e-3; both compute in fp32 and differ in summation order only;
  except int8_per_token_head in fp32, 1e-4: the native decode path scores
  int8 keys against the query rounded to int16, a relative error of
  1.5e-5 of the query's largest element, ~60x below the keys' own int8
  rounding, and sums int8 values under weights rounded to int16 per chunk
  (error <= 1.5e-5 of the chunk's largest); measured worst 6.3e-5, with the
  outlier channel below);
- the vector decoders: every non-NaN byte value decodes exactly as torch's
  float8/int8 -> float32 (a one-key attention returns its value row).
"""

from __future__ import annotations

import json
import sys

import pytest

try:
    from plugin_tests.isa_worker import ISA_PATHS, run_worker
except ImportError:  # run as the worker script
    ISA_PATHS, run_worker = [], None

QUANTIZED = ["fp8_e5m2", "fp8_e4m3", "int8_per_token_head", "fp8_per_token_head"]
TOL = {"float32": 2e-5, "bfloat16": 1.6e-2, "float16": 2e-3}
TOL_INT16_QUERY = {**TOL, "float32": 1e-4}  # int8_per_token_head (see above)
# head_size, num_heads, num_kv_heads, block_size
SHAPES = [(64, 9, 3, 64), (80, 8, 1, 16), (128, 16, 2, 16), (256, 4, 1, 32)]
TENSOR_SCALE = 0.5


def _cache(handler, num_blocks, num_kv_heads, block_size, head_size, model_dtype):
    import torch

    storage = handler.storage_dtype(model_dtype)
    return torch.zeros(num_blocks, num_kv_heads, block_size, handler.row_elems(head_size), dtype=storage)


def _attention_failures(handler, gen) -> tuple[list[str], dict]:
    import torch

    from cpu_backend.attention import paged_torch
    from cpu_backend.ops import attention as native

    failures, worst = [], {}
    for head_size, num_heads, num_kv_heads, block_size in SHAPES:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            # decodes over 1, 2 blocks + 2 and 8 blocks + 7 keys (the last chunk of 16 odd);
            # the last: a chunk over a cached prefix spanning several query blocks
            reqs = [(0, 13), (block_size + 3, 5), (2 * block_size + 1, 1), (0, 1), (8 * block_size + 6, 1), (21, 40)]
            num_blocks = sum(-(-(c + n) // block_size) for c, n in reqs) + 2
            kv_cache = _cache(handler, num_blocks, num_kv_heads, block_size, head_size, dtype)
            native_cache = kv_cache.clone()
            perm = torch.randperm(num_blocks, generator=gen).tolist()
            block_table = torch.zeros(len(reqs), 12, dtype=torch.int32)
            slots = []
            for r, (c, n) in enumerate(reqs):
                ids = [perm.pop() for _ in range(-(-(c + n) // block_size))]
                block_table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
                slots += [ids[p // block_size] * block_size + p % block_size for p in range(c + n)]
            # keys with an outlier channel, as real models have
            keys = torch.randn(len(slots), num_kv_heads, head_size, generator=gen)
            keys[..., 3] *= 8
            values = torch.randn(len(slots), num_kv_heads, head_size, generator=gen)
            keys, values = keys.to(dtype), values.to(dtype)
            slot_mapping = torch.tensor(slots)
            pad = torch.tensor([-1])
            paged_torch.write_kv(keys, values, kv_cache, slot_mapping, handler, TENSOR_SCALE, TENSOR_SCALE)
            native.write_kv_cache(
                torch.cat([keys, keys[:1]]), torch.cat([values, values[:1]]), native_cache,
                torch.cat([slot_mapping, pad]), handler.kernel_format, TENSOR_SCALE, TENSOR_SCALE,
            )
            if not torch.equal(kv_cache.view(torch.uint8), native_cache.view(torch.uint8)):
                differing = int((kv_cache.view(torch.uint8) != native_cache.view(torch.uint8)).sum())
                failures.append(f"write {handler.name} {dtype} hs{head_size}: {differing} bytes differ")

            total = sum(n for _, n in reqs)
            query = torch.randn(total, num_heads, head_size, generator=gen).to(dtype)
            token_req = torch.cat([torch.full((n,), r, dtype=torch.int32) for r, (_, n) in enumerate(reqs)])
            token_pos = torch.cat([torch.arange(c, c + n, dtype=torch.int32) for c, n in reqs])
            for variant in ({}, {"window": 7}, {"softcap": 5.0}):
                params = paged_torch.AttentionParams(
                    scale=head_size**-0.5, sliding_window=variant.get("window"), softcap=variant.get("softcap")
                )
                out = torch.empty_like(query)
                native.paged_attention(
                    out, query, kv_cache, block_table, token_req, token_pos, params.scale,
                    variant.get("window"), variant.get("softcap"), None,
                    handler.kernel_format, TENSOR_SCALE, TENSOR_SCALE,
                )
                key_src, value_src = paged_torch.kv_sources(
                    kv_cache, head_size, handler, TENSOR_SCALE, TENSOR_SCALE
                )
                start = 0
                for r, (c, n) in enumerate(reqs):
                    ids = block_table[r, : -(-(c + n) // block_size)]
                    k = paged_torch.gather_kv(key_src, ids, c + n)
                    v = paged_torch.gather_kv(value_src, ids, c + n)
                    ref = paged_torch.prefill(query[start : start + n].float(), k.float(), v.float(), c, params)
                    err = float((out[start : start + n].float() - ref).abs().max())
                    name = str(dtype).removeprefix("torch.")
                    worst[name] = max(worst.get(name, 0.0), err)
                    tol = (TOL_INT16_QUERY if handler.name == "int8_per_token_head" else TOL)[name]
                    if not err <= tol:
                        failures.append(
                            f"attention {handler.name} hs{head_size}/{num_heads}/{num_kv_heads} {name} "
                            f"{variant} req{r}: {err:.3g}"
                        )
                    start += n
    return failures, worst


def _decode_failures(handler) -> list[str]:
    """One key per request: attention returns that token's value row, decoded."""
    import torch

    from cpu_backend.ops import attention as native

    head_size = 16
    codes = torch.arange(256, dtype=torch.int32)
    if handler.name != "int8_per_token_head":
        fp8 = torch.float8_e5m2 if handler.name == "fp8_e5m2" else torch.float8_e4m3fn
        decoded = codes.to(torch.uint8).view(fp8).float()
        codes = codes[torch.isfinite(decoded)]
    stored = codes.to(torch.uint8).view(handler.storage_dtype(torch.float32))
    num = -(-stored.numel() // head_size)
    rows = torch.zeros(num * head_size, dtype=stored.dtype)
    rows[: stored.numel()] = stored
    rows = rows.view(num, head_size)
    cache = _cache(handler, num, 1, 16, head_size, torch.float32)
    cache[:, 0, 0, head_size : 2 * head_size] = rows
    if handler.per_row_scales:
        scales = torch.tensor([1.0, 0.25]).expand(num, 2).contiguous()
        cache[:, 0, 0, 2 * head_size :] = scales.view(torch.uint8).view(cache.dtype)
    out = torch.empty(num, 1, head_size)
    native.paged_attention(
        out, torch.zeros(num, 1, head_size), cache, torch.arange(num, dtype=torch.int32).view(num, 1),
        torch.arange(num, dtype=torch.int32), torch.zeros(num, dtype=torch.int32), 1.0, None, None, None,
        handler.kernel_format, 1.0, TENSOR_SCALE,
    )
    row_scale = torch.full((num,), 0.25) if handler.per_row_scales else None
    expected = handler.dequantize(rows, row_scale, TENSOR_SCALE)
    if not torch.equal(out[:, 0], expected):
        bad = (out[:, 0] != expected).nonzero()[:4].tolist()
        return [f"decode {handler.name}: first mismatches at {bad}"]
    return []


def _worker() -> dict:
    import torch

    from cpu_backend import kv_cache, ops

    isa = ops.load()
    gen = torch.Generator().manual_seed(11)
    failures, worst = [], {}
    for name in QUANTIZED:
        handler = kv_cache.handler_for(name)
        failures += _decode_failures(handler)
        f, w = _attention_failures(handler, gen)
        failures += f
        for k, v in w.items():
            worst[f"{name}/{k}"] = v
    return {"isa": isa, "failures": failures, "worst": worst}


@pytest.mark.parametrize("isa_path", ISA_PATHS)
def test_native_quantized_kv_matches_reference(isa_path):
    result = run_worker(__file__, isa_path)
    assert result["failures"] == [], result["failures"][:20]
    print(isa_path, "worst abs error:", result["worst"])


@pytest.mark.parametrize("name", QUANTIZED)
def test_reference_quantization_error_is_bounded(name):
    import torch

    from cpu_backend.kv_cache import handler_for

    handler = handler_for(name)
    x = torch.randn(64, 4, 128, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 0] = 0  # an all-zero row: scale 0, decodes to zeros
    stored, rows = handler.quantize(x, TENSOR_SCALE, handler.storage_dtype(torch.float32))
    back = handler.dequantize(stored, rows, TENSOR_SCALE)
    err = (back - x).abs()
    assert torch.equal(back[0, 0], torch.zeros(128))
    if name == "int8_per_token_head":
        assert bool((err <= rows.unsqueeze(-1) / 2 + 1e-6).all())
    else:
        rel = 2.0**-3 if name == "fp8_e5m2" else 2.0**-4
        normal = x.abs() > (2.0**-13 if name == "fp8_e5m2" else 2.0**-5)
        assert bool((err[normal] <= rel * x.abs()[normal]).all())


def test_per_row_handler_saturates_and_keeps_sign():
    import torch

    from cpu_backend.kv_cache import handler_for

    fp8 = handler_for("fp8_e4m3")
    stored, _ = fp8.quantize(torch.tensor([1e6, -1e6, 0.0]), 1.0, torch.uint8)
    assert fp8.dequantize(stored, None, 1.0).tolist() == [448.0, -448.0, 0.0]


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    print(json.dumps(_worker()))
