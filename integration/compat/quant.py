"""Quantized copies of a matrix checkpoint, written directly in the on-disk
formats vLLM reads (no quantization tool fits the host's pins here, see
docs/compatibility.md), plus a *dequantized* fp32 copy as the reference.

Round-to-nearest, no calibration: the cell checks that our plugin runs the
format and computes what the format says, so the reference is transformers
fp32 on the dequantized weights (the quantization error is not the
plugin's), and activations are whatever the scheme prescribes.

- ``w8a8``: compressed-tensors ``int-quantized``: int8 weights, symmetric
  per-output-channel scales; int8 activations, dynamic per token.
- ``gptq``: GPTQ v1 ("gptq" quant_method): 4-bit symmetric, group 32,
  ``desc_act=false``; qweight int32 [in/8, out] packed along the input,
  qzeros int32 [in/g, out/8] storing zero-1 (the v1 quirk), scales fp16.
- ``awq``: AutoAWQ GEMM: 4-bit asymmetric with zero points, group 32;
  qweight int32 [in, out/8] and qzeros [in/g, out/8] packed along the output in
  AWQ's interleaved order [0, 2, 4, 6, 1, 3, 5, 7], scales fp16.

Which tensors: 2-D ``*.weight`` of projections (attention, MLP, experts);
never embeddings, norms, the LM head or MoE routers. GPT-2's Conv1D weights
are stored [in, out] and are handled in that orientation.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

GROUP = 32
DTYPE = {"w8a8": "bfloat16", "gptq": "bfloat16", "awq": "bfloat16"}
_SKIP = re.compile(r"(embed|norm|ln_|lm_head|wte|wpe|embed_out|\.gate\.weight$|shared_expert_gate)")
_CONV1D = re.compile(r"\.(c_attn|c_proj|c_fc)\.weight$")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def checkpoint(scheme: str, folder: str | Path) -> Path:
    """``<folder>-<scheme>``, written once (next to the source folder)."""
    from integration import models

    folder = Path(folder)
    return models._cached(folder.parent, f"{folder.name}-{scheme}", {"scheme": scheme, "group": GROUP,
                                                                     "quant_recipe": 3},
                          lambda out: _write(scheme, folder, out, dequantized=False))


def reference(scheme: str, folder: str | Path) -> Path:
    """fp32 copy of ``folder`` with every quantized weight replaced by its dequantized value."""
    from integration import models

    folder = Path(folder)
    return models._cached(folder.parent, f"{folder.name}-{scheme}-dequant",
                          {"scheme": scheme, "group": GROUP, "quant_recipe": 3, "dequantized": True},
                          lambda out: _write(scheme, folder, out, dequantized=True))


def _quantizable(name: str, t) -> bool:
    return name.endswith(".weight") and t.dim() == 2 and not _SKIP.search(name)


def _write(scheme: str, src: Path, out: Path, dequantized: bool) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from cpu_backend.tools.quantize import ROUTER_IGNORE, ROUTER_WEIGHT

    for item in src.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors") and not item.name.startswith("."):
            shutil.copy2(item, out / item.name)
    sd = load_file(str(src / "model.safetensors"))
    new: dict = {}
    for name, w in sd.items():
        if not _quantizable(name, w):
            new[name] = w
            continue
        conv1d = bool(_CONV1D.search(name))
        w_oi = (w.t() if conv1d else w).float()  # [out, in]
        base = name[: -len(".weight")]
        if scheme == "w8a8":
            q, scale = _int8_per_channel(w_oi)
            deq = q.float() * scale
            if dequantized:
                new[name] = (deq.t() if conv1d else deq).contiguous()
            else:
                new[name] = (q.t() if conv1d else q).contiguous()
                new[base + ".weight_scale"] = scale.to(torch.float32)
        else:
            q, zeros, scales = _int4_groups(w_oi, symmetric=scheme == "gptq")
            deq = _dequant_int4(q, zeros, scales)
            if dequantized:
                new[name] = (deq.t() if conv1d else deq).contiguous()
            elif scheme == "gptq":
                new.update(_pack_gptq(base, q, zeros, scales))
            else:
                new.update(_pack_awq(base, q, zeros, scales))
    save_file({k: v.contiguous() for k, v in new.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    if not dequantized:
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"] = _quant_config(scheme)
        if scheme == "w8a8" and any(ROUTER_WEIGHT.search(n) for n in sd):
            # MoE routers stay bf16: say so, as llm-compressor's MoE recipes do
            # (the host would otherwise build an int8 router for Qwen3-MoE).
            cfg["quantization_config"]["ignore"] += ROUTER_IGNORE
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _int8_per_channel(w):
    import torch

    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-8)
    q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return q, scale


def _int4_groups(w, symmetric: bool):
    """w [out, in] -> q uint4 values [out, in] (int32), zeros [out, in/G], scales [out, in/G]."""
    import torch

    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // GROUP, GROUP)
    if symmetric:
        scales = (g.abs().amax(-1) / 7.5).clamp(min=1e-8)  # maps to [-8, 7] around zero point 8
        zeros = torch.full_like(scales, 8, dtype=torch.int32)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scales = ((hi - lo) / 15).clamp(min=1e-8)
        zeros = torch.round(-lo / scales).clamp(0, 15).to(torch.int32)
    scales = scales.half().float()  # stored as fp16: quantize against the stored value
    q = torch.round(g / scales[..., None] + zeros[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(out_f, in_f), zeros, scales


def _dequant_int4(q, zeros, scales):
    out_f, in_f = q.shape
    g = q.reshape(out_f, in_f // GROUP, GROUP).float()
    return ((g - zeros[..., None].float()) * scales[..., None]).reshape(out_f, in_f)


def _pack(values):
    """Pack int32 values 0..15 along the last axis, 8 per int32, nibble j = element j."""
    import torch

    v = values.reshape(*values.shape[:-1], values.shape[-1] // 8, 8).to(torch.int64)
    packed = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for j in range(8):
        packed |= v[..., j] << (4 * j)
    return _to_int32(packed)


def _to_int32(x):
    import torch

    x = x & 0xFFFFFFFF
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _pack_gptq(base: str, q, zeros, scales) -> dict:
    import torch

    in_f = q.shape[1]
    return {
        # qweight[r, o] packs q[o, 8r .. 8r+7]: pack along the input dimension.
        base + ".qweight": _pack(q).t().contiguous(),
        base + ".qzeros": _pack((zeros - 1).t().contiguous()),  # [in/G, out/8]
        base + ".scales": scales.t().contiguous().half(),  # [in/G, out]
        base + ".g_idx": torch.arange(in_f, dtype=torch.int32) // GROUP,
    }


def _pack_awq(base: str, q, zeros, scales) -> dict:
    order = AWQ_ORDER

    def interleave(x):  # [..., out] -> AWQ order within each group of 8 columns
        shape = x.shape
        x = x.reshape(*shape[:-1], shape[-1] // 8, 8)[..., order]
        return x.reshape(shape)

    return {
        base + ".qweight": _pack(interleave(q.t().contiguous())),  # [in, out/8]
        base + ".qzeros": _pack(interleave(zeros.t().contiguous())),  # [in/G, out/8]
        base + ".scales": scales.t().contiguous().half(),  # [in/G, out]
    }


def _quant_config(scheme: str) -> dict:
    if scheme == "w8a8":
        return {
            "quant_method": "compressed-tensors",
            "format": "int-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                            "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                      "strategy": "token", "dynamic": True},
            }},
            "ignore": ["lm_head"],
        }
    if scheme == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
                "lm_head": False, "checkpoint_format": "gptq"}
    if scheme == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                "version": "gemm"}
    raise ValueError(scheme)
