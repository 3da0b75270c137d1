"""compressed-tensors W8A8 INT8: the tool's checkpoint, the config hook, and
loading a layer through our scheme against an independent reference.

- the tool writes what llm-compressor writes ("int-quantized": `weight` int8
  [N, K], `weight_scale` [N, 1], static `input_scale` [1] / `input_zero_point`
  [1] int8), the config parses with the compressed-tensors library, and the
  library's own `dequantize` of our tensors is within half a step of the
  original weights;
- our config claims W8A8 INT8 checkpoints only and swaps the host's
  CompressedTensorsW8A8Int8 for ours, other schemes unchanged;
- a layer built by our scheme (host parameter classes and loaders) and fed the
  tool's tensors computes what the reference computes: fake-quantized x
  (plugin_tests/test_kernels_w8a8.ref_quantize) @ (q * scale)^T, tolerance
  1e-5 relative to |x_fq| @ |W|^T.
"""

from __future__ import annotations

import json

import pytest
import torch

from plugin_tests.test_kernels_w8a8 import ref_quantize
from plugin_tests.test_quant_formats import _tiny_checkpoint


@pytest.fixture(scope="module", autouse=True)
def _registered():
    from cpu_backend.quantization import register

    register()


@pytest.fixture(scope="module")
def tp1():
    """A one-process gloo group: the host's parameter classes read the TP rank."""
    import socket

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    with set_current_vllm_config(VllmConfig()):
        if ps.model_parallel_is_initialized():
            yield
            return
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{port}")
        ps.initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()


@pytest.mark.parametrize("acts,sym", [("dynamic", True), ("dynamic", False), ("static", True),
                                      ("static", False)])
def test_tool_writes_llm_compressor_w8a8(tmp_path, acts, sym, monkeypatch):
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file

    from cpu_backend.tools import quantize as tool

    src, state = _tiny_checkpoint(tmp_path)
    out = tmp_path / "out"
    ranges = {n: (-3.0, 5.0) for n in tool.quantized_names(state)}
    monkeypatch.setattr(tool, "input_ranges", lambda *a: ranges)  # no model to calibrate here
    tool.quantize_checkpoint(src, out, "compressed-tensors", 8, -1, True, calib_text="x",
                             activations=acts, act_sym=sym)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(cfg)
    assert parsed.format == "int-quantized" and cfg["ignore"] == ["lm_head"]
    group = parsed.config_groups["group_0"]
    assert group.targets == ["Linear"] and group.weights.strategy == "channel"
    assert group.input_activations.dynamic == (acts == "dynamic")
    assert group.input_activations.strategy == ("token" if acts == "dynamic" else "tensor")
    assert group.input_activations.symmetric == sym
    got = load_file(out / "model.safetensors")
    base = "model.layers.0.mlp.down_proj"
    w = state[f"{base}.weight"].float()
    q, s = got[f"{base}.weight"], got[f"{base}.weight_scale"]
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert s.shape == (w.shape[0], 1) and s.dtype == torch.bfloat16
    assert (f"{base}.input_scale" in got) == (acts == "static")
    assert (f"{base}.input_zero_point" in got) == (acts == "static" and not sym)
    if acts == "static":
        assert got[f"{base}.input_scale"].shape == (1,)
        if not sym:
            assert got[f"{base}.input_zero_point"].dtype == torch.int8
    assert f"{base}.weight_zero_point" not in got
    deq = dequantize(q, s.float(), torch.zeros_like(s, dtype=torch.int8))
    assert torch.equal(deq, q.float() * s.float())
    assert float(((deq - w).abs() / s.float()).max()) <= 0.51 + 2**-7  # bf16 scale rounding
    assert torch.equal(got["lm_head.weight"], state["lm_head.weight"])


def _w8a8_cfg(acts: str = "dynamic", sym: bool = True, wtype: str = "int") -> dict:
    a = {"num_bits": 8, "type": "int", "symmetric": sym, "dynamic": acts == "dynamic",
         "strategy": "token" if acts == "dynamic" else "tensor"}
    return {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": a,
                "weights": {"num_bits": 8, "type": wtype, "symmetric": True, "dynamic": False,
                            "strategy": "channel"}}}}


def test_config_claims_w8a8_int8_only():
    from cpu_backend.quantization.config import CpuBackendCompressedTensorsWNA16Config
    from cpu_backend.quantization.w8a8 import CpuBackendCompressedTensorsW8A8Config as C

    assert C.override_quantization_method(_w8a8_cfg(), None) == "cpu_backend_ct_w8a8"
    assert C.override_quantization_method(_w8a8_cfg("static", False), None) == "cpu_backend_ct_w8a8"
    assert C.override_quantization_method(_w8a8_cfg(wtype="float"), None) is None  # fp8: host
    wna16 = _w8a8_cfg()
    wna16["config_groups"]["group_0"]["input_activations"] = None
    assert C.override_quantization_method(wna16, None) is None
    assert CpuBackendCompressedTensorsWNA16Config.override_quantization_method(_w8a8_cfg(), None) is None


