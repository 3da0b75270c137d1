"""Attention compute for `CPU_BACKEND_ATTN`; replaces the host's
`vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl`.

`forward` first writes the step's keys and values into the paged cache (the
backend declares `forward_includes_kv_cache_update`, so the host runs no
separate update op; a layer sharing another layer's cache writes nothing),
then reads every key and value, new ones included, from the cache.

The KV-cache dtype (`--kv-cache-dtype`) is served by a handler from
`cpu_backend.kv_cache` (float, fp8 with per-tensor scales, int8/fp8 with
per-(token, head) scales): quantized on the cache write, dequantized inside
the attention kernel.

Compute path: the native kernel (`cpu_backend.ops.attention`, one call per
layer for the whole batch) when the layer shape is covered and the cache is
either quantized or in the model's dtype; otherwise the PyTorch path
(`paged_torch`: batched decode, one SDPA per prefilling request; a prefill
with no cached prefix reads the fresh key/value tensors instead of
gathering them).
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionImpl, AttentionLayer, AttentionType

from cpu_backend import stats
from cpu_backend.attention import paged_torch
from cpu_backend.attention.metadata import CpuBackendAttentionMetadata
from cpu_backend.kv_cache import handler_for
from cpu_backend.ops import attention as native


def _tensor_scales(layer) -> tuple[float, float]:
    """The layer's per-tensor KV scales (vLLM's Attention sets both, 1.0
    unless the checkpoint has them)."""
    return float(getattr(layer, "_k_scale_float", 1.0)), float(getattr(layer, "_v_scale_float", 1.0))


class CpuBackendAttentionImpl(AttentionImpl[CpuBackendAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                f"CPU_BACKEND_ATTN runs decoder attention only, not {attn_type!r}."
            )
        if sinks is not None:
            raise NotImplementedError("CPU_BACKEND_ATTN does not support attention sinks yet.")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_handler = handler_for(kv_cache_dtype)
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        # A layer reading another layer's cache leaves the writing to that layer.
        self._writes_kv = kv_sharing_target_layer_name is None
        self.sliding_window = sliding_window
        self.params = paged_torch.AttentionParams(
            scale=self.scale,
            sliding_window=sliding_window,
            softcap=logits_soft_cap or None,
            alibi_slopes=(
                torch.tensor(alibi_slopes, dtype=torch.float32)
                if alibi_slopes is not None
                else None
            ),
        )

        self._native: bool | None = None  # decided at the first forward

    def _use_native(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        if self._native is None:
            cache_ok = self.kv_handler.quantized or kv_cache.dtype == query.dtype
            self._native = cache_ok and native.supports(
                self.head_size, self.num_heads, self.num_kv_heads, kv_cache.shape[2]
            )
        return self._native

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        k_scale, v_scale = _tensor_scales(layer)
        if self._use_native(key, kv_cache):
            native.write_kv_cache(
                key, value, kv_cache, slot_mapping, self.kv_handler.kernel_format, k_scale, v_scale
            )
        else:
            paged_torch.write_kv(
                key, value, kv_cache, slot_mapping, self.kv_handler, k_scale, v_scale
            )

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CpuBackendAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query `[T, Hq, D]`, key/value `[T, Hkv, D]`, output `[T, Hq, D]`."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("CPU_BACKEND_ATTN has no fused output quantization.")
        if attn_metadata is None:  # profiling run
            return output
        stats.count("attention_forward")
        md = attn_metadata
        if self._writes_kv and key is not None and value is not None:
            self.do_kv_cache_update(layer, key, value, kv_cache, md.slot_mapping)
        k_scale, v_scale = _tensor_scales(layer)
        if self._use_native(query, kv_cache):
            num_tokens = md.token_req.shape[0]
            native.paged_attention(
                output[:num_tokens], query[:num_tokens], kv_cache, md.block_table,
                md.token_req, md.token_pos, self.scale, self.params.window,
                self.params.softcap, self.params.alibi_slopes,
                self.kv_handler.kernel_format, k_scale, v_scale,
            )
            return output
        key_cache, value_cache = paged_torch.kv_sources(
            kv_cache, self.head_size, self.kv_handler, k_scale, v_scale
        )

        if md.num_decodes:
            if md.decodes_are_leading:
                rows = slice(0, md.num_decodes)
                block_table = md.block_table[: md.num_decodes]
            else:
                rows = md.decode_token_idx
                block_table = md.block_table[md.decode_req_idx]
            out = paged_torch.decode(
                query[rows], key_cache, value_cache, block_table,
                md.decode_seq_lens, md.decode_max_seq_len, self.params,
            )
            output[rows] = out.to(output.dtype)

        fresh_kv_usable = kv_cache.dtype == query.dtype and key is not None
        for req, start, num_new, seq_len in md.prefills:
            end = start + num_new
            context_len = seq_len - num_new
            if context_len == 0 and fresh_kv_usable:
                k = key[start:end].transpose(0, 1)
                v = value[start:end].transpose(0, 1)
            else:
                num_blocks = -(-seq_len // key_cache.shape[2])
                block_ids = md.block_table[req, :num_blocks]
                k = paged_torch.gather_kv(key_cache, block_ids, seq_len)
                v = paged_torch.gather_kv(value_cache, block_ids, seq_len)
            output[start:end] = paged_torch.prefill(
                query[start:end], k, v, context_len, self.params
            ).to(output.dtype)
        return output

    def step_graph_ops(self, layer_name: str):
        """A direct call of this layer's native kernels for a step graph
        (`cpu_backend.attention.step_ops`), or None off the native path.

        `attention(query, key, value, output)` does what `forward` does on the
        native path (cache write, then attention), looking the layer (its cache
        and scales) and the step's metadata up in the forward context when it
        runs, as the host's op does.
        """
        if self._native is not True:
            return None
        from vllm.forward_context import get_forward_context

        # The ops' C++ entry points: a step graph calls this once per layer and
        # step, and OpOverload.__call__ is one Python frame around each.
        write = torch.ops.cpu_backend.write_kv_cache.default._op
        attend = torch.ops.cpu_backend.paged_attention.default._op
        kv_format = self.kv_handler.kernel_format
        scale, window = self.scale, int(self.params.window or 0)
        softcap, alibi_slopes = float(self.params.softcap or 0.0), self.params.alibi_slopes
        writes_kv, counts = self._writes_kv, stats.COUNTS

        def attention(query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                      output: torch.Tensor) -> None:
            context = get_forward_context()
            md = context.attn_metadata[layer_name]
            if md is None:  # profiling run
                return
            counts["attention_forward"] += 1
            layer = context.no_compile_layers[layer_name]
            k_scale, v_scale = _tensor_scales(layer)
            if writes_kv and key is not None and value is not None:
                write(key, value, layer.kv_cache, md.slot_mapping, kv_format, k_scale, v_scale)
            num_tokens = md.token_req.shape[0]
            if num_tokens != query.shape[0]:  # padded step
                output, query = output[:num_tokens], query[:num_tokens]
            attend(output, query, layer.kv_cache, md.block_table, md.token_req, md.token_pos,
                   scale, window, softcap, alibi_slopes, kv_format, k_scale, v_scale)

        return attention
