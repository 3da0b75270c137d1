"""Write GPTQ or AWQ checkpoints from a Hugging Face model by round-to-nearest.

    python -m cpu_backend.tools.quantize MODEL_DIR OUT_DIR --format gptq \
        --bits 4 --group-size 128 [--asym] [--desc-act --calib-text FILE]
    python -m cpu_backend.tools.quantize MODEL_DIR OUT_DIR --format awq --group-size 128
    python -m cpu_backend.tools.quantize MODEL_DIR OUT_DIR --format compressed-tensors \
        --bits 4 --group-size 64 [--asym]          # W4A16 / W8A16 "pack-quantized"
    python -m cpu_backend.tools.quantize MODEL_DIR OUT_DIR --format compressed-tensors \
        --bits 8 --group-size -1 --activations dynamic   # W8A8 INT8 "int-quantized"
        (--activations static --calib-text FILE [--act-asym]: per-tensor input_scale)

Every 2-D `*.weight` inside the decoder blocks (`*.layers.<i>.*`) is quantized,
MoE experts included; embeddings, norms, MoE routers and the LM head are copied
unchanged. The output has the
tensor names, packing, dtypes and config keys AutoGPTQ / GPTQModel
(checkpoint_format "gptq", i.e. v1 zeros), AutoAWQ (version "gemm") and
llm-compressor (compressed-tensors 0.17 "pack-quantized", weight-only) write:
see cpu_backend/quantization/formats.py. Quantization is round-to-nearest per
group (no GPTQ error feedback, no AWQ scale search). --desc-act orders each
layer's inputs by their mean square activation on a calibration text (what
GPTQ's act-order uses) and writes the resulting g_idx.

W8A8 INT8 (`--activations dynamic|static`) is written with the
compressed-tensors library's own `calculate_qparams` / `quantize` (what
llm-compressor calls): `weight` int8 [N, K], `weight_scale` [N, 1] (model
dtype), symmetric per channel; static adds `input_scale` [1] (and
`input_zero_point` [1] int8 with --act-asym) from the min/max of each layer's
input on the calibration text; format "int-quantized".
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cpu_backend.quantization import formats

BLOCK_WEIGHT = re.compile(r"(^|\.)layers\.\d+\..+\.weight$")
GROUP_SIZES = (-1, 32, 64, 128)


# MoE routers ([experts x hidden]) stay in full precision, as AutoGPTQ,
# AutoAWQ and llm-compressor leave them; vLLM builds them unquantized.
ROUTER_WEIGHT = re.compile(r"\.(gate|shared_expert_gate)\.weight$")
# compressed-tensors configs name them in "ignore" (llm-compressor's MoE
# recipes do): vLLM passes the quant config to some routers (Qwen3-MoE).
ROUTER_IGNORE = ["re:.*\\.gate$", "re:.*shared_expert_gate$"]


def quantized_names(state: dict[str, torch.Tensor]) -> list[str]:
    return [n for n, t in state.items()
            if t.ndim == 2 and BLOCK_WEIGHT.search(n) and not ROUTER_WEIGHT.search(n)]


def _observe_inputs(model_dir: Path, text: str, names: list[str], observe, what: str) -> dict:
    """Runs the model (transformers, fp32) on `text` with `observe(stats, key, x)`
    called on each input `x` of the linear layers `names`; returns `stats`
    keyed by weight name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    wanted = {n.removesuffix(".weight") for n in names}
    stats: dict = {}
    hooks = [
        mod.register_forward_hook(lambda m, inp, out, key=mod_name: observe(stats, key, inp[0].detach().float()))
        for mod_name, mod in model.named_modules() if mod_name in wanted
    ]
    ids = tok(text, return_tensors="pt").input_ids[:, :2048]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    missing = wanted - stats.keys()
    if missing:
        raise SystemExit(f"{what}: calibration did not reach {sorted(missing)[:3]}")
    return {f"{k}.weight": v for k, v in stats.items()}


def input_energy(model_dir: Path, text: str, names: list[str]) -> dict[str, torch.Tensor]:
    """Mean x^2 per input feature of each linear layer on `text`."""
    def observe(stats, key, x):
        x = x.reshape(-1, x.shape[-1])
        stats[key] = stats.get(key, 0) + (x * x).mean(0)

    return _observe_inputs(model_dir, text, names, observe, "--desc-act")


