"""Dense linear layers on our kernels, through the host's layer override hook.

Replaces, for unquantized weights, the host's
`vllm.model_executor.layers.linear.UnquantizedLinearMethod` and
`vllm.model_executor.layers.vocab_parallel_embedding.UnquantizedEmbeddingMethod`
(for the LM head). On the CPU those call `dispatch_cpu_unquantized_gemm`, which
on CPUs without native bf16 falls back to `F.linear`: bf16 models then run
3-6x slower than fp32. Ours repack each weight once at load and run
`cpu_backend::linear` (bf16/fp16 widened in registers, fp32 accumulation).

How: `PluggableLayer.register_oot` swaps a host layer class for our subclass
at instantiation (looked up by class name). The subclass only replaces the
layer's quantization method when it is the host's unquantized one, so
quantized layers keep theirs. Registration happens in our worker, before the
model is built.
"""

from __future__ import annotations

import torch
from vllm.logger import init_logger
from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot
from vllm.model_executor.layers import linear as host_linear
from vllm.model_executor.layers import vocab_parallel_embedding as host_vocab

from cpu_backend import envs
from cpu_backend.ops import linear as kernels
from cpu_backend.quantization import lm_head

logger = init_logger(f"vllm.{__name__}")

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Host classes whose instances we take over (each looked up by its own name).
LINEAR_CLASSES = (
    "ReplicatedLinear",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "RowParallelLinear",
)


def _packable(layer: torch.nn.Module) -> bool:
    weight = getattr(layer, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.ndim == 2
        and not weight.is_meta
        and weight.dtype in SUPPORTED_DTYPES
        and not getattr(layer, "_cpu_skip_gemm_dispatch", False)
    )


class _PackedGemm:
    """Mixed into a host method: pack the weight at load, run our kernel.
    Layers we cannot pack keep the host method's own path."""

    keeps_original_weight = False
    out_dtype: torch.dtype | None = None  # None: x's dtype

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if not _packable(layer):
            super().process_weights_after_loading(layer)
            return
        layer.cpu_backend_packed_weight = kernels.pack_linear_weight(layer.weight.data)
        layer.cpu_backend_out_features = layer.weight.shape[0]
        if not self.keeps_original_weight:
            # Only the packed copy is used from now on; free the original as
            # the host's CPU path does.
            layer.weight = torch.nn.Parameter(
                torch.empty(0, dtype=layer.weight.dtype), requires_grad=False
            )

    def apply(self, layer, x, bias=None):
        if not hasattr(layer, "cpu_backend_packed_weight"):
            return super().apply(layer, x, bias)
        if x.stride(-1) != 1:
            x = x.contiguous()
        return kernels.linear(
            x, layer.cpu_backend_packed_weight, layer.cpu_backend_out_features, bias,
            self.out_dtype,
        )


class CpuBackendLinearMethod(_PackedGemm, host_linear.UnquantizedLinearMethod):
    pass


class CpuBackendLMHeadMethod(_PackedGemm, host_vocab.UnquantizedEmbeddingMethod):
    """The LM head's logits GEMM; the weight stays (tied embeddings read it).

    Logits come out in float32 straight from the fp32 accumulators: the host's
    sampler converts them to float32 anyway (`Sampler.forward`), a separate
    pass that took 8 ms per step for 64 sequences x 151936 (Qwen2.5-0.5B
    shape), and logits rounded to bf16 first tie where float32 does not.
    For quantized checkpoints (and with `VLLM_CPU_BACKEND_LM_HEAD_QUANT=int8`)
    the GEMM runs on an int8 copy instead of a packed one
    (cpu_backend/quantization/lm_head.py)."""

    keeps_original_weight = True
    out_dtype = torch.float32

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        setting = envs.lm_head_quant()
        mode = lm_head.resolve_mode(setting, getattr(layer, "quant_config", None))
        if mode == "none" or not _packable(layer):
            super().process_weights_after_loading(layer)
            return
        layer.cpu_backend_lm_head = lm_head.quantize_head(layer.weight.data, mode)
        logger.info_once("cpu_backend: LM head %s logits run on an %s copy (%.0f MB; %s=%s%s)",
                         tuple(layer.weight.shape), mode, layer.cpu_backend_lm_head.nbytes() / 1e6,
                         envs.LM_HEAD_QUANT, setting,
                         ": the checkpoint is quantized; 'none' keeps its head"
                         if setting == "auto" else "")

    def apply(self, layer, x, bias=None):
        head = getattr(layer, "cpu_backend_lm_head", None)
        if head is None:
            return super().apply(layer, x, bias)
        return head.logits(x, bias, self.out_dtype)  # the op makes x's rows contiguous itself


def _swapping_subclass(base: type, host_method: type, ours: type) -> type:
    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        if type(getattr(self, "quant_method", None)) is host_method:
            self.quant_method = ours()

    return type(
        f"CpuBackend{base.__name__}",
        (base,),
        {
            "__init__": __init__,
            "__doc__": f"{base.__name__} whose unquantized GEMM runs on cpu_backend kernels.",
            "__module__": __name__,
        },
    )


def register_layers() -> list[str]:
    """Register our subclasses (idempotent); the host class names taken over."""
    targets = [
        (getattr(host_linear, name, None), host_linear.UnquantizedLinearMethod,
         CpuBackendLinearMethod)
        for name in LINEAR_CLASSES
    ]
    targets.append(
        (getattr(host_vocab, "ParallelLMHead", None),
         host_vocab.UnquantizedEmbeddingMethod, CpuBackendLMHeadMethod)
    )
    registered = []
    for base, host_method, ours in targets:
        if base is None:  # the host renamed or dropped it: keep its own path
            continue
        name = base.__name__
        if name not in op_registry_oot:
            PluggableLayer.register_oot(
                _swapping_subclass(base, host_method, ours), name=name
            )
        registered.append(name)
    logger.info("cpu_backend kernels (%s) serve linear layers: %s",
                kernels.load(), ", ".join(registered))
    return registered