def _layer(acts: str, sym: bool, tensors: dict, shards=None):
    """A module built by our scheme through the host's config, loaded like the host does."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    from cpu_backend.quantization.w8a8 import CpuBackendCompressedTensorsW8A8Config, CpuBackendW8A8Int8

    cfg = CpuBackendCompressedTensorsW8A8Config.from_config(_w8a8_cfg(acts, sym))
    host = CompressedTensorsConfig.from_config(_w8a8_cfg(acts, sym))
    (args,) = [cfg.target_scheme_map["Linear"]]
    scheme = cfg._get_scheme_from_parts(args["weights"], args["input_activations"])
    host_scheme = host._get_scheme_from_parts(args["weights"], args["input_activations"])
    assert type(scheme) is CpuBackendW8A8Int8
    assert type(host_scheme).__name__ == "CompressedTensorsW8A8Int8"
    n, k = tensors["weight"].shape
    layer = torch.nn.Module()
    loaded = []

    def loader(param, value):
        param.data.copy_(value.reshape(param.shape))
        loaded.append(param)

    scheme.create_weights(layer, shards or [n], k, torch.float32, loader)
    for name, value in tensors.items():
        getattr(layer, name).weight_loader(getattr(layer, name), value)
    scheme.process_weights_after_loading(layer)
    return layer, scheme


@pytest.mark.parametrize("acts,sym", [("dynamic", True), ("dynamic", False), ("static", True),
                                      ("static", False)])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_scheme_layer_matches_fake_quant_reference(acts, sym, dt, tp1):
    gen = torch.Generator().manual_seed(3)
    n, k = 72, 100
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    s = torch.rand(n, 1, generator=gen) * 0.01 + 1e-3
    tensors = {"weight": q, "weight_scale": s}
    scale, zp = (0.05, -7) if acts == "static" else (None, None)
    if acts == "static":
        tensors["input_scale"] = torch.tensor([scale])
        if not sym:
            tensors["input_zero_point"] = torch.tensor([zp], dtype=torch.int8)
    layer, scheme = _layer(acts, sym, tensors)
    assert layer.weight is None and not any(p is not None for p in layer.parameters())
    x = (torch.randn(5, k, generator=gen) * 3).to(dt)
    bias = torch.randn(n, generator=gen).to(dt)
    y = scheme.apply_weights(layer, x, bias)
    rq, rs, rz = ref_quantize(x, scale, zp if not sym else None, sym)
    xf = (rq.double() - rz[:, None].double()) * rs[:, None].double()
    wd = q.double() * s.double()
    want = xf @ wd.T + bias.double()
    tol = 1e-5 * (xf.abs() @ wd.abs().T + bias.double().abs()) + (2**-8 if dt == torch.bfloat16 else 0) * want.abs()
    assert y.dtype == dt
    assert bool(((y.double() - want).abs() <= tol).all())


def test_per_tensor_weight_scales_of_fused_shards(tp1):
    """strategy "tensor": one weight scale per fused shard, expanded per channel."""
    from cpu_backend.quantization.w8a8 import CpuBackendW8A8Int8

    gen = torch.Generator().manual_seed(4)
    q = torch.randint(-128, 128, (48, 32), dtype=torch.int8, generator=gen)
    scheme = CpuBackendW8A8Int8("tensor", False, True)
    layer = torch.nn.Module()
    scheme.create_weights(layer, [16, 32], 32, torch.float32, None)
    layer.weight.data.copy_(q)
    layer.weight_scale.data.copy_(torch.tensor([0.01, 0.02]))
    scheme.process_weights_after_loading(layer)
    x = torch.randn(3, 32, generator=gen)
    rq, rs, _ = ref_quantize(x)
    ws = torch.cat([torch.full((16,), 0.01), torch.full((32,), 0.02)]).double()
    want = (rq.double() * rs[:, None].double()) @ (q.double() * ws[:, None]).T
    y = scheme.apply_weights(layer, x, None)
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-6)


def test_float_weight_for_an_int8_layer_is_refused(tp1):
    """A layer the checkpoint left unquantized but the config does not ignore
    (e.g. an MoE router missing from `ignore`) used to load its float weight
    into the int8 parameter silently (garbage out): now an error naming the
    tensor and the fix."""
    from cpu_backend.quantization.checks import QuantWeightError

    w = torch.randn(16, 32)
    with pytest.raises(QuantWeightError, match=r"weight: checkpoint tensor is \(16, 32\) float32, "
                                               r"expected int8 .*ignore"):
        _layer("dynamic", True, {"weight": w, "weight_scale": torch.ones(16, 1)})
