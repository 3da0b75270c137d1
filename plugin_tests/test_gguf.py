"""GGUF files (cpu_backend.gguf): block decoding, kernels, layer methods, bad files.

- Every block type we load (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K),
  from random bytes (random fp16 scales): cpu_backend.gguf.blocks.dequantize
  equals the `gguf` package's numpy dequantizer (llama.cpp's
  dequantize_row_* in numpy: an independent reference) bit for bit.
- On every ISA library: the layer methods (GGUFLinearMethod on fused layers
  whose shards mix block types, float shards included; GGUFEmbeddingMethod's
  logits) against float64 x @ dequant(W)^T + b (float shards as stored, in
  the model dtype), with the tolerance of
  test_kernels_wna16.py (|y - ref| <= 1e-4 (|x| @ |W|^T + |b|) + 1e-5, one
  more rounding for bf16 outputs); with W4A8 (the host's VLLM_CPU_INT4_W4A8)
  the 4-bit types against the int8-quantized activations of the independent
  reference (quant_reference.int8_activations_per32). The embedding lookup
  returns the dequantized rows exactly.
- Bad files: missing, not GGUF, truncated, an architecture or block type we
  do not run: GGUFFileError naming the file and the reason.
"""

from __future__ import annotations

import json
import sys

import pytest

try:
    from plugin_tests.isa_worker import ISA_PATHS, run_worker
except ImportError:  # run as the worker script
    ISA_PATHS, run_worker = [], None

# where each block type keeps its fp16 scale / min fields
HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, rows: int, k: int, gen, scale: float = 0.02):
    """Random raw blocks [rows, k / block_elems, block_bytes], fp16 fields finite."""
    import torch

    from cpu_backend.gguf import blocks

    bt = blocks.BY_NAME[type_name]
    raw = torch.randint(0, 256, (rows, k // bt.block_elems, bt.block_bytes), generator=gen,
                        dtype=torch.uint8)
    for pos in HALF_FIELDS[type_name]:
        half = (torch.randn(rows, raw.shape[1], generator=gen) * scale).half()
        raw[..., pos:pos + 2] = half.view(torch.uint8).reshape(rows, raw.shape[1], 2)
    return raw


def test_every_block_type_dequantizes_bit_for_bit_like_gguf():
    import gguf
    import numpy as np
    import torch

    from cpu_backend.gguf import blocks

    gen = torch.Generator().manual_seed(0)
    assert sorted(HALF_FIELDS) == sorted(blocks.BY_NAME)
    for type_name, bt in blocks.BY_NAME.items():
        raw = random_blocks(type_name, 37, 4 * 256, gen, scale=1.0)
        ref = gguf.quants.dequantize(raw.reshape(37, -1).numpy(),
                                     gguf.GGMLQuantizationType[type_name])
        got = blocks.dequantize(raw).numpy()
        assert got.shape == ref.shape == (37, 1024)
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), type_name
        view = blocks.decode(raw)
        assert view.bits == bt.bits and view.group_size == bt.group_size
        assert int(view.q.max()) < (1 << bt.bits)


