"""Attention inside step graphs: the host's per-layer attention ops lowered to
direct calls of our kernels.

What it replaces, inside a recorded step only (`cpu_backend.worker.step_graphs`):
the host's opaque `vllm.unified_kv_cache_update` and
`vllm.unified_attention_with_output` custom ops
(`vllm/model_executor/layers/attention/attention.py`). Each call of those goes
through the torch dispatcher back into Python, through the KV-transfer and
CUDA-graph-break decorators, looks its layer up in the forward context and
then calls our `CpuBackendAttentionImpl`: ~40 us per layer beside the kernels
on a 2-core VM (torch profiler), over a millisecond per step for a 30-layer
model. Lowered, a layer costs a few dictionary lookups and the kernel calls
(`CpuBackendAttentionImpl.step_graph_ops`). Like the host ops, the lowered
calls read the step's slot mapping and metadata from the forward context when
they run, so a graph still serves every step of its token count.

Only lowered where the host op would do exactly that: our impl on its native
path, no KV connector (whose hooks the decorator runs), no speculative
decoding (a list of metadata), no fused output quantization.
"""

from __future__ import annotations

from typing import Callable

import torch

from cpu_backend.attention.impl import CpuBackendAttentionImpl

# name a lowered call gets in a graph's op counts
KV_CACHE_UPDATE = "cpu_backend::write_kv_cache (lowered)"
ATTENTION = "cpu_backend::paged_attention (lowered)"


def lower(func, args: tuple, kwargs: dict) -> tuple[Callable, tuple, str] | None:
    """For a host attention op that just ran: (call, its arguments, name) to
    record in its place, or None to record the op itself."""
    is_update = func is _host_op("unified_kv_cache_update")
    if not (is_update or func is _host_op("unified_attention_with_output")):
        return None
    bound = _bind(func, args, kwargs)
    if not is_update and (bound.get("output_scale") is not None
                          or bound.get("output_block_scale") is not None):
        return None
    from vllm.distributed.kv_transfer import has_kv_transfer_group
    from vllm.forward_context import get_forward_context
    from vllm.utils.torch_utils import _resolve_layer_name

    if has_kv_transfer_group():
        return None
    context = get_forward_context()
    if not isinstance(context.attn_metadata, dict) or not isinstance(context.slot_mapping, dict):
        return None
    name = _resolve_layer_name(bound["layer_name"])
    layer = context.no_compile_layers.get(name)
    impl = getattr(layer, "impl", None)
    if not isinstance(impl, CpuBackendAttentionImpl):
        return None
    calls = impl.step_graph_ops(name)
    if calls is None:
        return None
    kv_cache_update, attention = calls
    if is_update:
        # The host op returns an empty tensor only to order the attention op
        # after it under torch.compile; the lowered call returns None, which
        # that op's optional argument also takes.
        return kv_cache_update, (bound["key"], bound["value"]), KV_CACHE_UPDATE
    return attention, (bound["query"], bound["output"]), ATTENTION


def _host_op(name: str):
    packet = getattr(torch.ops.vllm, name, None)
    return getattr(packet, "default", None)


def _bind(func, args: tuple, kwargs: dict) -> dict:
    """The op's arguments by schema name."""
    bound = dict(kwargs)
    for argument, value in zip(func._schema.arguments, args):
        bound[argument.name] = value
    return bound
