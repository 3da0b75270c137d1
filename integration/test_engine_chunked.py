"""Chunked prefill forced by a small token budget: prompts longer than
`max_num_batched_tokens` are prefilled in chunks over the cached prefix, and
steps mix decodes with prefill chunks. Output must equal transformers."""

from __future__ import annotations

import pytest

from integration.conftest import greedy, hf_greedy, report, running_llm
from integration.test_engine_tiny import random_prompts

BUDGET = 32


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with running_llm(
        tiny_llama, dtype="float32", block_size=16, enable_chunked_prefill=True,
        max_num_batched_tokens=BUDGET, max_num_seqs=4,
    ) as llm:
        yield llm


def test_chunked_prefill_matches_transformers(llm, tiny_llama):
    prompts = random_prompts([100, 45, 3, 70, 31, 200], seed=5)
    assert max(map(len, prompts)) > BUDGET
    got = [list(o.outputs[0].token_ids) for o in greedy(llm, prompts, 64)]
    assert got == hf_greedy(tiny_llama, prompts, 64)
    assert report(llm)["attention_backends"] == ["CPU_BACKEND_ATTN"]


def test_engine_config_really_is_chunked(llm):
    sched = llm.llm_engine.vllm_config.scheduler_config
    assert sched.enable_chunked_prefill and sched.max_num_batched_tokens == BUDGET