def _worker() -> dict:
    import os

    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from cpu_backend import ops
    from cpu_backend.gguf import blocks, quant
    from plugin_tests import quant_reference as ref

    isa = ops.load()
    gen = torch.Generator().manual_seed(7)
    failures, cases = [], 0
    rel_out = {torch.float32: 0.0, torch.bfloat16: 2.0**-8}

    def check(label, y, x_ref, w_ref, bias):
        nonlocal cases
        cases += 1
        b = torch.zeros(w_ref.shape[0], dtype=torch.float64) if bias is None else bias.double()
        want = x_ref.double() @ w_ref.T + b
        tol = 1e-4 * (x_ref.double().abs() @ w_ref.abs().T + b.abs()) + 1e-5
        tol += rel_out[y.dtype] * want.abs()
        err = (y.double() - want).abs()
        if not bool((err <= tol).all()):
            failures.append(f"{label}: max err {float(err.max()):.3g}, "
                            f"max err/tol {float((err / tol).max()):.3g}")

    def layer_for(method, k, sizes, dtype):
        layer = torch.nn.Module()
        layer.prefix = "test"
        method.create_weights(layer, k, sizes, k, sum(sizes), dtype)
        return layer

    mixes = [["Q4_0"], ["Q4_1"], ["Q5_0"], ["Q5_1"], ["Q8_0"], ["Q4_K"], ["Q5_K"], ["Q6_K"],
             ["Q4_K", "Q4_K", "Q6_K"], ["Q6_K", "Q8_0", "F32"], ["Q4_1", "F16", "Q4_1"]]
    for mix in mixes:
        sizes = [48, 16, 40][: len(mix)]
        k = 512
        parts = []
        for t, n in zip(mix, sizes):
            if t in ("F32", "F16"):
                parts.append(torch.randn(n, k, generator=gen).to(getattr(torch, t.replace("F", "float"))))
            else:
                parts.append(random_blocks(t, n, k, gen))
        for int8_act in (False, True):
            os.environ["VLLM_CPU_INT4_W4A8"] = "1" if int8_act else "0"
            for dtype in (torch.float32, torch.bfloat16):
                # float shards are stored in the model dtype, as the host stores them
                w_ref = torch.cat([blocks.dequantize(p).double() if p.dtype == torch.uint8
                                   else p.to(dtype).double() for p in parts])
                method = quant.GGUFLinearMethod(mix)
                layer = layer_for(method, k, sizes, dtype)
                shard_ids = ["q", "k", "v"] if len(mix) == 3 else [None]
                for sid, part in zip(shard_ids, parts):
                    layer.weight.weight_loader(layer.weight, part, sid)
                method.process_weights_after_loading(layer)
                a8 = [s.int8_act for s in layer.cpu_backend_gguf_segments]
                bias = torch.randn(sum(sizes), generator=gen).to(dtype)
                for m in (1, 3, 17):
                    x = torch.randn(m, k, generator=gen).to(dtype)
                    y = method.apply(layer, x, bias)
                    # per segment, the activations it multiplies
                    x_refs, at = [], 0
                    for seg, uses_a8 in zip(layer.cpu_backend_gguf_segments, a8):
                        x_refs.append((ref.int8_activations_per32(x) if uses_a8 else x.double(),
                                       at, at + seg.n))
                        at += seg.n
                    for xr, lo, hi in x_refs:
                        check(f"{mix} a8={int8_act} {dtype} m{m} cols {lo}:{hi}", y[:, lo:hi], xr,
                              w_ref[lo:hi], bias[lo:hi])
    # embedding / LM head: rows exact, logits as above
    os.environ["VLLM_CPU_INT4_W4A8"] = "0"
    for t in ("Q8_0", "Q4_K", "Q6_K", "Q4_1"):
        raw = random_blocks(t, 70, 256, gen)
        method = quant.GGUFEmbeddingMethod([t])
        layer = layer_for(method, 256, [80], torch.float32)  # vocabulary padded: 70 -> 80 rows
        layer.weight.weight_loader(layer.weight, raw)
        method.process_weights_after_loading(layer)
        ids = torch.tensor([[0, 69, 5], [17, 17, 33]])
        rows = method.embedding(layer, ids)
        want = blocks.dequantize(raw)
        cases += 1
        if not torch.equal(rows, want[ids]):
            failures.append(f"embedding {t}: rows differ")
        x = torch.randn(2, 256, generator=gen)
        check(f"logits {t}", method.apply(layer, x)[:, :70], x.double(), want.double(), None)
        if method.tie_weights(torch.nn.Module(), layer) is not layer:
            failures.append("tie_weights must hand back the embedding")
    return {"isa": isa, "failures": failures, "cases": cases}


@pytest.mark.parametrize("isa_path", ISA_PATHS)
def test_gguf_layers_match_dequantize_then_matmul(isa_path):
    result = run_worker(__file__, isa_path)
    assert result["cases"] >= 11 * 2 * 2 * 3 + 4
    assert result["failures"] == [], result["failures"][:20]


def test_linear_method_names_a_misshapen_tensor():
    import torch

    from cpu_backend.gguf import quant
    from cpu_backend.gguf.checkpoint import GGUFFileError

    method = quant.GGUFLinearMethod(["Q4_0"])
    layer = torch.nn.Module()
    layer.prefix = "model.layers.0.mlp.down_proj"
    method.create_weights(layer, 256, [64], 256, 64, torch.float32)
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(GGUFFileError, match=r"down_proj: GGUF tensor holds \[64 x 128\] weights, "
                                            r"the model expects \[64 x 256\]"):
        layer.weight.weight_loader(layer.weight, random_blocks("Q4_0", 64, 128, gen))
    with pytest.raises(GGUFFileError, match=r"shard\(s\) \[0\] missing"):
        method2 = quant.GGUFLinearMethod(["Q4_0", "Q4_0"])
        layer2 = torch.nn.Module()
        method2.create_weights(layer2, 256, [64, 64], 256, 128, torch.float32)
        layer2.weight.weight_loader(layer2.weight, random_blocks("Q4_0", 64, 256, gen), 1)
        method2.process_weights_after_loading(layer2)


