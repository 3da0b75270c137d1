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
The 4-bit checkpoints run again with W4A8 (int8 activations per 32 inputs, the
default), against the same reference with its linears' inputs quantized alike.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from integration import models
from integration.conftest import greedy, hf_greedy, report, running_llm
from plugin_tests import quant_reference as ref

# The references are the checkpoints' dequantized weights, head included.
pytestmark = pytest.mark.usefixtures("exact_lm_head")

NEW_TOKENS = 24
NEAR_TIE = 0.1  # logits: W4A8 may part ways with its reference only at a closer top-2
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
    monkeypatch.setenv("VLLM_CPU_INT4_W4A8", "0")  # weight-only: activations stay fp32
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
    assert rep["wna16_int8_act_layers"] == 0
    # decode steps replayed each norm and SiLU-and-mul with the int4 linear
    # reading its result as one call (step_graphs._COMPOSITES)
    replayed = rep["step_graphs"]["op_calls"]
    for composite in ("fused_add_rms_norm_wna16_linear_out", "silu_and_mul_wna16_linear_out"):
        assert replayed.get(f"cpu_backend::{composite}", 0) > 0, replayed
    want = hf_greedy(str(dense), prompts, NEW_TOKENS)
    assert got == want


def int8_activation_hooks(qdir: Path):
    """prepare() for hf_greedy: every linear that is quantized in the checkpoint
    gets its input quantized as the W4A8 path does (plugin_tests/quant_reference.py
    int8_activations_per32; act-order inputs taken in g_idx order, stably)."""
    import torch
    from safetensors.torch import load_file

    state = load_file(qdir / "model.safetensors")
    quantized = {name.rpartition(".")[0] for name in state
                 if name.endswith((".qweight", ".weight_packed"))}

    def prepare(model):
        for name, module in model.named_modules():
            if name not in quantized:
                continue
            g_idx = state.get(f"{name}.g_idx")
            perm = None
            if g_idx is not None:
                order = torch.sort(g_idx.long(), stable=True).indices
                if not bool((order == torch.arange(len(order))).all()):
                    perm = order

            def hook(mod, args, perm=perm):
                return (ref.int8_activations_per32(args[0], perm).to(args[0].dtype),)

            module.register_forward_pre_hook(hook)
    return prepare


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gptq-4bit-g32-sym-act-order", "awq-4bit-g64", "ct-w4a16-g64-asym"])
def test_w4a8_matches_transformers_with_int8_activations(case, checkpoints, monkeypatch):
    """VLLM_CPU_INT4_W4A8 (the host's flag, default on): 4-bit layers quantize
    their input to int8 per 32 inputs. Reference: the dequantized model in
    transformers with each quantized linear's input quantized the same way;
    greedy continuations equal (prefill and decode both run W4A8), except
    after a near-tie: rounding x to 8 bits turns fp32-level differences between
    the two implementations into one-step differences of single inputs, which
    can flip a top-2 that close (seen: 0.026 logits apart). A prompt may then
    part ways where the reference's top-2 are within NEAR_TIE and ours took the
    other of the two; at most one prompt of four."""
    from cpu_backend import isa
    from cpu_backend.quantization import register

    register()
    if "avx2" not in isa.supported_paths():
        pytest.skip("this CPU cannot run the avx2 library")
    monkeypatch.setenv("VLLM_CPU_BACKEND_ISA", "avx2")
    monkeypatch.delenv("VLLM_CPU_INT4_W4A8", raising=False)
    qdir, dense = checkpoints[case]
    prompts = random_prompts([1, 6, 17, 40])
    with running_llm(str(qdir), dtype="float32", block_size=16) as llm:
        got = [list(o.outputs[0].token_ids) for o in greedy(llm, prompts, NEW_TOKENS)]
        rep = report(llm)
    assert rep["kernels_isa"] == "avx2"
    assert rep["wna16_int8_act_layers"] > 0
    prepare = int8_activation_hooks(qdir)
    want = hf_greedy(str(dense), prompts, NEW_TOKENS, prepare=prepare)
    parted = [(i, next(j for j, (a, b) in enumerate(zip(g, w)) if a != b))
              for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert len(parted) <= 1, parted
    for i, j in parted:
        margin = hf_logit_gap(str(dense), prompts[i] + want[i][:j], want[i][j], got[i][j], prepare)
        assert 0 <= margin < NEAR_TIE, (i, j, margin)


def hf_logit_gap(model: str, context: list[int], first: int, second: int, prepare) -> float:
    """The reference's next-token logit of `first` minus that of `second`."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    hf.eval()
    prepare(hf)
    with torch.no_grad():
        logits = hf(torch.tensor([context])).logits[0, -1]
    return float(logits[first] - logits[second])


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
