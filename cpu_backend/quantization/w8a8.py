"""compressed-tensors W8A8 INT8 checkpoints on our int8 x int8 kernel
(csrc/linear_w8a8.cpp).

Replaces, on our platform, the host's
`vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors.CompressedTensorsConfig`
for checkpoints with an int8 W8A8 config group, and its scheme
`...schemes.compressed_tensors_w8a8_int8.CompressedTensorsW8A8Int8`, whose CPU
kernel (`CPUInt8ScaledMMLinearKernel`, picked by `init_int8_linear_kernel`)
runs oneDNN or the AVX-512/AMX-only sgl kernel. Ours runs
`cpu_backend::w8a8_linear` (AVX2 maddubs, AVX-512 VNNI and portable builds
alike) with the weights repacked once at load.

How (no patching): `CpuBackendCompressedTensorsW8A8Config` subclasses the
host's config and is registered with `register_quantization_config` as
"cpu_backend_ct_w8a8"; its `override_quantization_method` claims
compressed-tensors checkpoints with an int8 W8A8 group when our platform is
current. Every scheme is still chosen by the host's `_get_scheme_from_parts`;
only `CompressedTensorsW8A8Int8` is swapped for our subclass, which creates the
same parameters but uses `CpuBackendInt8ScaledMMLinearKernel` (a host
`Int8ScaledMMLinearKernel`). We do not use `register_linear_kernel(..., "int8")`:
it appends after the host's CPU kernels, and the chooser takes the first that
can implement the layer, which is always the host's. MoE layers of such
checkpoints get our `w8a8_moe.CpuBackendW8A8MoEMethod` (the host's int8 MoE
experts need AMX).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
    Int8ScaledMMLinearKernel,
    Int8ScaledMMLinearLayerConfig,
)
from vllm.model_executor.layers.linear import register_weight_loader_v2_supported_method
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
    CompressedTensorsConfig,
    CompressedTensorsLinearMethod,
)
from vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_int8 import (  # noqa: E501
    CompressedTensorsW8A8Int8,
)
from vllm.model_executor.parameter import (
    BasevLLMParameter,
    ChannelQuantScaleParameter,
    ModelWeightParameter,
    PerTensorScaleParameter,
)

from cpu_backend import stats
from cpu_backend.quantization import formats
from cpu_backend.quantization.checks import checked_loader, is_our_platform


def _check_host_signatures() -> None:
    """The host pieces we build on, by signature (not by version string)."""
    want = {"strategy", "is_static_input_scheme", "input_symmetric"}
    got = set(inspect.signature(CompressedTensorsW8A8Int8.__init__).parameters) - {"self"}
    if got != want:
        raise ImportError(f"cpu_backend W8A8: host CompressedTensorsW8A8Int8.__init__ takes {got}, "
                          f"expected {want}")
    got = set(inspect.signature(CompressedTensorsConfig._get_scheme_from_parts).parameters)
    if not {"weight_quant", "input_quant"} <= got:
        raise ImportError("cpu_backend W8A8: host CompressedTensorsConfig._get_scheme_from_parts "
                          f"takes {got}")
    fields = set(Int8ScaledMMLinearLayerConfig.__dataclass_fields__)
    if not {"is_static_input_scheme", "is_channelwise", "input_symmetric"} <= fields:
        raise ImportError(f"cpu_backend W8A8: host Int8ScaledMMLinearLayerConfig has {fields}")


_check_host_signatures()


def static_input_params(input_scale: torch.Tensor | None, input_zp: torch.Tensor | None,
                        symmetric: bool) -> tuple[float | None, int | None]:
    """The one static activation scale (and zero point) of a layer. Fused layers
    (qkv, gate_up) load one per shard into the same 1-element tensor, as in the
    host; we take the largest scale like the host's oneDNN path."""
    if input_scale is None:
        return None, None
    scale = float(input_scale.float().max())
    zp = None if symmetric or input_zp is None else int(input_zp.to(torch.int32).reshape(-1)[0])
    return scale, zp


class CpuBackendInt8ScaledMMLinearKernel(Int8ScaledMMLinearKernel):
    """Host kernel interface; weights repacked at load, `cpu_backend::w8a8_linear` at run."""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        if not is_our_platform():
            return False, "requires the cpu_backend platform"
        return True, None

    @classmethod
    def can_implement(cls, c: Int8ScaledMMLinearLayerConfig) -> tuple[bool, str | None]:
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        from vllm.model_executor.layers.quantization.utils.w8a8_utils import convert_to_channelwise

        from cpu_backend.ops import load

        load()
        w_name, s_name, is_name, izp_name, azp_name = self.layer_param_names
        weight = getattr(layer, w_name).data
        scale = getattr(layer, s_name).data
        if not self.config.is_channelwise:  # per-tensor (one per fused shard) -> per channel
            scale = convert_to_channelwise(scale, layer.logical_widths)
        packed = formats.int8_kernel_layout(weight, scale.reshape(-1))
        in_scale = getattr(layer, is_name, None)
        in_zp = getattr(layer, izp_name, None)
        self.input_scale, self.input_zp = static_input_params(
            None if in_scale is None else in_scale.data, None if in_zp is None else in_zp.data,
            self.config.input_symmetric)
        for name in (w_name, s_name, is_name, izp_name, azp_name):
            if hasattr(layer, name):
                delattr(layer, name)
                setattr(layer, name, None)
        layer.register_buffer("cpu_backend_qweight", packed["qweight"], persistent=False)
        layer.register_buffer("cpu_backend_wsum", packed["wsum"], persistent=False)
        layer.register_buffer("cpu_backend_w_scale", packed["w_scale"], persistent=False)
        self.n = packed["n"]

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        stats.count("w8a8_linear")
        return torch.ops.cpu_backend.w8a8_linear(
            x, layer.cpu_backend_qweight, layer.cpu_backend_wsum, layer.cpu_backend_w_scale,
            self.n, self.input_scale, self.input_zp, self.config.input_symmetric, bias)


