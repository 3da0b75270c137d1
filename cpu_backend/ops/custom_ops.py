"""Gated activations and rotary embedding on our kernels (csrc/activation.cpp,
csrc/rotary.cpp), through the host's `CustomOp.register_oot` hook.

Replaces, at instantiation (the host looks the class name up in its OOT
registry), these host classes with subclasses whose `forward_cpu` (what the
host dispatches to on a CPU platform) calls our kernels:

- `vllm.model_executor.layers.activation.SiluAndMul` and `GeluAndMul`: the
  host's CPU forward is `forward_native` (a slice, F.silu/F.gelu and a
  multiply: three eager ops and two temporaries per MLP);
- `vllm.model_executor.layers.rotary_embedding.RotaryEmbedding`, and those of
  its subclasses that only change the cos/sin cache (Llama3, linear/NTK/YaRN
  scaling, ...): same forward, same cache layout `[max_position, rotary_dim]`
  = cos | sin. The host's CPU forward calls its own `_C.rotary_embedding`;
  ours is the same math on our per-ISA library. Subclasses with their own
  forward (mrope, DeepSeek, Phi-3 long-rope, Fourier, ...) are left alone.

Calls our kernels cannot take (another dtype, a cache of another width, a
non-contiguous last dim, or under torch.compile tracing, where the host's
native forward stays fusable) go to the host's forward. Registration happens
in our worker before the model is built (`register_custom_ops`).
"""

from __future__ import annotations

import inspect

import torch
from vllm.logger import init_logger
from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.model_executor.layers import activation as host_activation

from cpu_backend import stats
from cpu_backend.ops import load

logger = init_logger(f"vllm.{__name__}")

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _kernel_ok(x: torch.Tensor) -> bool:
    return (
        x.dtype in SUPPORTED_DTYPES
        and x.device.type == "cpu"
        and x.dim() >= 1
        and x.stride(-1) == 1
        and not torch.compiler.is_compiling()
    )


def _gated_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x as [rows, 2d] and an empty [rows, d] output, or None."""
    if not _kernel_ok(x) or x.shape[-1] % 2:
        return None
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        return None
    return x2, torch.empty(x.shape[:-1] + (d,), dtype=x.dtype)


class CpuBackendSiluAndMul(host_activation.SiluAndMul):
    """SiluAndMul on cpu_backend::silu_and_mul."""

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        rows = _gated_rows(x)
        if rows is None:
            return super().forward_cpu(x)
        x2, out = rows
        torch.ops.cpu_backend.silu_and_mul(out.view(x2.shape[0], -1), x2)
        stats.count(stats.KERNEL_PREFIX + type(self).__name__)
        return out


class CpuBackendGeluAndMul(host_activation.GeluAndMul):
    """GeluAndMul (approximate 'none' or 'tanh') on cpu_backend::gelu_and_mul."""

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        rows = _gated_rows(x)
        if rows is None or self.approximate not in ("none", "tanh"):
            return super().forward_cpu(x)
        x2, out = rows
        torch.ops.cpu_backend.gelu_and_mul(out.view(x2.shape[0], -1), x2, self.approximate)
        stats.count(stats.KERNEL_PREFIX + type(self).__name__)
        return out


class _RotaryOnKernels:
    """Mixed in before a host RotaryEmbedding class."""

    def forward_cpu(self, positions, query, key=None):
        cache = self.cos_sin_cache
        if (
            not _kernel_ok(query)
            or (key is not None and (not _kernel_ok(key) or key.dtype != query.dtype))
            or cache.dim() != 2
            or cache.shape[-1] != self.rotary_dim
            or cache.dtype not in SUPPORTED_DTYPES
            or query.shape[0] != positions.numel()
        ):
            return super().forward_cpu(positions, query, key)
        cache = self._match_cos_sin_cache_dtype(query)
        torch.ops.cpu_backend.rotary_embedding(
            positions, query, key, self.head_size, cache.contiguous(), self.is_neox_style
        )
        stats.count(stats.KERNEL_PREFIX + type(self).__name__)
        return query, key


def _rotary_classes() -> list[type]:
    """RotaryEmbedding and the subclasses that keep its forward and only
    change the cos/sin cache (checked by identity of the forward methods)."""
    from vllm.model_executor.layers import rotary_embedding as host_rope

    base = host_rope.RotaryEmbedding
    expected = inspect.signature(base.forward_cpu)
    if list(expected.parameters) != ["self", "positions", "query", "key"]:
        logger.warning("cpu_backend: host RotaryEmbedding.forward_cpu%s is not the one our rotary "
                       "kernel implements; keeping the host's", expected)
        return []
    found, todo = [], [base]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith("cpu_backend."):
            continue
        same_forward = all(
            getattr(cls, name) is getattr(base, name)
            for name in ("forward", "forward_native", "forward_static", "forward_cpu",
                         "_match_cos_sin_cache_dtype")
        )
        if same_forward and cls not in found:
            found.append(cls)
    return found


def _activation_classes() -> list[tuple[type, type]]:
    pairs = []
    for host_cls, ours in ((host_activation.SiluAndMul, CpuBackendSiluAndMul),
                           (host_activation.GeluAndMul, CpuBackendGeluAndMul)):
        params = list(inspect.signature(host_cls.forward_native).parameters)
        if params[-1:] == ["x"] and list(inspect.signature(host_cls.forward_cpu).parameters) == ["self", "x"]:
            pairs.append((host_cls, ours))
        else:
            logger.warning("cpu_backend: host %s.forward_native%s changed; keeping the host's",
                           host_cls.__name__, params)
    return pairs


def register_custom_ops() -> list[str]:
    """Register our subclasses (idempotent); the host class names taken over."""
    load()
    targets = list(_activation_classes())
    for host_cls in _rotary_classes():
        ours = type(
            f"CpuBackend{host_cls.__name__}",
            (_RotaryOnKernels, host_cls),
            {"__doc__": f"{host_cls.__name__} on cpu_backend::rotary_embedding.",
             "__module__": __name__},
        )
        targets.append((host_cls, ours))
    registered = []
    for host_cls, ours in targets:
        name = host_cls.__name__
        if name not in op_registry_oot:
            CustomOp.register_oot(ours, name=name)
        registered.append(name)
    logger.info("cpu_backend kernels serve custom ops: %s", ", ".join(registered))
    return registered
