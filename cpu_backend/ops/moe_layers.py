"""Unquantized MoE layers on our fused-MoE experts (cpu_backend.ops.moe).

Replaces, on our platform, the host's
`vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method.UnquantizedFusedMoEMethod`
with `CpuBackendUnquantizedFusedMoEMethod`, whose experts are
`CpuBackendMoEExperts` instead of the host's `CPUUnquantizedExperts` /
`X86CPUUnquantizedExperts` (`fused_moe/experts/cpu_moe.py`). Why: the host's
CPU experts need hidden and intermediate sizes divisible by 32 (AMX tiles for
the x86 class), prepack into their own layout regardless of
`VLLM_CPU_MOE_PREPACK` (the host 0.32 reads no such variable), and share
nothing with our dense kernels. Ours group tokens by expert and run the
expert GEMMs on `cpu_backend::linear`, the kernel our dense layers use.

How: `CustomOp.register_oot(name="UnquantizedFusedMoEMethod")`, the host's
hook for out-of-tree custom ops (`CustomOp.__new__` looks the class name up),
so every `UnquantizedFusedMoEMethod(moe_config)` the host builds, also for
layers a quantization config leaves unquantized, is ours. The subclass keeps
the host's weight creation, router (`CPURouter`), prepare/finalize and shared
experts; only the experts class of its modular kernel changes. A layer our
experts cannot run (an activation other than silu/gelu/gelu_tanh, LoRA,
batched all-to-all formats) keeps the host's own backend selection.

`VLLM_CPU_MOE_PREPACK` (0/1, default 1 as in vLLM's CPU documentation):
1 repacks the expert weights once at load into our linear kernel's panels;
0 keeps the checkpoint layout and runs the expert GEMMs with torch.
"""

from __future__ import annotations

import inspect

import torch
from vllm.logger import init_logger
from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.model_executor.layers.fused_moe import modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceNoOP,
)
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)
from vllm.model_executor.utils import replace_parameter
from vllm.platforms import current_platform

from cpu_backend import envs
from cpu_backend.ops import moe

logger = init_logger(f"vllm.{__name__}")

HOST_METHOD = "UnquantizedFusedMoEMethod"
ACTIVATIONS = {MoEActivation.SILU: "silu", MoEActivation.GELU: "gelu",
                MoEActivation.GELU_TANH: "gelu_tanh"}


def prepack_enabled() -> bool:
    """`VLLM_CPU_MOE_PREPACK`, default on; EnvError naming it on a bad value."""
    value = envs.moe_prepack()
    return True if value is None else value


class CpuBackendMoEExperts(mk.FusedMoEExpertsModular):
    """Token-grouped expert GEMMs on cpu_backend::linear (cpu_backend.ops.moe)."""

    def __init__(self, moe_config, quant_config, max_num_tokens=None, num_dispatchers=None):
        super().__init__(moe_config, quant_config, max_num_tokens, num_dispatchers)
        self.prepacked = False
        self.n13 = self.n2 = 0

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return current_platform.is_cpu()

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation in ACTIVATIONS

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return (weight_key, activation_key) == (None, None)

    @staticmethod
    def _supports_parallel_config(moe_parallel_config) -> bool:
        return not moe_parallel_config.use_all2all_kernels

    @property
    def expects_unquantized_inputs(self) -> bool:
        return True

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.n13 = layer.w13_weight.shape[1]
        self.n2 = layer.w2_weight.shape[1]
        self.prepacked = prepack_enabled() and layer.w13_weight.dtype in (
            torch.float32, torch.bfloat16, torch.float16)
        if self.prepacked:
            w13, w2 = moe.prepack_experts(layer.w13_weight.data, layer.w2_weight.data)
            replace_parameter(layer, "w13_weight", w13)
            replace_parameter(layer, "w2_weight", w2)

    def moe_problem_size(self, a1, w1, w2, topk_ids):
        # Packed weights are [E, panels, K, NR]: the sizes come from load time.
        return w1.shape[0], a1.size(0), self.n13, a1.size(-1), topk_ids.size(1)

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts,
                         expert_tokens_meta, activation):
        return (0,), (0,), (M, K)

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()  # apply() weights and sums the slots

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input):
        output.copy_(torch.ops.cpu_backend.moe_experts(
            hidden_states, w1, w2, topk_weights, topk_ids, self.n13, self.n2,
            ACTIVATIONS[activation], self.prepacked, self.w1_bias, self.w2_bias,
            expert_map, apply_router_weight_on_input))


class CpuBackendUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    """The host's unquantized MoE method with our experts (see module docstring)."""

    def __init__(self, moe):
        supported, reason = CpuBackendMoEExperts.is_supported_config(
            CpuBackendMoEExperts, moe, None, None, mk.FusedMoEActivationFormat.Standard)
        if not supported:
            logger.info_once("cpu_backend MoE experts: %s; the host's MoE backend is used.",
                             reason)
            super().__init__(moe)
            return
        # The host's __init__ minus its backend selection (which would pick,
        # and validate the sizes for, its own CPU experts).
        super(UnquantizedFusedMoEMethod, self).__init__(moe)
        self.unquantized_backend = UnquantizedMoeBackend.CPU
        self.experts_cls = CpuBackendMoEExperts
        # Prepacked weights are not the checkpoint layout: an ipc_cache /
        # pre-processed load or an EPLB rearrangement could not use them.
        self.supports_pre_processed_weights = False
        logger.info_once("cpu_backend MoE experts serve unquantized MoE layers (prepack=%s)",
                         prepack_enabled())


    @property
    def supports_eplb(self) -> bool:
        return self.experts_cls is not CpuBackendMoEExperts and super().supports_eplb


def _check_host_signatures() -> None:
    """The host methods we rely on, by signature (not version strings)."""
    init = inspect.signature(UnquantizedFusedMoEMethod.__init__).parameters
    apply = inspect.signature(mk.FusedMoEExpertsModular.apply).parameters
    needed = ("output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids", "activation",
              "expert_map", "apply_router_weight_on_input")
    missing = [p for p in needed if p not in apply]
    if list(init)[1:] != ["moe"] or missing or not hasattr(
            UnquantizedFusedMoEMethod, "_setup_kernel"):
        raise RuntimeError(
            "cpu_backend MoE: the host's UnquantizedFusedMoEMethod / FusedMoEExpertsModular "
            f"changed shape (init {list(init)}, apply missing {missing})")


def register_moe() -> str | None:
    """Register our method for the host's (idempotent); the host name taken over."""
    prepack_enabled()  # a bad VLLM_CPU_MOE_PREPACK fails here, at start-up
    _check_host_signatures()
    if HOST_METHOD not in op_registry_oot:
        CustomOp.register_oot(CpuBackendUnquantizedFusedMoEMethod, name=HOST_METHOD)
    return HOST_METHOD


def describe_moe(model: torch.nn.Module) -> list[str]:
    """'<MoE method>/<experts class>' of every MoE layer in the model."""
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

    found = set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, FusedMoEMethodBase):
            kernel = getattr(method, "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            found.add(f"{type(method).__name__}/{type(experts).__name__}")
    return sorted(found)
