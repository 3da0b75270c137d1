"""Attention inside step graphs: the host's per-layer attention op lowered to
a direct call of our kernels.

What it replaces, inside a recorded step only (`cpu_backend.worker.step_graphs`):
the host's opaque `vllm.unified_attention_with_output` custom op
(`vllm/model_executor/layers/attention/attention.py`; our backend writes the
KV cache in its forward, so the host's `unified_kv_cache_update` op never
runs). Each call of it goes through the torch dispatcher back into Python,
through the KV-transfer and CUDA-graph-break decorators, looks its layer up in
the forward context and then calls our `CpuBackendAttentionImpl`: ~40 us per
layer beside the kernels on a 2-core VM (torch profiler), over a millisecond
per step for a 30-layer model. Lowered, a layer costs a few dictionary lookups
and the kernel calls (`CpuBackendAttentionImpl.step_graph_ops`). Like the host
op, the lowered call reads the step's slot mapping and metadata from the
forward context when it runs, so a graph still serves every step of its token
count.

Only lowered where the host op would do exactly that: our impl on its native
path, no KV connector (whose hooks the decorator runs), no speculative
decoding (a list of metadata), no fused output quantization.
"""

from __future__ import annotations

from typing import Callable

import torch

from cpu_backend.attention.impl import CpuBackendAttentionImpl

# name the lowered call gets in a graph's op counts
ATTENTION = "cpu_backend::paged_attention (lowered)"


def lower(func, args: tuple, kwargs: dict) -> tuple[Callable, tuple, str] | None:
    """For a host op that just ran: (call, its arguments, name) to record in
    its place, or None to record the op itself."""
    if func is not _host_op("unified_attention_with_output"):
        return None
    bound = _bind(func, args, kwargs)
    if bound.get("output_scale") is not None or bound.get("output_block_scale") is not None:
        return None
    from vllm.distributed.kv_transfer import has_kv_transfer_group
    from vllm.forward_context import get_forward_context
    from vllm.utils.torch_utils import _resolve_layer_name

    if has_kv_transfer_group():
        return None
    context = get_forward_context()
    if not isinstance(context.attn_metadata, dict):
        return None
    name = _resolve_layer_name(bound["layer_name"])
    layer = context.no_compile_layers.get(name)
    impl = getattr(layer, "impl", None)
    if not isinstance(impl, CpuBackendAttentionImpl):
        return None
    attention = impl.step_graph_ops(name)
    if attention is None:
        return None
    return attention, (bound["query"], bound["key"], bound["value"], bound["output"]), ATTENTION


def _host_op(name: str):
    packet = getattr(torch.ops.vllm, name, None)
    return getattr(packet, "default", None)


def _bind(func, args: tuple, kwargs: dict) -> dict:
    """The op's arguments by schema name."""
    bound = dict(kwargs)
    for argument, value in zip(func._schema.arguments, args):
        bound[argument.name] = value
    return bound