# ------------------------------------------------------------- bad files ---


def _write(path, arch="llama", tensors=()):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for name, data, raw_dtype in tensors or [("token_embd.weight", np.ones((4, 32), np.float32), None)]:
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_files_get_clear_errors(tmp_path):
    import gguf
    import numpy as np

    from cpu_backend.gguf.checkpoint import GGUFCheckpoint, GGUFFileError

    with pytest.raises(GGUFFileError, match="no such GGUF file"):
        GGUFCheckpoint(tmp_path / "absent.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFFileError, match=r"junk.gguf \(22 bytes\) is not a readable GGUF file"):
        GGUFCheckpoint(junk)
    good = _write(tmp_path / "good.gguf", tensors=[
        ("token_embd.weight", np.ones((64, 256), np.float32), None),
        ("blk.0.attn_q.weight", gguf.quants.quantize(np.ones((64, 256), np.float32),
                                                     gguf.GGMLQuantizationType.Q8_0),
         gguf.GGMLQuantizationType.Q8_0)])
    ckpt = GGUFCheckpoint(good)
    assert ckpt.tensor_types == {"model.embed_tokens.weight": "F32",
                                 "model.layers.0.self_attn.q_proj.weight": "Q8_0"}
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size - 100])
    with pytest.raises(GGUFFileError, match="cut.gguf.*(truncated|damaged)"):
        GGUFCheckpoint(cut)
    with pytest.raises(GGUFFileError, match="architecture 'falcon' is not supported"):
        GGUFCheckpoint(_write(tmp_path / "falcon.gguf", arch="falcon"))
    q2k = np.zeros((4, 84), np.uint8)  # one Q2_K super-block per row
    with pytest.raises(GGUFFileError, match=r"blk.0.attn_q.weight has block type Q2_K"):
        GGUFCheckpoint(_write(tmp_path / "q2k.gguf", tensors=[
            ("blk.0.attn_q.weight", q2k, gguf.GGMLQuantizationType.Q2_K)]))
    with pytest.raises(GGUFFileError, match="tensor 'blk.0.ssm_a.weight' of a llama model"):
        GGUFCheckpoint(_write(tmp_path / "odd.gguf", tensors=[
            ("blk.0.ssm_a.weight", np.ones((4, 32), np.float32), None)]))


def test_unwritable_cache_folder_is_a_clear_error(tmp_path, monkeypatch):
    from cpu_backend.gguf.checkpoint import GGUFFileError
    from cpu_backend.gguf.model_dir import prepare

    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF")
    blocker = tmp_path / "a_file"  # a folder cannot be made below it, even as root
    blocker.write_text("")
    monkeypatch.setenv("VLLM_CPU_BACKEND_GGUF_CACHE", str(blocker / "cache"))
    with pytest.raises(GGUFFileError, match=r"m.gguf: cannot write its derived config and tokenizer "
                       r"into .*a_file/cache \(Not a directory\); set VLLM_CPU_BACKEND_GGUF_CACHE"):
        prepare(gguf_file)


def test_cli_types_only_gguf_paths(tmp_path, monkeypatch):
    import argparse

    from cpu_backend.gguf import cli, model_dir

    monkeypatch.setattr(model_dir, "prepare", lambda path: "/cache/derived")
    parser = argparse.ArgumentParser()
    parser.add_argument("model_tag", nargs="?")
    parser.add_argument("--model", type=str)
    parser.add_argument("--served-model-name", nargs="+")
    cli.install(parser)
    gguf_file = tmp_path / "m.Q4_K_M.gguf"
    gguf_file.write_bytes(b"GGUF")
    args = parser.parse_args([str(gguf_file)])
    assert args.model_tag == "/cache/derived" and args.served_model_name == [str(gguf_file)]
    args = parser.parse_args(["--model", str(gguf_file), "--served-model-name", "mine"])
    assert args.model == "/cache/derived" and args.served_model_name == ["mine"]
    args = parser.parse_args(["--served-model-name", "x", "--model", str(gguf_file)])
    assert args.served_model_name == ["x"]
    args = parser.parse_args(["Qwen/Qwen3-0.6B"])
    assert args.model_tag == "Qwen/Qwen3-0.6B" and args.served_model_name is None


if __name__ == "__main__" and "--worker" in sys.argv:
    print(json.dumps(_worker()))
