"""GPTQ / AWQ / compressed-tensors W4A16, W8A16 MoE experts on our weight-only kernel.

Replaces, for the MoE layers of checkpoints our WNA16 configs claim
(`cpu_backend.quantization.config`), the host's `MoeWNA16Method` /
`GPTQMarlinMoEMethod` / `CompressedTensorsWNA16MoEMethod`: on the CPU those
pick their experts through `fused_moe/oracle/int_wna16.py`, whose only CPU
experts (`CPUExpertsInt4` in `fused_moe/experts/cpu_moe.py`) need AMX tiles,
so on AVX-512 and AVX2 machines the engine stops with "No WNA16 MoE backend
supports the deployment configuration".

Ours keep each expert's projections in the checkpoint's own tensors while
loading (one stacked parameter per tensor kind, TP-sharded along the
intermediate size like the host's expert loader), then convert every expert
once into `cpu_backend::wna16_linear`'s layout (the dense layers' code:
`formats.*_unpack` -> `formats.kernel_layout`). The forward groups tokens by
expert (`cpu_backend.ops.moe.grouped_experts`) and runs gate/up -> act * up ->
down on the kernel, activations bf16/fp16/fp32 as the model's.

Not supported (QuantConfigError naming it): act-order (desc_act) checkpoints
whose gate and up projections of an expert have different g_idx, act-order
with tensor parallelism on the down projection.
"""

from __future__ import annotations

import torch
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
    UnquantizedMoeBackend,
    make_unquantized_moe_kernel,
)
from vllm.model_executor.utils import set_weight_attrs

from cpu_backend.ops import moe as moe_ops
from cpu_backend.ops.moe_layers import ACTIVATIONS, CpuBackendMoEExperts
from cpu_backend.quantization import formats
from cpu_backend.quantization.checks import QuantConfigError


def install_experts(method: FusedMoEMethodBase, layer, experts_cls, num_experts: int, n13: int,
                    n2: int, packs: tuple) -> None:
    """Once `method` has converted its experts' weights into `packs` (and deleted
    the checkpoint tensors): placeholder w13/w2 (the modular kernel reads the
    expert count from their first dim) and the modular kernel running
    `experts_cls`, which holds the packs and the output sizes."""
    layer.register_buffer("w13_weight", torch.empty(num_experts, 0, 0), persistent=False)
    layer.register_buffer("w2_weight", torch.empty(num_experts, 0, 0), persistent=False)
    method.moe_quant_config = method.get_fused_moe_quant_config(layer)
    method.moe_kernel = make_unquantized_moe_kernel(
        quant_config=method.moe_quant_config, moe_config=method.moe,
        backend=UnquantizedMoeBackend.CPU, experts_cls=experts_cls,
        routing_tables=layer._expert_routing_tables())
    experts = method.moe_kernel.fused_experts
    experts.n13, experts.n2, experts.packs = n13, n2, packs


