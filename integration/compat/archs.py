"""The architectures of the compatibility matrix: one tiny transformers config each.

Every row is a small random-weight checkpoint (hidden 128, 2 layers, head size
32 where the architecture lets us choose) that still exercises the feature its
architecture is known for: sliding windows, soft-capping, q/k norms, partial
rotary, ALiBi, absolute positions, mixture-of-experts, latent attention (MLA).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Shared by the Llama-like configs (names as in LlamaConfig).
_LLAMA_LIKE = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
)
SLIDING_WINDOW = 16


@dataclass(frozen=True)
class Arch:
    name: str  # row name in the matrix
    config_cls: str  # transformers class names
    model_cls: str
    kwargs: dict
    what: str  # the feature this row exercises
    tokenizer: str = "bpe"  # "qwen2": the Qwen2Tokenizer flavour (see models._tiny_tokenizer)
    tie_word_embeddings: bool = False
    seed: int = 0
    mla: bool = False
    moe: bool = False
    tags: tuple[str, ...] = field(default=())


def _llama_like(**extra) -> dict:
    return {**_LLAMA_LIKE, "head_dim": 32, **extra}


ARCHS: list[Arch] = [
    Arch("Llama", "LlamaConfig", "LlamaForCausalLM", _llama_like(), "GQA, RoPE, RMSNorm"),
    Arch("Mistral", "MistralConfig", "MistralForCausalLM",
         _llama_like(sliding_window=SLIDING_WINDOW), f"sliding window {SLIDING_WINDOW} on every layer"),
    Arch("Mixtral", "MixtralConfig", "MixtralForCausalLM",
         _llama_like(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
         "MoE: 4 experts, top-2", moe=True),
    Arch("Qwen2", "Qwen2Config", "Qwen2ForCausalLM", _llama_like(), "q/k/v biases", tokenizer="qwen2"),
    Arch("Qwen3", "Qwen3Config", "Qwen3ForCausalLM", _llama_like(), "q/k RMSNorm", tokenizer="qwen2"),
    Arch("Qwen3-MoE", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
         _llama_like(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                     decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[]),
         "MoE: 4 experts, top-2, q/k norm", tokenizer="qwen2", moe=True),
    Arch("Qwen2-MoE", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
         _llama_like(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                     shared_expert_intermediate_size=256, decoder_sparse_step=1,
                     norm_topk_prob=False, mlp_only_layers=[]),
         "MoE: 4 experts, top-2 (no renormalization), gated shared expert, q/k/v biases",
         tokenizer="qwen2", moe=True),
    Arch("Gemma", "GemmaConfig", "GemmaForCausalLM",
         _llama_like(hidden_activation="gelu_pytorch_tanh"), "GeGLU, scaled embeddings, (1+w) RMSNorm",
         tie_word_embeddings=True),
    Arch("Gemma2", "Gemma2Config", "Gemma2ForCausalLM",
         _llama_like(sliding_window=SLIDING_WINDOW, attn_logit_softcapping=50.0,
                     final_logit_softcapping=30.0, query_pre_attn_scalar=32,
                     layer_types=["sliding_attention", "full_attention"]),
         f"attention soft-cap 50, final soft-cap 30, sliding window {SLIDING_WINDOW} on alternate layers",
         tie_word_embeddings=True),
    Arch("Gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM",
         _llama_like(sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=32,
                     layer_types=["sliding_attention", "full_attention"],
                     rope_local_base_freq=10000.0),
         f"q/k norm, local/global RoPE, sliding window {SLIDING_WINDOW} on alternate layers",
         tie_word_embeddings=True),
    Arch("Phi-3", "Phi3Config", "Phi3ForCausalLM",
         {k: v for k, v in _LLAMA_LIKE.items()} | {"pad_token_id": None},
         "fused qkv / gate-up projections"),
    Arch("GPT-2", "GPT2Config", "GPT2LMHeadModel",
         dict(n_embd=128, n_layer=2, n_head=4, n_positions=1024, n_inner=256),
         "learned absolute positions, LayerNorm, GELU", tie_word_embeddings=True),
    Arch("GPT-NeoX", "GPTNeoXConfig", "GPTNeoXForCausalLM",
         dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              rotary_pct=0.25, use_parallel_residual=True, max_position_embeddings=2048),
         "partial rotary (25%), parallel residual"),
    Arch("OPT", "OPTConfig", "OPTForCausalLM",
         dict(hidden_size=128, ffn_dim=256, num_hidden_layers=2, num_attention_heads=4,
              word_embed_proj_dim=128, max_position_embeddings=2048),
         "learned positions (offset 2), ReLU", tie_word_embeddings=True),
    Arch("Falcon", "FalconConfig", "FalconForCausalLM",
         dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
              new_decoder_architecture=True, alibi=False, bias=False, parallel_attn=True,
              max_position_embeddings=2048),
         "new decoder architecture, RoPE, GQA"),
    Arch("Falcon-ALiBi", "FalconConfig", "FalconForCausalLM",
         dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
              new_decoder_architecture=False, multi_query=False, alibi=True, bias=True,
              parallel_attn=False, max_position_embeddings=2048),
         "ALiBi (falcon-rw style), biases"),
    Arch("StableLM", "StableLmConfig", "StableLmForCausalLM",
         dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, partial_rotary_factor=0.25, max_position_embeddings=2048),
         "partial rotary (25%), LayerNorm"),
    Arch("Starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM",
         dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, sliding_window=None, use_bias=True,
              max_position_embeddings=2048),
         "LayerNorm, GELU MLP, biases"),
    Arch("OLMo2", "Olmo2Config", "Olmo2ForCausalLM", {k: v for k, v in _LLAMA_LIKE.items()},
         "q/k norm over all heads, post-norm"),
    Arch("Granite", "GraniteConfig", "GraniteForCausalLM",
         _llama_like(embedding_multiplier=2.0, residual_multiplier=0.5,
                     attention_multiplier=1 / 32, logits_scaling=0.5),
         "embedding/residual/attention/logit multipliers"),
    Arch("DeepSeek-V2", "DeepseekV2Config", "DeepseekV2ForCausalLM",
         dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              # kv_lora_rank + rope = 576: the only latent size of the host's CPU MLA kernels.
              q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
              v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
              first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1,
              norm_topk_prob=False, routed_scaling_factor=1.0, rms_norm_eps=1e-5,
              max_position_embeddings=2048, rope_scaling=None),
         "MLA (latent 512 + rope 64) + MoE (4 experts, 1 shared)", mla=True, moe=True),
]

BY_NAME = {a.name.lower(): a for a in ARCHS}


def get(name: str) -> Arch:
    try:
        return BY_NAME[name.lower()]
    except KeyError:
        raise SystemExit(f"unknown architecture {name!r}: choose from {[a.name for a in ARCHS]}") from None
