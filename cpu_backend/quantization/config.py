"""GPTQ and AWQ checkpoints on our weight-only kernel (csrc/linear_wna16.cpp).

Replaces, on our platform, the host's
`vllm.model_executor.layers.quantization.auto_gptq.AutoGPTQConfig` and
`...auto_awq.AutoAWQConfig` (and their linear methods). On the CPU those pick
`CPUWNA16LinearKernel`, which calls `torch.ops._C.cpu_gemm_wna16`: absent from
the host's AVX2 build, 4-bit only, and the GPTQ config rejects asymmetric and
act-order (desc_act) checkpoints. Ours load what AutoGPTQ / GPTQModel
(4/8-bit, sym/asym, desc_act with g_idx, v1/v2 zeros) and AutoAWQ (GEMM) write,
repack each layer once at load into the kernel's layout, and run
`cpu_backend::wna16_linear` (AVX2, AVX-512 and portable builds alike).

How: `register_quantization_config` (the host's hook for out-of-tree configs)
adds "cpu_backend_gptq" / "cpu_backend_awq"; their `override_quantization_method`
claims checkpoints whose quant_method is "gptq" / "awq" when our platform is
the current one (custom overrides are probed before the built-in ones). The
checkpoint's config is validated in `from_config` (before any weight is read):
unsupported values and unknown keys raise QuantConfigError naming the key.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.parameter import (
    BasevLLMParameter,
    GroupQuantScaleParameter,
    PackedvLLMParameter,
    RowvLLMParameter,
)

from cpu_backend import envs, stats
from cpu_backend.quantization import formats
from cpu_backend.quantization.checks import (
    QuantConfigError,
    check_all_loaded,
    checked_loader,
    is_our_platform,
)

logger = init_logger(__name__)

SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)


def _check_keys(fmt: str, config: dict, known: set[str]) -> None:
    for key in config:
        if key not in known:
            raise QuantConfigError(
                f"{fmt} quantization_config key {key!r} is not supported by cpu_backend "
                f"(known keys: {', '.join(sorted(known))})"
            )


def _check_choice(fmt: str, key: str, value, allowed) -> None:
    if value not in allowed:
        raise QuantConfigError(
            f"{fmt} quantization_config {key}={value!r} is not supported by cpu_backend "
            f"(supported: {', '.join(map(repr, allowed))})"
        )


class _WNA16Config(QuantizationConfig):
    """Shared part: bits, group size, which layers, our linear method."""

    FORMAT = ""  # "gptq" | "awq": the checkpoint's quant_method

    def __init__(self, bits: int, group_size: int, full_config: dict[str, Any]):
        super().__init__()
        self.bits = bits
        self.group_size = group_size
        self.pack_factor = 32 // bits
        self.full_config = full_config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.full_config})"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return -1

    @classmethod
    def get_config_filenames(cls) -> list[str]:
        return ["quantize_config.json", "quant_config.json"]

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        method = str(hf_quant_cfg.get("quant_method", "")).lower()
        if method != cls.FORMAT or not is_our_platform():
            return None
        if user_quant in (None, cls.FORMAT, cls.get_name(), f"{cls.FORMAT}_marlin",
                          f"auto_{cls.FORMAT}"):
            return cls.get_name()
        return None

    def skip_layer(self, prefix: str) -> bool:
        return False

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from vllm.model_executor.layers.fused_moe import RoutedExperts
        from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

        if isinstance(layer, RoutedExperts):
            if self.skip_layer(prefix):
                return None  # the host then builds its (our) unquantized MoE method
            from cpu_backend.quantization.moe import CpuBackendWNA16MoEMethod

            return CpuBackendWNA16MoEMethod(self, layer.moe_config)
        if isinstance(layer, GateLinear):
            # MoE routers stay unquantized in GPTQ/AWQ/compressed-tensors
            # checkpoints (the tools skip them: [hidden x experts], precision-critical).
            return UnquantizedLinearMethod()
        if isinstance(layer, LinearBase):
            if self.skip_layer(prefix):
                return UnquantizedLinearMethod()
            return WNA16LinearMethod(self)
        return None


class CpuBackendGPTQConfig(_WNA16Config):
    FORMAT = "gptq"
    # keys AutoGPTQ / GPTQModel write that do not change the stored format
    KNOWN_KEYS = {
        "bits", "group_size", "desc_act", "sym", "quant_method", "checkpoint_format",
        "damp_percent", "damp_auto_increment", "true_sequential", "static_groups",
        "model_name_or_path", "model_file_base_name", "lm_head", "dynamic", "meta",
        "pack_dtype", "format", "mse", "is_marlin_format", "modules_in_block_to_quantize",
        # transformers' GPTQConfig serializes its loader/calibration options too
        "tokenizer", "dataset", "use_cuda_fp16", "model_seqlen", "block_name_to_quantize",
        "module_name_preceding_first_block", "batch_size", "pad_token_id", "use_exllama",
        "max_input_length", "exllama_config", "cache_block_outputs", "backend",
    }

    def __init__(self, bits, group_size, desc_act, sym, checkpoint_format, full_config):
        super().__init__(bits, group_size, full_config)
        self.desc_act = desc_act
        self.sym = sym
        self.checkpoint_format = checkpoint_format

    @classmethod
    def get_name(cls) -> str:
        return "cpu_backend_gptq"

    @staticmethod
    def get_checkpoint_weight_mapper():
        """Keep g_idx: the host's default mapper drops it (its kernels have no
        act-order); ours reorders the inputs by it."""
        from vllm.model_executor.models.utils import WeightsMapper

        return WeightsMapper()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CpuBackendGPTQConfig:
        fmt = "GPTQ"
        _check_keys(fmt, config, cls.KNOWN_KEYS)
        bits = cls.get_from_keys(config, ["bits"])
        _check_choice(fmt, "bits", bits, (4, 8))
        group_size = cls.get_from_keys(config, ["group_size"])
        _check_choice(fmt, "group_size", group_size, SUPPORTED_GROUP_SIZES)
        ckpt = config.get("checkpoint_format", config.get("format", "gptq")) or "gptq"
        _check_choice(fmt, "checkpoint_format", ckpt, ("gptq", "gptq_v2"))
        for key, bad in (("lm_head", True), ("is_marlin_format", True), ("static_groups", True)):
            if config.get(key) == bad:
                raise QuantConfigError(f"{fmt} quantization_config {key}={bad!r} is not supported "
                                       "by cpu_backend")
        if config.get("dynamic"):
            raise QuantConfigError(f"{fmt} quantization_config key 'dynamic' (per-module rules) "
                                   "is not supported by cpu_backend")
        if config.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
            raise QuantConfigError(f"{fmt} quantization_config pack_dtype="
                                   f"{config['pack_dtype']!r} is not supported (int32 only)")
        return cls(bits, group_size, bool(config.get("desc_act", False)),
                   bool(config.get("sym", True)), ckpt, config)

    def skip_layer(self, prefix: str) -> bool:
        only = self.full_config.get("modules_in_block_to_quantize")
        if not only:
            return False
        names = [n for group in only for n in (group if isinstance(group, list) else [group])]
        mapping = self.packed_modules_mapping or {}
        leaf = prefix.rsplit(".", 1)[-1]
        shards = mapping.get(leaf, [leaf])
        return not any(s in n or n.endswith(s) for s in shards for n in names)


class CpuBackendAWQConfig(_WNA16Config):
    FORMAT = "awq"
    KNOWN_KEYS = {
        "quant_method", "bits", "w_bit", "group_size", "q_group_size", "zero_point", "version",
        "modules_to_not_convert", "backend",
        # transformers' AwqConfig: fusing / exllama options of its own loader
        "do_fuse", "fuse_max_seq_len", "modules_to_fuse", "exllama_config",
    }

    def __init__(self, bits, group_size, zero_point, not_convert, full_config):
        super().__init__(bits, group_size, full_config)
        self.zero_point = zero_point
        self.modules_to_not_convert = not_convert or []

    @classmethod
    def get_name(cls) -> str:
        return "cpu_backend_awq"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CpuBackendAWQConfig:
        fmt = "AWQ"
        _check_keys(fmt, config, cls.KNOWN_KEYS)
        bits = cls.get_from_keys(config, ["w_bit", "bits"])
        _check_choice(fmt, "bits", bits, (4,))
        group_size = cls.get_from_keys(config, ["q_group_size", "group_size"])
        _check_choice(fmt, "group_size", group_size, SUPPORTED_GROUP_SIZES)
        version = str(config.get("version", "gemm")).lower()
        _check_choice(fmt, "version", version, ("gemm",))
        zero_point = bool(cls.get_from_keys_or(config, ["zero_point"], True))
        return cls(bits, group_size, zero_point,
                   cls.get_from_keys_or(config, ["modules_to_not_convert"], None), config)

    def skip_layer(self, prefix: str) -> bool:
        return any(name in prefix for name in self.modules_to_not_convert)


class CpuBackendCompressedTensorsWNA16Config(_WNA16Config):
    """compressed-tensors "pack-quantized" W4A16 / W8A16 (weight-only int,
    group or channel strategy, symmetric or with zero points). Other
    compressed-tensors schemes (W8A8, fp8, ...) are left to the host: the
    override only claims checkpoints whose every config group is one of these."""

    FORMAT = "compressed-tensors"
    WEIGHT_KEYS = {
        "num_bits", "type", "symmetric", "strategy", "group_size", "dynamic", "actorder",
        "observer", "observer_kwargs", "block_structure", "zp_dtype", "scale_dtype",
    }

    def __init__(self, bits, group_size, sym, ignore, full_config):
        super().__init__(bits, group_size, full_config)
        self.sym = sym
        self.ignore = ignore or []

    @classmethod
    def get_name(cls) -> str:
        return "cpu_backend_ct_wna16"

    @classmethod
    def get_config_filenames(cls) -> list[str]:
        return []

    @classmethod
    def _weight_scheme(cls, config: dict) -> dict:
        """The single weight-only scheme of the config; QuantConfigError otherwise."""
        fmt = "compressed-tensors"
        groups = config.get("config_groups") or {}
        if len(groups) != 1:
            raise QuantConfigError(f"{fmt} quantization_config config_groups: one group expected, "
                                   f"got {len(groups)}")
        (group,) = groups.values()
        if group.get("input_activations") or group.get("output_activations"):
            raise QuantConfigError(f"{fmt} config_groups input_activations: only weight-only "
                                   "schemes run on cpu_backend's wna16 kernel")
        group_format = group.get("format") or config.get("format")
        _check_choice(fmt, "format", group_format, ("pack-quantized",))
        if list(group.get("targets", [])) != ["Linear"]:
            raise QuantConfigError(f"{fmt} config_groups targets={group.get('targets')!r}: "
                                   "only ['Linear'] is supported")
        return group.get("weights") or {}

    @classmethod
    def claims(cls, config: dict) -> bool:
        try:
            w = cls._weight_scheme(config)
        except QuantConfigError:
            return False
        return w.get("type") == "int" and not w.get("dynamic")

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        method = str(hf_quant_cfg.get("quant_method", "")).lower()
        if method != cls.FORMAT or not is_our_platform() or not cls.claims(hf_quant_cfg):
            return None
        if user_quant in (None, cls.FORMAT, cls.get_name()):
            return cls.get_name()
        return None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CpuBackendCompressedTensorsWNA16Config:
        fmt = "compressed-tensors"
        w = cls._weight_scheme(config)
        for key in w:
            if key not in cls.WEIGHT_KEYS:
                raise QuantConfigError(f"{fmt} weights key {key!r} is not supported by cpu_backend")
        _check_choice(fmt, "weights.type", w.get("type"), ("int",))
        _check_choice(fmt, "weights.num_bits", w.get("num_bits"), (4, 8))
        _check_choice(fmt, "weights.strategy", w.get("strategy"), ("group", "channel"))
        _check_choice(fmt, "weights.actorder", w.get("actorder"), (None,))
        if w.get("dynamic"):
            raise QuantConfigError(f"{fmt} weights.dynamic=True is not supported by cpu_backend")
        group_size = w.get("group_size") if w["strategy"] == "group" else -1
        _check_choice(fmt, "weights.group_size", group_size, SUPPORTED_GROUP_SIZES)
        return cls(w["num_bits"], group_size, bool(w.get("symmetric", True)),
                   config.get("ignore"), config)

    def skip_layer(self, prefix: str) -> bool:
        import re

        mapping = self.packed_modules_mapping or {}
        head, _, leaf = prefix.rpartition(".")
        names = [f"{head}.{s}" if head else s for s in mapping.get(leaf, [leaf])]
        for pattern in self.ignore:
            for name in names:
                if pattern.startswith("re:"):
                    if re.match(pattern[3:], name):
                        return True
                elif name == pattern or name.endswith("." + pattern):
                    return True
        return False


@register_weight_loader_v2_supported_method
class WNA16LinearMethod(LinearMethodBase):
    """Creates the checkpoint's tensors, repacks them at load, runs our kernel."""

    def __init__(self, quant_config: _WNA16Config):
        self.quant_config = quant_config

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        cfg = self.quant_config
        k = input_size_per_partition
        n = sum(output_partition_sizes)
        gs = k if cfg.group_size == -1 else cfg.group_size
        pf = cfg.pack_factor
        where = f"{type(cfg).__name__}: layer [{n} x {k}]"
        if k % gs:
            raise QuantConfigError(f"{where}: group_size={cfg.group_size} does not divide {k}")
        if n % pf:
            raise QuantConfigError(f"{where}: output size is not a multiple of {pf}")
        groups = k // gs
        loader = checked_loader(layer, extra_weight_attrs.get("weight_loader"))
        layer.cpu_backend_wna16_shards = len(output_partition_sizes)
        if cfg.FORMAT == "compressed-tensors":
            self._create_ct_weights(layer, n, k, groups, loader)
            layer.cpu_backend_wna16_n = n
            return
        is_awq = cfg.FORMAT == "awq"
        if is_awq:
            qweight = PackedvLLMParameter(
                data=torch.empty(k, n // pf, dtype=torch.int32), input_dim=0, output_dim=1,
                packed_dim=1, packed_factor=pf, weight_loader=loader)
        else:
            if k % pf:
                raise QuantConfigError(f"{where}: input size is not a multiple of {pf}")
            qweight = PackedvLLMParameter(
                data=torch.empty(k // pf, n, dtype=torch.int32), input_dim=0, output_dim=1,
                packed_dim=0, packed_factor=pf, weight_loader=loader)
        qzeros = PackedvLLMParameter(
            data=torch.empty(groups, n // pf, dtype=torch.int32), input_dim=0, output_dim=1,
            packed_dim=1, packed_factor=pf, weight_loader=loader)
        # float32 whatever the model dtype: fp16 checkpoint scales load exactly
        # (bf16 would drop 3 bits of each); the kernel takes fp32 anyway.
        scales = GroupQuantScaleParameter(
            data=torch.empty(groups, n, dtype=torch.float32), input_dim=0, output_dim=1,
            weight_loader=loader)
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("qzeros", qzeros)
        layer.register_parameter("scales", scales)
        if not is_awq:
            g_idx = RowvLLMParameter(
                data=(torch.arange(k, dtype=torch.int32) // gs), input_dim=0, weight_loader=loader)
            layer.register_parameter("g_idx", g_idx)
        layer.cpu_backend_wna16_n = n

    def _create_ct_weights(self, layer, n, k, groups, loader):
        """compressed-tensors pack-quantized: weight_packed [N, K/pf] int32 packed
        along K, weight_scale [N, G], weight_zero_point [N/pf, G] packed along N
        (asymmetric only), weight_shape [2]; values stored with +2^(bits-1)."""
        pf = self.quant_config.pack_factor
        if k % pf:
            raise QuantConfigError(f"compressed-tensors layer [{n} x {k}]: input size is not "
                                   f"a multiple of {pf}")
        layer.register_parameter("weight_packed", PackedvLLMParameter(
            data=torch.empty(n, k // pf, dtype=torch.int32), input_dim=1, output_dim=0,
            packed_dim=1, packed_factor=pf, weight_loader=loader))
        layer.register_parameter("weight_scale", GroupQuantScaleParameter(
            data=torch.empty(n, groups, dtype=torch.float32), input_dim=1, output_dim=0,
            weight_loader=loader))
        layer.register_parameter("weight_shape", BasevLLMParameter(
            data=torch.empty(2, dtype=torch.int64), weight_loader=loader))
        if not self.quant_config.sym:
            layer.register_parameter("weight_zero_point", PackedvLLMParameter(
                data=torch.zeros(n // pf, groups, dtype=torch.int32), input_dim=1, output_dim=0,
                packed_dim=0, packed_factor=pf, weight_loader=loader))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        from cpu_backend.ops import load

        load()
        cfg = self.quant_config
        if cfg.FORMAT == "compressed-tensors":
            check_all_loaded(layer, ("weight_packed", "weight_scale")
                              + (() if cfg.sym else ("weight_zero_point",)))
        else:
            check_all_loaded(layer, ("qweight", "qzeros", "scales"))
        if cfg.FORMAT == "compressed-tensors":
            zp = layer.weight_zero_point.data if not cfg.sym else None
            view = formats.ct_unpack(layer.weight_packed.data, layer.weight_scale.data, zp, cfg.bits)
            for name in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point"):
                if hasattr(layer, name):
                    delattr(layer, name)
        elif cfg.FORMAT == "awq":
            view = formats.awq_unpack(layer.qweight.data, layer.qzeros.data, layer.scales.data,
                                      cfg.bits)
            if not cfg.zero_point:  # symmetric AWQ: zero fixed at 2^(bits-1)
                view["zero"].fill_(1 << (cfg.bits - 1))
        else:
            view = formats.gptq_unpack(layer.qweight.data, layer.qzeros.data, layer.scales.data,
                                       layer.g_idx.data, cfg.bits, cfg.checkpoint_format)
            if cfg.sym:
                view["zero"].fill_(1 << (cfg.bits - 1))
        try:
            packed = formats.kernel_layout(view["q"], view["zero"], view["scale"], view["g_idx"],
                                           cfg.bits, drop_symmetric_zs=True)
        except ValueError as e:
            raise QuantConfigError(f"{type(cfg).__name__}: {e}") from None
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            if hasattr(layer, name):
                delattr(layer, name)
        layer.register_buffer("cpu_backend_qweight", packed["qweight"], persistent=False)
        layer.register_buffer("cpu_backend_scales", packed["scales"], persistent=False)
        layer.register_buffer("cpu_backend_zs", packed["zs"], persistent=False)
        layer.register_buffer("cpu_backend_perm", packed["perm"], persistent=False)
        layer.cpu_backend_group_size = packed["group_size"]
        # W4A8 (the host's VLLM_CPU_INT4_W4A8, default on): int8 activations per
        # 32 inputs with integer dot products; 3x fewer instructions per weight
        # on AVX2, where the float path is compute bound.
        layer.cpu_backend_int8_act = (cfg.bits == 4 and packed["group_size"] % formats.A8_INPUTS == 0
                                      and envs.int4_w4a8())
        if layer.cpu_backend_int8_act:
            logger.info_once("cpu_backend: 4-bit linears run W4A8: activations quantized to int8 per "
                             "%d inputs (%s=0 keeps them in the model dtype)", formats.A8_INPUTS,
                             envs.INT4_W4A8)

    def apply(self, layer, x, bias=None):
        stats.count("wna16_linear")
        return torch.ops.cpu_backend.wna16_linear(
            x, layer.cpu_backend_qweight, layer.cpu_backend_scales, layer.cpu_backend_zs,
            self.quant_config.bits, layer.cpu_backend_group_size, layer.cpu_backend_wna16_n,
            layer.cpu_backend_perm, bias, None, layer.cpu_backend_int8_act)