def _specs(fmt: str, n: int, k: int, groups: int, pf: int, sym: bool) -> dict:
    """Per-expert checkpoint tensors: name -> (shape, dim kinds, dtype).
    Kinds: "n"/"k" output/input, "n/pf", "k/pf" packed, "g" groups of k."""
    if fmt == "gptq":
        return {
            "qweight": ((k // pf, n), ("k/pf", "n"), torch.int32),
            "qzeros": ((groups, n // pf), ("g", "n/pf"), torch.int32),
            "scales": ((groups, n), ("g", "n"), torch.float32),
        }
    if fmt == "awq":
        return {
            "qweight": ((k, n // pf), ("k", "n/pf"), torch.int32),
            "qzeros": ((groups, n // pf), ("g", "n/pf"), torch.int32),
            "scales": ((groups, n), ("g", "n"), torch.float32),
        }
    specs = {
        "weight_packed": ((n, k // pf), ("n", "k/pf"), torch.int32),
        "weight_scale": ((n, groups), ("n", "g"), torch.float32),
    }
    if not sym:
        specs["weight_zero_point"] = ((n // pf, groups), ("n/pf", "g"), torch.int32)
    return specs


class ConvertedMoEExperts(CpuBackendMoEExperts):
    """Experts whose weights their MoE method converted at load; `install_experts`
    gives them `packs`, `n13` and `n2`, so there is nothing left to load here."""

    def process_weights_after_loading(self, layer):
        pass

    @staticmethod
    def require_supported(moe, where: str) -> None:
        """QuantConfigError `where: reason` for a layer our experts cannot run."""
        supported, reason = CpuBackendMoEExperts.is_supported_config(
            CpuBackendMoEExperts, moe, None, None, CpuBackendMoEExperts.activation_format())
        if not supported:
            raise QuantConfigError(f"{where}: {reason}")


class CpuBackendWNA16MoEExperts(ConvertedMoEExperts):
    """Grouped experts whose projections run on cpu_backend::wna16_linear."""

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input):
        p13, p2, bits = self.packs

        def lists(packs):
            empty = torch.empty(0, dtype=torch.int64)
            return ([p["qweight"] for p in packs], [p["scales"] for p in packs],
                    [p["zs"] for p in packs],
                    [empty if p["perm"] is None else p["perm"] for p in packs])

        output.copy_(torch.ops.cpu_backend.moe_experts_wna16(
            hidden_states, topk_weights, topk_ids, *lists(p13), *lists(p2), bits,
            p13[0]["group_size"], p2[0]["group_size"], self.n13, self.n2,
            ACTIVATIONS[activation], expert_map, apply_router_weight_on_input))


class CpuBackendWNA16MoEMethod(FusedMoEMethodBase):
    """Creates the experts' checkpoint tensors, converts them at load, runs our experts."""

    def __init__(self, quant_config, moe):
        super().__init__(moe)
        self.quant_config = quant_config
        ConvertedMoEExperts.require_supported(moe, f"{type(quant_config).__name__}: MoE layer")

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype, **extra_weight_attrs):
        cfg = self.quant_config
        fmt = {"gptq": "gptq", "awq": "awq"}.get(cfg.FORMAT, "ct")
        pf = cfg.pack_factor
        i, h = intermediate_size_per_partition, hidden_size
        self.fmt, self.num_experts = fmt, num_experts
        self.sym = getattr(cfg, "sym", True)
        for stem, n, k in (("w13", 2 * i, h), ("w2", h, i)):
            gs = k if cfg.group_size == -1 else cfg.group_size
            if k % gs or k % pf or n % pf or (stem == "w13" and (i % pf)):
                raise QuantConfigError(
                    f"{type(cfg).__name__}: MoE {stem} [{n} x {k}] per partition does not fit "
                    f"group_size={cfg.group_size} / {32 // pf}-bit packing")
            for name, (shape, kinds, dtype) in _specs(fmt, n, k, k // gs, pf, self.sym).items():
                self._register(layer, f"{stem}_{name}", (num_experts, *shape), kinds, dtype,
                               group_size=gs)
            if fmt == "gptq":  # g_idx of gate and up kept apart: they must agree
                rows = (num_experts, 2, k) if stem == "w13" else (num_experts, k)
                self._register(layer, f"{stem}_g_idx", rows, ("k",), torch.int32, group_size=gs)
            if fmt == "ct":  # weight_shape is read and checked, nothing else
                self._register(layer, f"{stem}_weight_shape", (num_experts, 2), (), torch.int64,
                               group_size=gs)

    def _register(self, layer, name, shape, kinds, dtype, group_size):
        param = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
        layer.register_parameter(name, param)
        set_weight_attrs(param, {"weight_loader": self._loader(layer, kinds, group_size)})

    @staticmethod
    def _loader(layer, kinds, group_size):
        def load(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
            loaded = loaded_weight
            e = layer._map_global_expert_id_to_local_expert_id(expert_id)
            if e == -1:
                return False if return_success else None
            rank = get_tensor_model_parallel_rank()
            dst = param.data[e]
            if not kinds:  # weight_shape: [n, k] of the shard, not used
                dst.copy_(loaded)
            elif shard_id in ("w1", "w3"):
                if kinds == ("k",):  # g_idx: the whole input
                    dst[0 if shard_id == "w1" else 1].copy_(loaded)
                else:
                    d = next(j for j, kd in enumerate(kinds) if kd.startswith("n"))
                    half = dst.shape[d] // 2
                    dst.narrow(d, 0 if shard_id == "w1" else half, half).copy_(
                        loaded.narrow(d, rank * half, half))
            else:  # w2: row parallel, sharded along its input
                d = next(j for j, kd in enumerate(kinds) if kd[0] in "kg")
                size = dst.shape[d]
                part = loaded.narrow(d, rank * size, size)
                if kinds == ("k",) and rank:  # global group ids -> this rank's
                    part = part - rank * (size // group_size)
                dst.copy_(part)
            return True if return_success else None

        return load

    def get_fused_moe_quant_config(self, layer):
        return FusedMoEQuantConfig.make()  # activations enter unquantized

    def _expert_view(self, layer, stem: str, e: int) -> dict:
        cfg, bits = self.quant_config, self.quant_config.bits
        t = {name[len(stem) + 1:]: p.data[e] for name, p in layer.named_parameters(recurse=False)
             if name.startswith(stem + "_")}
        if self.fmt == "gptq":
            g_idx = t["g_idx"]
            if stem == "w13":
                if not torch.equal(g_idx[0], g_idx[1]):
                    raise QuantConfigError(f"{type(cfg).__name__}: expert {e}: gate and up "
                                        "projections have different g_idx (act-order)")
                g_idx = g_idx[0]
            groups = t["scales"].shape[0]
            if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
                raise QuantConfigError(f"{type(cfg).__name__}: expert {e} {stem}: g_idx outside "
                                    f"this rank's {groups} groups (act-order with tensor "
                                    "parallelism is not supported for MoE experts)")
            view = formats.gptq_unpack(t["qweight"], t["qzeros"], t["scales"], g_idx, bits,
                                       cfg.checkpoint_format)
            if cfg.sym:
                view["zero"].fill_(1 << (bits - 1))
        elif self.fmt == "awq":
            view = formats.awq_unpack(t["qweight"], t["qzeros"], t["scales"], bits)
            if not cfg.zero_point:
                view["zero"].fill_(1 << (bits - 1))
        else:
            view = formats.ct_unpack(t["weight_packed"], t["weight_scale"],
                                     t.get("weight_zero_point"), bits)
        return formats.kernel_layout(view["q"], view["zero"], view["scale"], view["g_idx"], bits)

    def process_weights_after_loading(self, layer):
        from cpu_backend.ops import load

        load()
        packs = {stem: [self._expert_view(layer, stem, e) for e in range(self.num_experts)]
                 for stem in ("w13", "w2")}
        n13 = layer.w13_weight_packed.shape[1] if self.fmt == "ct" else \
            layer.w13_scales.shape[-1]
        n2 = layer.w2_weight_packed.shape[1] if self.fmt == "ct" else layer.w2_scales.shape[-1]
        for name in [n for n, _ in layer.named_parameters(recurse=False)
                     if n.startswith(("w13_", "w2_"))]:
            delattr(layer, name)
        install_experts(self, layer, CpuBackendWNA16MoEExperts, self.num_experts, n13, n2,
                        (packs["w13"], packs["w2"], self.quant_config.bits))

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        return self.moe_kernel.apply(
            hidden_states=x, w1=layer.w13_weight, w2=layer.w2_weight,
            topk_weights=topk_weights, topk_ids=topk_ids, activation=layer.activation,
            apply_router_weight_on_input=layer.apply_router_weight_on_input,
            global_num_experts=layer.global_num_experts, expert_map=layer.expert_map,
            shared_experts=shared_experts, shared_experts_input=shared_experts_input)
