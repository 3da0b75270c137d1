"""GPTQ / AWQ formats (cpu_backend.quantization.formats) and the checkpoint
writer (cpu_backend.tools.quantize) against independent dequantizers written
from AutoGPTQ's and AutoAWQ's code (plugin_tests/quant_reference.py), and the
config validation (errors name the key, before any weight is read).

Round-trips are exact: the reference dequantization of the packed tensors
equals formats.dequantize of the integer view (float64, both from the same fp16
scales). RTN error: |w - deq| <= scale / 2 + |w| 2^-10 (fp16 rounding of the scale).
"""

from __future__ import annotations

import json

import pytest
import torch

from cpu_backend.quantization import formats
from plugin_tests import quant_reference as ref

CASES = [
    (bits, gs, sym, act)
    for bits in (4, 8)
    for gs in (-1, 32, 64, 128)
    for sym in (True, False)
    for act in (False, True)
]


@pytest.mark.parametrize("bits,gs,sym,act", CASES)
def test_gptq_pack_matches_reference_dequant(bits, gs, sym, act):
    gen = torch.Generator().manual_seed(bits * 1000 + gs)
    n, k = 48, 256
    w = torch.randn(n, k, generator=gen) * 0.05
    perm = torch.randperm(k, generator=gen) if act else None
    v = formats.quantize_rtn(w, bits, gs, sym, perm)
    t = formats.gptq_pack(v["q"], v["zero"], v["scale"], v["g_idx"], bits)
    pf = 32 // bits
    groups = 1 if gs == -1 else k // gs
    assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (k // pf, n)
    assert t["qzeros"].dtype == torch.int32 and t["qzeros"].shape == (groups, n // pf)
    assert t["scales"].dtype == torch.float16 and t["scales"].shape == (groups, n)
    assert t["g_idx"].dtype == torch.int32 and t["g_idx"].shape == (k,)
    if sym and bits == 4:  # AutoGPTQ's v1 symmetric zeros: 7 in every nibble
        assert bool((t["qzeros"] == 0x77777777).all())
    want = ref.gptq_dequantize(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits)
    got = formats.dequantize(v["q"], v["zero"], v["scale"], v["g_idx"]).double()
    assert torch.equal(got, want)
    back = formats.gptq_unpack(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits)
    assert torch.equal(formats.dequantize(**back).double(), want)
    scale_per_elem = v["scale"][:, v["g_idx"].long()]
    assert bool(((w - got.float()).abs() <= scale_per_elem * 0.5 + w.abs() * 2**-10 + 1e-7).all())


@pytest.mark.parametrize("gs", [-1, 32, 64, 128])
def test_awq_pack_matches_reference_dequant(gs):
    gen = torch.Generator().manual_seed(gs + 7)
    n, k = 64, 256
    w = torch.randn(n, k, generator=gen) * 0.05
    v = formats.quantize_rtn(w, 4, gs, sym=False)
    t = formats.awq_pack(v["q"], v["zero"], v["scale"])
    groups = 1 if gs == -1 else k // gs
    assert t["qweight"].shape == (k, n // 8) and t["qweight"].dtype == torch.int32
    assert t["qzeros"].shape == (groups, n // 8) and t["scales"].shape == (groups, n)
    want = ref.awq_dequantize(t["qweight"], t["qzeros"], t["scales"], gs)
    got = formats.dequantize(v["q"], v["zero"], v["scale"], v["g_idx"]).double()
    assert torch.equal(got, want)
    back = formats.awq_unpack(t["qweight"], t["qzeros"], t["scales"])
    assert torch.equal(formats.dequantize(**back).double(), want)


def test_awq_order_is_autoawq_interleave():
    # column c of 8 sits in nibble AWQ_PACK_ORDER.index(c): 0,2,4,6,1,3,5,7
    q = torch.arange(8, dtype=torch.int32).view(8, 1).expand(8, 4).contiguous()  # [N=8, K=4]
    t = formats.awq_pack(q, torch.zeros(8, 1, dtype=torch.int32), torch.ones(8, 1))
    assert int(t["qweight"][0, 0]) == 0x75316420


def test_kernel_layout_act_order_groups():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(20, 64, generator=gen)
    v = formats.quantize_rtn(w, 4, 32, False, torch.randperm(64, generator=gen))
    lay = formats.kernel_layout(v["q"], v["zero"], v["scale"], v["g_idx"], 4)
    assert lay["perm"] is not None and lay["group_size"] == 32
    assert lay["qweight"].shape == (2, 8, 64) and lay["scales"].shape == (2, 2, 16)
    bad = v["g_idx"].clone()
    bad[0] = 1 - bad[0]
    with pytest.raises(ValueError, match="g_idx"):
        formats.kernel_layout(v["q"], v["zero"], v["scale"], bad, 4)


@pytest.mark.parametrize("bits, k, gs", [(4, 64, 32), (8, 64, 32), (4, 66, 33), (8, 6, 2)])
def test_kernel_layout_words(bits, k, gs):
    """Block b of panel p: 16 little-endian uint32, word c = sum_i q[16p + c, KW*b + i] << bits*i
    over the group-sorted inputs, each group zero-padded to whole words of KW = 32 / bits."""
    gen = torch.Generator().manual_seed(2)
    n = 20
    v = formats.quantize_rtn(torch.randn(n, k, generator=gen), bits, gs, False)
    lay = formats.kernel_layout(v["q"], v["zero"], v["scale"], v["g_idx"], bits)
    kw, g = 32 // bits, k // gs
    gsp = -(-gs // kw) * kw
    words = lay["qweight"].view(torch.int32).reshape(2, g * gsp // kw, 16).to(torch.int64) & 0xFFFFFFFF
    for p in range(2):
        for c in range(16):
            col = 16 * p + c
            padded = [0] * (g * gsp)
            if col < n:
                for j in range(k):
                    padded[(j // gs) * gsp + j % gs] = int(v["q"][col, j])
            for b in range(g * gsp // kw):
                want = sum(padded[kw * b + i] << (bits * i) for i in range(kw))
                assert int(words[p, b, c]) == want, (p, b, c)


# ------------------------------------------------------------- the tool ---


def _tiny_checkpoint(tmp_path):
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    src = tmp_path / "src"
    src.mkdir()
    state = {
        "model.embed_tokens.weight": torch.randn(32, 64, generator=gen).bfloat16(),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=gen).bfloat16(),
        "model.layers.0.mlp.down_proj.weight": torch.randn(64, 128, generator=gen).bfloat16(),
        "model.layers.0.input_layernorm.weight": torch.ones(64).bfloat16(),
        "lm_head.weight": torch.randn(32, 64, generator=gen).bfloat16(),
    }
    save_file(state, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (src / "tokenizer.json").write_text("{}")
    return src, state


@pytest.mark.parametrize("fmt,bits,gs,sym", [("gptq", 4, 32, True), ("gptq", 8, -1, False),
                                             ("awq", 4, 64, False)])
def test_tool_writes_the_tools_names_and_config(tmp_path, fmt, bits, gs, sym):
    from safetensors.torch import load_file

    from cpu_backend.tools.quantize import quantize_checkpoint

    src, state = _tiny_checkpoint(tmp_path)
    out = tmp_path / "out"
    quantize_checkpoint(src, out, fmt, bits, gs, sym)
    got = load_file(out / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == fmt and cfg["bits"] == bits and cfg["group_size"] == gs
    assert (out / "tokenizer.json").exists()
    assert torch.equal(got["lm_head.weight"], state["lm_head.weight"])
    assert torch.equal(got["model.layers.0.input_layernorm.weight"],
                       state["model.layers.0.input_layernorm.weight"])
    base = "model.layers.0.mlp.down_proj"
    assert f"{base}.weight" not in got
    w = state[f"{base}.weight"].float()
    if fmt == "gptq":
        assert json.loads((out / "quantize_config.json").read_text())["checkpoint_format"] == "gptq"
        deq = ref.gptq_dequantize(got[f"{base}.qweight"], got[f"{base}.qzeros"], got[f"{base}.scales"],
                                  got[f"{base}.g_idx"], bits)
        scales = got[f"{base}.scales"].float()
    else:
        assert set(json.loads((out / "quant_config.json").read_text())) == {
            "zero_point", "q_group_size", "w_bit", "version"}
        deq = ref.awq_dequantize(got[f"{base}.qweight"], got[f"{base}.qzeros"], got[f"{base}.scales"], gs)
        scales = got[f"{base}.scales"].float()
    step = scales.max()
    assert float((deq.float() - w).abs().max()) <= float(step) * 0.51


# ------------------------------------------------- config validation ---


def _gptq(**kw):
    return {"bits": 4, "group_size": 128, "desc_act": False, "sym": True, "quant_method": "gptq",
            "checkpoint_format": "gptq", **kw}


@pytest.mark.parametrize("cfg,key", [
    (_gptq(bits=3), "bits=3"),
    (_gptq(group_size=48), "group_size=48"),
    (_gptq(checkpoint_format="marlin"), "checkpoint_format"),
    (_gptq(frobnicate=1), "'frobnicate'"),
    (_gptq(dynamic={"-:.*": {}}), "'dynamic'"),
    (_gptq(lm_head=True), "lm_head"),
])
def test_gptq_config_errors_name_the_key(cfg, key):
    from cpu_backend.quantization.config import CpuBackendGPTQConfig, QuantConfigError

    with pytest.raises(QuantConfigError, match=key):
        CpuBackendGPTQConfig.from_config(cfg)


@pytest.mark.parametrize("cfg,key", [
    ({"quant_method": "awq", "bits": 8, "group_size": 128, "zero_point": True}, "bits=8"),
    ({"quant_method": "awq", "w_bit": 4, "q_group_size": 100, "zero_point": True}, "group_size=100"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "extra": 1}, "'extra'"),
])
def test_awq_config_errors_name_the_key(cfg, key):
    from cpu_backend.quantization.config import CpuBackendAWQConfig, QuantConfigError

    with pytest.raises(QuantConfigError, match=key):
        CpuBackendAWQConfig.from_config(cfg)


@pytest.mark.parametrize("bits,gs,sym", [(4, 64, True), (4, 32, False), (8, -1, True), (8, 128, False)])
def test_compressed_tensors_pack_matches_library_unpack(bits, gs, sym):
    gen = torch.Generator().manual_seed(bits + gs)
    n, k = 64, 256
    w = torch.randn(n, k, generator=gen) * 0.05
    v = formats.quantize_rtn(w, bits, gs, sym)
    t = formats.ct_pack(v["q"], v["zero"], v["scale"], bits, sym, torch.float32)
    assert t["weight_packed"].shape == (n, k * bits // 32) and t["weight_packed"].dtype == torch.int32
    assert ("weight_zero_point" in t) == (not sym)
    want = ref.ct_dequantize(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"),
                             bits, (n, k))
    got = formats.dequantize(v["q"], v["zero"], v["scale"], v["g_idx"]).double()
    assert torch.equal(got, want)
    back = formats.ct_unpack(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"), bits)
    assert torch.equal(formats.dequantize(**back).double(), want)


def test_compressed_tensors_pack_is_the_librarys():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = torch.randint(0, 16, (16, 64), dtype=torch.int32)
    ours = formats.pack_int32(q, 4, dim=1)
    theirs = pack_to_int32((q - 8).to(torch.int8), 4, packed_dim=1)
    assert torch.equal(ours, theirs)
    z = torch.randint(0, 256, (16, 4), dtype=torch.int32)
    assert torch.equal(formats.pack_int32(z, 8, dim=0),
                       pack_to_int32((z - 128).to(torch.int8), 8, packed_dim=0))


@pytest.mark.parametrize("weights,key", [
    ({"num_bits": 3, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64},
     "num_bits=3"),
    ({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 96},
     "group_size=96"),
    ({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "tensor"}, "strategy"),
    ({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64,
      "actorder": "group"}, "actorder"),
    ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64, "foo": 1}, "'foo'"),
])
def test_compressed_tensors_config_errors_name_the_key(weights, key):
    from cpu_backend.quantization.config import (
        CpuBackendCompressedTensorsWNA16Config,
        QuantConfigError,
    )

    cfg = {"quant_method": "compressed-tensors", "format": "pack-quantized",
           "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                         "format": "pack-quantized"}}}
    with pytest.raises(QuantConfigError, match=key):
        CpuBackendCompressedTensorsWNA16Config.from_config(cfg)


def test_compressed_tensors_w8a8_is_left_to_the_host():
    from cpu_backend.quantization.config import CpuBackendCompressedTensorsWNA16Config as C

    w8a8 = {"quant_method": "compressed-tensors", "format": "int-quantized",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "format": "int-quantized",
                "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
                "input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                                      "dynamic": True, "symmetric": True}}}}
    assert not C.claims(w8a8)
