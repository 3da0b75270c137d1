"""Quantized KV caches (`--kv-cache-dtype`) through `LLM`, on our native kernels.

1. Composition, tiny random Llama in fp32, per quantized dtype: prompts sharing
   a 48-token prefix, run with prefix caching and 32-token prefill chunks
   (cache hits proven by `num_cached_tokens`), give exactly the greedy tokens
   of an engine with neither (one prefill per prompt, no hits). Both read the
   same quantized bytes, so any reuse or chunking error shows as a mismatch.
2. Accuracy, SmolLM2-135M-Instruct in bf16, per quantized dtype against the
   bf16 KV cache ("auto"): teacher-forced over the bf16-KV engine's own
   320-token greedy continuation, prefilled in 96-token chunks over the paged
   cache: top-1 agreement with the bf16-KV top-1 at the positions the bf16-KV
   engine decides (its top-1 beats its top-2 by >= DECIDED_MARGIN nats; at a
   near-tie any rounding flips the winner), the agreement over all positions
   (printed), and the largest change of the reference token's log-probability;
   plus the free-running greedy continuation's common prefix with bf16 KV
   (printed, not bounded: one near-tie decides it). Bounds below; measured
   figures in docs/kv_cache.md.
"""

from __future__ import annotations

import os
import random

import pytest

from integration.conftest import greedy, report, running_llm

QUANTIZED = ["fp8_e5m2", "fp8_e4m3", "int8_per_token_head", "fp8_per_token_head"]
CONTINUATION = 320
PROMPT = "Once upon a time, there was a little girl named Lily who"
# Per dtype: (min teacher-forced top-1 agreement at decided positions, max |logprob diff|).
# Agreement over all positions depends on the reference text, i.e. on the
# bf16-KV decode's rounding order: equally exact decode kernels gave texts on
# which e5m2 agreed 95.9%, 97.2% and 93.8% of all positions (e4m3 97.8%,
# 95.6%, 95.9%; int8 98-99%, then 96.9%), the misses being near-ties. Even
# the same outputs gave e5m2 93.8% with prompt_logprobs=1 and 93.1% with 2
# (bf16 logit ties: top-1 is picked differently). Hence the bound counts
# decided positions only. The log-prob bounds, with margin
# on every text, stay as they were.
DECIDED_MARGIN = 0.5
ACCURACY_BOUNDS = {
    "fp8_e5m2": (0.97, 1.5),
    "fp8_e4m3": (0.97, 1.0),
    "int8_per_token_head": (0.98, 0.5),
    "fp8_per_token_head": (0.98, 1.0),
}


def _prompts(lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 700) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_prefix_cache_and_chunked_prefill_reuse_quantized_blocks(tiny_llama, kv_dtype):
    prefix = _prompts([48], seed=5)[0]  # 3 full blocks of 16
    prompts = [prefix + t for t in _prompts([3, 17, 1, 40], seed=6)]
    common = dict(dtype="float32", kv_cache_dtype=kv_dtype, block_size=16)
    with running_llm(
        tiny_llama, enable_prefix_caching=True, enable_chunked_prefill=True,
        max_num_batched_tokens=32, max_num_seqs=8, **common,
    ) as llm:
        greedy(llm, [prefix + [9]], max_tokens=1)  # puts the prefix in the cache
        outs = greedy(llm, prompts, 32)
        rep = report(llm)
        assert rep["attention_native"] == [True] and rep["pid"] != os.getpid()
        assert rep["omp_thread_cpus"] == [[cpu] for cpu in rep["bound_cpus"]], rep
    assert all(o.num_cached_tokens >= 48 for o in outs), [o.num_cached_tokens for o in outs]
    with running_llm(tiny_llama, enable_prefix_caching=False, **common) as llm:
        want = greedy(llm, prompts, 32)
    assert [list(o.outputs[0].token_ids) for o in outs] == [list(o.outputs[0].token_ids) for o in want]


@pytest.fixture(scope="module")
def bf16_reference(smollm2_bf16):
    """The bf16-KV engine's greedy continuation and teacher-forced logprobs."""
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(smollm2_bf16)(PROMPT)["input_ids"]
    with _engine(smollm2_bf16, "auto") as llm:
        (out,) = greedy(llm, [prompt], CONTINUATION)
        seq = prompt + list(out.outputs[0].token_ids)
        return prompt, seq, _teacher_forced(llm, seq)


def _engine(model, kv_dtype):
    return running_llm(
        model, dtype="bfloat16", kv_cache_dtype=kv_dtype, enable_chunked_prefill=True,
        max_num_batched_tokens=96, enable_prefix_caching=False, block_size=16,
    )


def _teacher_forced(llm, seq):
    from vllm import SamplingParams

    (out,) = llm.generate(
        [{"prompt_token_ids": seq}],
        SamplingParams(max_tokens=1, prompt_logprobs=2, temperature=0.0),
        use_tqdm=False,
    )
    return out.prompt_logprobs


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_smollm2_quantized_kv_tracks_bf16_kv(smollm2_bf16, bf16_reference, kv_dtype):
    prompt, seq, ref = bf16_reference
    with _engine(smollm2_bf16, kv_dtype) as llm:
        got = _teacher_forced(llm, seq)
        (free,) = greedy(llm, [prompt], CONTINUATION - 64)
        assert report(llm)["attention_native"] == [True]
    positions = range(len(prompt), len(seq))
    agree, decided, agree_decided, diffs = 0, 0, 0, []
    for i in positions:
        top_ref = next(t for t, lp in ref[i].items() if lp.rank == 1)
        top_got = next(t for t, lp in got[i].items() if lp.rank == 1)
        second_ref = next(lp.logprob for lp in ref[i].values() if lp.rank == 2)
        same = top_ref == top_got
        agree += same
        if ref[i][top_ref].logprob - second_ref >= DECIDED_MARGIN:
            decided += 1
            agree_decided += same
        diffs.append(abs(got[i][seq[i]].logprob - ref[i][seq[i]].logprob))
    free_tokens = list(free.outputs[0].token_ids)
    common = next(
        (k for k, (a, b) in enumerate(zip(free_tokens, seq[len(prompt):])) if a != b), len(free_tokens)
    )
    n = len(positions)
    assert n >= 256 and decided >= n // 2, (n, decided)
    print(
        f"{kv_dtype} vs bf16 KV over {n} teacher-forced steps: top-1 agreement {agree / n:.4f}, "
        f"at the {decided} decided positions {agree_decided / decided:.4f}, "
        f"max |logprob diff| {max(diffs):.4f}, mean {sum(diffs) / n:.4f}; "
        f"free-running greedy equal for the first {common}/{len(free_tokens)} tokens"
    )
    min_agree, max_diff = ACCURACY_BOUNDS[kv_dtype]
    assert agree_decided / decided >= min_agree
    assert max(diffs) <= max_diff
