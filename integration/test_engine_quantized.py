"""GPTQ, AWQ and compressed-tensors (W4A16, W8A16) checkpoints written by
`cpu_backend.tools.quantize` from the tiny random Llama, run through `LLM.generate`
on our weight-only kernel with the
AVX2 kernel library (VLLM_CPU_BACKEND_ISA=avx2, the tier the host's
cpu_gemm_wna16 lacks), against transformers running the dequantized model in
fp32: the reference weights come from plugin_tests/quant_reference.py (AutoGPTQ's
and AutoAWQ's dequantization, compressed-tensors' own unpacking), not from the code
under test.

Greedy continuations must be equal (fp32 activations on both sides; the tiny
model's greedy top-2 margins are > 1e-2, the kernel's fp32 error is ~1e-6).
The worker report proves our linear method ran and which library it used.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from integration import models
from integration.conftest import greedy, hf_greedy, report, running_llm
from plugin_tests import quant_reference as ref

NEW_TOKENS = 24
CASES = {
    # name: (format, bits, group_size, sym, desc_act)
    "gptq-4bit-g32-sym-act-order": ("gptq", 4, 32, True, True),
    "gptq-8bit-perchannel-asym": ("gptq", 8, -1, False, False),
    "awq-4bit-g64": ("awq", 4, 64, False, False),
    "ct-w4a16-g64-asym": ("compressed-tensors", 4, 64, False, False),
    "ct-w8a16-channel-sym": ("compressed-tensors", 8, -1, True, False),
}
OUR_CONFIG = {"gptq": "cpu_backend_gptq", "awq": "cpu_backend_awq",
              "compressed-tensors": "cpu_backend_ct_wna16"}


def dequantized_reference(qdir: Path, out: Path) -> Path:
    """The quantized checkpoint as a plain fp32 HF model (reference dequantizers)."""
    import torch
    from safetensors.torch import load_file, save_file

    cfg = json.loads((qdir / "config.json").read_text())
    q = cfg.pop("quantization_config")
    state = load_file(qdir / "model.safetensors")
    dense = {}
    for name, t in state.items():
        base, _, suffix = name.rpartition(".")
        if suffix in ("qzeros", "scales", "g_idx", "weight_scale", "weight_zero_point",
                      "weight_shape"):
            continue
        if suffix == "weight_packed":
            w = ref.ct_dequantize(t, state[f"{base}.weight_scale"],
                                  state.get(f"{base}.weight_zero_point"),
                                  q["config_groups"]["group_0"]["weights"]["num_bits"],
                                  state[f"{base}.weight_shape"].tolist())
            dense[f"{base}.weight"] = w.float().contiguous()
        elif suffix == "qweight":
            if q["quant_method"] == "gptq":
                w = ref.gptq_dequantize(t, state[f"{base}.qzeros"], state[f"{base}.scales"],
                                        state[f"{base}.g_idx"], q["bits"])
            else:
                w = ref.awq_dequantize(t, state[f"{base}.qzeros"], state[f"{base}.scales"],
                                       q["group_size"])
            dense[f"{base}.weight"] = w.float().contiguous()
        else:
            dense[name] = t.float()
    out.mkdir(parents=True, exist_ok=True)
    save_file(dense, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg))
    for f in qdir.iterdir():
        if f.name not in ("config.json", "model.safetensors", "quantize_config.json",
                          "quant_config.json"):
            (out / f.name).write_bytes(f.read_bytes())
    return out


@pytest.fixture(scope="module")
def checkpoints(tiny_llama, tmp_path_factory):
    from cpu_backend.tools.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("quantized")
    calib = "\n".join(models.TINY_PROMPTS) * 8
    made = {}
    for name, (fmt, bits, gs, sym, act) in CASES.items():
        qdir = root / name
        quantize_checkpoint(tiny_llama, qdir, fmt, bits, gs, sym, act, calib if act else None)
        made[name] = (qdir, dequantized_reference(qdir, root / f"{name}-dequantized"))
    return made


def random_prompts(lengths, vocab=700, seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_quantized_checkpoint_matches_dequantized_transformers(case, checkpoints, monkeypatch):
    from cpu_backend.quantization import register

    # What the `vllm.general_plugins` entry point does in an installed package.
    from cpu_backend import isa

    register()
    if "avx2" not in isa.supported_paths():
        pytest.skip("this CPU cannot run the avx2 library")
    monkeypatch.setenv("VLLM_CPU_BACKEND_ISA", "avx2")
    qdir, dense = checkpoints[case]
    prompts = random_prompts([1, 6, 17, 40])
    with running_llm(str(qdir), dtype="float32", block_size=16) as llm:
        fmt = CASES[case][0]
        assert llm.llm_engine.vllm_config.model_config.quantization == OUR_CONFIG[fmt]
        got = [list(o.outputs[0].token_ids) for o in greedy(llm, prompts, NEW_TOKENS)]
        rep = report(llm)
    assert rep["kernels_isa"] == "avx2"
    assert "WNA16LinearMethod" in rep["linear_methods"]
    assert rep["wna16_linear_calls"] > 0
    want = hf_greedy(str(dense), prompts, NEW_TOKENS)
    assert got == want


@pytest.mark.parametrize("key,value,message", [
    ("bits", 3, "bits=3"),
    ("group_size", 48, "group_size=48"),
    ("frobnicate", 1, "'frobnicate'"),
])
def test_unsupported_checkpoint_fails_before_loading_weights(key, value, message, checkpoints,
                                                            tmp_path):
    """The engine refuses the config itself: model.safetensors is not even there."""
    from cpu_backend.quantization import register

    register()
    qdir, _ = checkpoints["gptq-8bit-perchannel-asym"]
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in qdir.iterdir():
        if f.name != "model.safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"][key] = value
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match=rf"{message}.*not supported by cpu_backend"):
        with running_llm(str(bad), dtype="float32"):
            pass
