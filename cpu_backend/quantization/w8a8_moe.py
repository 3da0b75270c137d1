"""compressed-tensors W8A8 INT8 MoE experts on our int8 x int8 kernel.

Replaces, for the MoE layers of checkpoints our W8A8 config claims
(`cpu_backend.quantization.w8a8.CpuBackendCompressedTensorsW8A8Config`), the
host's
`compressed_tensors_moe.compressed_tensors_moe_w8a8_int8.CompressedTensorsW8A8Int8MoEMethod`.
Why: its constructor picks experts through `fused_moe/oracle/int8.py`, whose CPU
experts (`CPUExpertsInt8`) need AMX tiles, so on AVX2 and AVX-512 machines the
engine stops with "No Int8 MoE backend supports the deployment configuration".

Ours subclass the host's method and keep its parameters and weight loading
(int8 `w13_weight` [E, 2I, H] / `w2_weight` [E, H, I], per-channel fp32 scales,
optional biases), minus its backend selection. At load each expert is repacked
once into `cpu_backend::w8a8_linear`'s layout (the dense layers' code,
`formats.int8_kernel_layout`); the forward groups tokens by expert
(`cpu_backend.ops.moe.grouped_experts`) and runs gate/up -> act * up -> down,
each GEMM quantizing its input rows per token (dynamic, symmetric or with a zero
point as the checkpoint says), like the dense W8A8 layers.
"""

from __future__ import annotations

import inspect

import torch
from compressed_tensors.quantization import QuantizationStrategy
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (  # noqa: E501
    CompressedTensorsMoEMethod,
)
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w8a8_int8 import (  # noqa: E501
    CompressedTensorsW8A8Int8MoEMethod,
)

from cpu_backend.ops.moe_layers import ACTIVATIONS
from cpu_backend.quantization.checks import QuantConfigError
from cpu_backend.quantization.moe import ConvertedMoEExperts, install_experts
from cpu_backend.quantization.formats import int8_kernel_layout


def _check_host_signatures() -> None:
    params = list(inspect.signature(CompressedTensorsW8A8Int8MoEMethod.__init__).parameters)
    if params[1:4] != ["weight_quant", "input_quant", "moe"]:
        raise ImportError("cpu_backend W8A8 MoE: host CompressedTensorsW8A8Int8MoEMethod.__init__ "
                          f"takes {params}")


_check_host_signatures()


def moe_scheme(config, layer, prefix: str) -> tuple | None:
    """(weight_quant, input_quant) of an MoE layer whose projections are int8
    W8A8 with dynamic per-token activations; None for any other scheme (the
    host's own choice then applies, as in `CompressedTensorsMoEMethod.get_moe_method`)."""
    config._add_fused_moe_to_target_scheme_map()
    dicts = [config.get_scheme_dict(layer, f"{prefix}.0.{name}") for name in
             (layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name)]
    if dicts[0] is None or any(d != dicts[0] for d in dicts):
        return None  # ignored layer, or mixed schemes: the host decides / raises
    weight_quant, input_quant = dicts[0].get("weights"), dicts[0].get("input_activations")
    if weight_quant is None or input_quant is None:
        return None
    if not config._is_dynamic_token_w8a8(weight_quant, input_quant):
        return None
    return weight_quant, input_quant


class CpuBackendW8A8MoEExperts(ConvertedMoEExperts):
    """Grouped experts whose projections run on cpu_backend::w8a8_linear."""

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input):
        p13, p2, symmetric = self.packs
        output.copy_(torch.ops.cpu_backend.moe_experts_w8a8(
            hidden_states, topk_weights, topk_ids,
            [p["qweight"] for p in p13], [p["wsum"] for p in p13], [p["w_scale"] for p in p13],
            [p["qweight"] for p in p2], [p["wsum"] for p in p2], [p["w_scale"] for p in p2],
            self.n13, self.n2, symmetric, ACTIVATIONS[activation], self.w1_bias, self.w2_bias,
            expert_map, apply_router_weight_on_input))


class CpuBackendW8A8MoEMethod(CompressedTensorsW8A8Int8MoEMethod):
    """The host's W8A8 INT8 MoE method with our experts (see module docstring)."""

    def __init__(self, weight_quant, input_quant, moe):
        # The host's __init__ minus `select_int8_moe_backend` (AMX-only on the CPU).
        CompressedTensorsMoEMethod.__init__(self, moe)
        self.weight_quant, self.input_quant = weight_quant, input_quant
        self.static_input_scales = not input_quant.dynamic
        self.int8_backend = self.experts_cls = None
        if weight_quant.strategy != QuantizationStrategy.CHANNEL or \
                input_quant.strategy != QuantizationStrategy.TOKEN:
            raise QuantConfigError(
                "compressed-tensors W8A8 MoE layer: config_groups weights.strategy must be "
                f"'channel' and input_activations.strategy 'token', got "
                f"{weight_quant.strategy!r} / {input_quant.strategy!r}")
        ConvertedMoEExperts.require_supported(moe, "compressed-tensors W8A8 MoE layer")

    def process_weights_after_loading(self, layer):
        from cpu_backend.ops import load

        load()
        packs = {stem: [int8_kernel_layout(getattr(layer, f"{stem}_weight").data[e],
                                      getattr(layer, f"{stem}_weight_scale").data[e].reshape(-1))
                        for e in range(layer.w13_weight.shape[0])]
                 for stem in ("w13", "w2")}
        num_experts, n13, n2 = (layer.w13_weight.shape[0], layer.w13_weight.shape[1],
                                layer.w2_weight.shape[1])
        for name in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
            delattr(layer, name)
        install_experts(self, layer, CpuBackendW8A8MoEExperts, num_experts, n13, n2,
                        (packs["w13"], packs["w2"], bool(self.input_quant.symmetric)))

    def get_fused_moe_quant_config(self, layer) -> FusedMoEQuantConfig:
        # Activations enter unquantized: each expert GEMM quantizes its own rows.
        return FusedMoEQuantConfig.make(w1_bias=getattr(layer, "w13_bias", None),
                                        w2_bias=getattr(layer, "w2_bias", None))
