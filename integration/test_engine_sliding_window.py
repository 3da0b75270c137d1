"""Sliding-window attention: prompts and generations longer than the window,
through prefill, chunked prefill and decode, against transformers."""

from __future__ import annotations

import json
from pathlib import Path

from integration.conftest import greedy, hf_greedy, running_llm
from integration.test_engine_tiny import random_prompts


def test_sliding_window_matches_transformers(tiny_sliding_window):
    window = json.loads((Path(tiny_sliding_window) / "config.json").read_text())["sliding_window"]
    prompts = random_prompts([3, window - 1, window + 5, 3 * window + 2], seed=6)
    with running_llm(
        tiny_sliding_window, dtype="float32", block_size=16,
        max_num_batched_tokens=64, enable_chunked_prefill=True,
    ) as llm:
        got = [list(o.outputs[0].token_ids) for o in greedy(llm, prompts, 48)]
    assert got == hf_greedy(tiny_sliding_window, prompts, 48)