def input_ranges(model_dir: Path, text: str, names: list[str]) -> dict[str, tuple[float, float]]:
    """(min, max) of each linear layer's input on `text`."""
    def observe(stats, key, x):
        lo, hi = stats.get(key, (0.0, 0.0))
        stats[key] = (min(lo, float(x.min())), max(hi, float(x.max())))

    return _observe_inputs(model_dir, text, names, observe, "--activations static")


def w8a8_args(activations: str, act_sym: bool):
    """compressed-tensors QuantizationArgs of llm-compressor's W8A8 INT8 scheme
    (dynamic: its "W8A8" preset; static: per-tensor input scale)."""
    from compressed_tensors.quantization import QuantizationArgs

    weights = QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True,
                               dynamic=False, observer="minmax")
    if activations == "dynamic":
        acts = QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=act_sym,
                                dynamic=True, observer=None)
    else:
        acts = QuantizationArgs(num_bits=8, type="int", strategy="tensor", symmetric=act_sym,
                                dynamic=False, observer="minmax")
    return weights, acts


def w8a8_tensors(w: torch.Tensor, wargs, aargs, act_range, scale_dtype) -> dict[str, torch.Tensor]:
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    w = w.float()
    scale, zp = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), wargs)
    scale = scale.to(scale_dtype)
    out = {"weight": quantize(w, scale.float(), zp, wargs, dtype=torch.int8),
           "weight_scale": scale}
    if act_range is not None:
        s, z = calculate_qparams(torch.tensor([act_range[0]]), torch.tensor([act_range[1]]), aargs)
        out["input_scale"] = s.to(scale_dtype)
        if not aargs.symmetric:
            out["input_zero_point"] = z.to(torch.int8)
    return out


