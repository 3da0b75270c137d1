"""Fast unit tests: no engine is started here."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


@pytest.fixture(scope="session")
def llama_config_dir(tmp_path_factory):
    """A Llama config with no weights: enough for vLLM to build its config."""
    from transformers import LlamaConfig

    def make(head_dim=32, **overrides):
        path = tmp_path_factory.mktemp(f"llama-h{head_dim}")
        cfg = dict(
            vocab_size=512, hidden_size=4 * head_dim, intermediate_size=256,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=head_dim, max_position_embeddings=1024,
        )
        cfg.update(overrides)
        LlamaConfig(**cfg).save_pretrained(path)
        return str(path)

    return make