class CpuBackendW8A8Int8(CompressedTensorsW8A8Int8):
    """The host's W8A8 INT8 scheme with our kernel: same parameters as the host
    creates (so fused qkv / gate_up load through the host's loaders)."""

    @classmethod
    def get_min_capability(cls) -> int:
        return -1

    def create_weights(self, layer, output_partition_sizes, input_size_per_partition,
                       params_dtype, weight_loader, **kwargs):
        weight_loader = checked_loader(layer, weight_loader)
        layer.logical_widths = output_partition_sizes
        config = Int8ScaledMMLinearLayerConfig(
            is_channelwise=self.strategy == "channel",
            is_static_input_scheme=self.is_static_input_scheme,
            input_symmetric=self.input_symmetric)
        self.kernel = CpuBackendInt8ScaledMMLinearKernel(
            config, layer_param_names=["weight", "weight_scale", "input_scale",
                                       "input_zero_point", "azp_adj"])
        n = sum(output_partition_sizes)
        layer.register_parameter("weight", ModelWeightParameter(
            data=torch.empty(n, input_size_per_partition, dtype=torch.int8), input_dim=1,
            output_dim=0, weight_loader=weight_loader))
        if config.is_channelwise:
            scale = ChannelQuantScaleParameter(data=torch.empty((n, 1), dtype=torch.float32),
                                               output_dim=0, weight_loader=weight_loader)
        else:
            scale = PerTensorScaleParameter(
                data=torch.empty(len(output_partition_sizes), dtype=torch.float32),
                weight_loader=weight_loader)
        layer.register_parameter("weight_scale", scale)
        input_scale = input_zero_point = None
        if self.is_static_input_scheme:
            input_scale = BasevLLMParameter(data=torch.empty(1, dtype=torch.float32),
                                            weight_loader=weight_loader)
            if not self.input_symmetric:  # stored as int8 like the weights
                input_zero_point = BasevLLMParameter(data=torch.empty(1, dtype=torch.int8),
                                                     weight_loader=weight_loader)
        layer.register_parameter("input_scale", input_scale)
        layer.register_parameter("input_zero_point", input_zero_point)
        if not hasattr(layer, "azp_adj"):
            layer.register_parameter("azp_adj", None)


@register_weight_loader_v2_supported_method
class CpuBackendW8A8LinearMethod(CompressedTensorsLinearMethod):
    """The host's compressed-tensors linear method, named so the worker report
    shows which layers run our W8A8 scheme."""


def _is_int8_w8a8_group(group: dict) -> bool:
    w = group.get("weights") or {}
    a = group.get("input_activations") or {}
    return (w.get("type", "int") == "int" and w.get("num_bits") == 8
            and a.get("type", "int") == "int" and a.get("num_bits") == 8)


class CpuBackendCompressedTensorsW8A8Config(CompressedTensorsConfig):
    """compressed-tensors with int8 W8A8 groups on our kernel; every other
    group keeps the host's scheme."""

    @classmethod
    def get_name(cls) -> str:
        return "cpu_backend_ct_w8a8"

    @classmethod
    def get_min_capability(cls) -> int:
        return -1

    @classmethod
    def claims(cls, hf_quant_cfg: dict) -> bool:
        groups = hf_quant_cfg.get("config_groups") or {}
        return any(_is_int8_w8a8_group(g) for g in groups.values() if isinstance(g, dict))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        method = str(hf_quant_cfg.get("quant_method", "")).lower()
        if method != "compressed-tensors" or not is_our_platform() or not cls.claims(hf_quant_cfg):
            return None
        if user_quant in (None, "compressed-tensors", cls.get_name()):
            return cls.get_name()
        return None

    def _get_scheme_from_parts(self, weight_quant, input_quant, *args, **kwargs):
        scheme = super()._get_scheme_from_parts(weight_quant, input_quant, *args, **kwargs)
        if type(scheme) is CompressedTensorsW8A8Int8:
            return CpuBackendW8A8Int8(scheme.strategy, scheme.is_static_input_scheme,
                                      scheme.input_symmetric)
        return scheme

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Any:
        from vllm.model_executor.layers.fused_moe import RoutedExperts

        if isinstance(layer, RoutedExperts):
            from cpu_backend.quantization import w8a8_moe

            scheme = w8a8_moe.moe_scheme(self, layer, prefix)
            if scheme is not None:
                return w8a8_moe.CpuBackendW8A8MoEMethod(*scheme, layer.moe_config)
        method = super().get_quant_method(layer, prefix)
        if type(method) is CompressedTensorsLinearMethod and isinstance(
                getattr(layer, "scheme", None), CpuBackendW8A8Int8):
            return CpuBackendW8A8LinearMethod(self)
        return method