def quantize_checkpoint(model_dir, out_dir, fmt: str, bits: int, group_size: int,
                        sym: bool = True, desc_act: bool = False, calib_text: str | None = None,
                        dtype: torch.dtype | None = None, activations: str = "none",
                        act_sym: bool = True) -> dict:
    """Write the checkpoint; returns its quantization_config."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if activations not in ("none", "dynamic", "static"):
        raise SystemExit(f"--activations must be none, dynamic or static, got {activations!r}")
    w8a8 = activations != "none"
    if w8a8 and (fmt != "compressed-tensors" or bits != 8 or group_size != -1 or not sym
                 or desc_act):
        raise SystemExit("--activations (W8A8 INT8) needs --format compressed-tensors --bits 8 "
                         "--group-size -1, symmetric weights, no --desc-act")
    if activations == "static" and not calib_text:
        raise SystemExit("--activations static needs --calib-text (input scales are calibrated)")
    if fmt not in ("gptq", "awq", "compressed-tensors"):
        raise SystemExit(f"--format must be gptq, awq or compressed-tensors, got {fmt!r}")
    if fmt == "compressed-tensors" and desc_act:
        raise SystemExit("compressed-tensors: --desc-act is not written (actorder null only)")
    if group_size not in GROUP_SIZES:
        raise SystemExit(f"--group-size must be one of {GROUP_SIZES}, got {group_size}")
    if fmt == "awq" and (bits != 4 or desc_act or sym):
        raise SystemExit("AWQ (GEMM) is 4-bit, asymmetric (zero points), no desc_act")
    if bits not in (4, 8):
        raise SystemExit(f"--bits must be 4 or 8, got {bits}")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"no *.safetensors in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    names = quantized_names(state)
    energy = None
    ranges = input_ranges(model_dir, calib_text, names) if activations == "static" else None
    if w8a8:
        wargs, aargs = w8a8_args(activations, act_sym)
    if desc_act:
        if not calib_text:
            raise SystemExit("--desc-act needs --calib-text (act-order is by activation size)")
        energy = input_energy(model_dir, calib_text, names)

    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name not in names:
            out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
            continue
        base = name.removesuffix(".weight")
        if w8a8:
            scale_dtype = dtype if dtype is not None else t.dtype
            tensors = w8a8_tensors(t, wargs, aargs, ranges[name] if ranges else None, scale_dtype)
            for suffix, tensor in tensors.items():
                out[f"{base}.{suffix}"] = tensor
            continue
        perm = None
        if energy is not None:
            perm = torch.argsort(energy[name], descending=True, stable=True)
        v = formats.quantize_rtn(t, bits, group_size, sym, perm)
        if fmt == "gptq":
            tensors = formats.gptq_pack(v["q"], v["zero"], v["scale"], v["g_idx"], bits)
        elif fmt == "compressed-tensors":
            scale_dtype = t.dtype if t.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
            tensors = formats.ct_pack(v["q"], v["zero"], v["scale"], bits, sym, scale_dtype)
        else:
            tensors = formats.awq_pack(v["q"], v["zero"], v["scale"], bits)
        for suffix, tensor in tensors.items():
            out[f"{base}.{suffix}"] = tensor

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, out_dir / "model.safetensors",
              metadata={"format": "pt"})
    ignore = ["lm_head"] + (ROUTER_IGNORE if any(ROUTER_WEIGHT.search(n) for n in state) else [])
    if fmt == "gptq":
        qcfg = {"bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
                "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
                "checkpoint_format": "gptq", "model_name_or_path": None,
                "model_file_base_name": "model", "quant_method": "gptq"}
        (out_dir / "quantize_config.json").write_text(json.dumps(qcfg, indent=2))
    elif w8a8:
        group = {"targets": ["Linear"], "weights": wargs.model_dump(mode="json"),
                 "input_activations": aargs.model_dump(mode="json"),
                 "output_activations": None, "format": "int-quantized"}
        qcfg = {"quant_method": "compressed-tensors", "format": "int-quantized",
                "quantization_status": "compressed", "global_compression_ratio": None,
                "config_groups": {"group_0": group}, "ignore": ignore,
                "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
                "version": "0.17.0"}
    elif fmt == "compressed-tensors":
        weights = {"num_bits": bits, "type": "int", "symmetric": sym,
                   "strategy": "channel" if group_size == -1 else "group",
                   "group_size": None if group_size == -1 else group_size,
                   "dynamic": False, "actorder": None, "observer": "minmax",
                   "observer_kwargs": {}, "block_structure": None}
        qcfg = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "quantization_status": "compressed", "global_compression_ratio": None,
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": None,
                                              "output_activations": None,
                                              "format": "pack-quantized"}},
                "ignore": ignore, "kv_cache_scheme": None, "sparsity_config": {},
                "transform_config": {}, "version": "0.17.0"}
    else:
        qcfg = {"quant_method": "awq", "zero_point": True, "group_size": group_size, "bits": bits,
                "version": "gemm", "modules_to_not_convert": None}
        (out_dir / "quant_config.json").write_text(json.dumps(
            {"zero_point": True, "q_group_size": group_size, "w_bit": bits, "version": "GEMM"},
            indent=2))
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = qcfg
    if dtype is not None:
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for f in model_dir.iterdir():
        if f.is_file() and not f.name.startswith(".") and f.suffix != ".safetensors" and f.name not in (
                "config.json", "quantize_config.json", "quant_config.json",
                "model.safetensors.index.json"):
            shutil.copy2(f, out_dir / f.name)
    return qcfg


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m cpu_backend.tools.quantize", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("out_dir")
    p.add_argument("--format", required=True, choices=("gptq", "awq", "compressed-tensors"))
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--asym", action="store_true",
                   help="GPTQ / compressed-tensors: zero points (AWQ always has them)")
    p.add_argument("--desc-act", action="store_true", help="GPTQ act-order (needs --calib-text)")
    p.add_argument("--calib-text", help="a text file for --desc-act / --activations static")
    p.add_argument("--activations", default="none", choices=("none", "dynamic", "static"),
                   help="compressed-tensors W8A8 INT8: int8 activations per token (dynamic) or "
                        "with a calibrated per-tensor scale (static)")
    p.add_argument("--act-asym", action="store_true", help="W8A8: asymmetric activations")
    a = p.parse_args(argv)
    text = Path(a.calib_text).read_text() if a.calib_text else None
    sym = not a.asym and a.format != "awq"
    cfg = quantize_checkpoint(a.model_dir, a.out_dir, a.format, a.bits, a.group_size, sym,
                              a.desc_act, text, activations=a.activations,
                              act_sym=not a.act_asym)
    print(json.dumps(cfg))


if __name__ == "__main__":
    main()
