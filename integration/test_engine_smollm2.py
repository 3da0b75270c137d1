"""SmolLM2-135M-Instruct (a real model, from a PyPI package) through `LLM`.

fp32: greedy tokens equal transformers' fp32 greedy tokens.
bf16: teacher-forced over a 256+-token sequence (transformers' own fp32 greedy
continuation), prefilled in chunks over the paged cache: vLLM-bf16's top-1
agrees with transformers-fp32's at >= 99% of positions, and the log-probability
of each reference token differs by at most MAX_LOGPROB_DIFF.
"""

from __future__ import annotations

import pytest

from integration.conftest import greedy, hf_greedy, report, running_llm

PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a little girl named Lily who",
    "def fibonacci(n):",
]
# bf16 keeps 8 bits of mantissa; over 30 layers the log-probabilities of a
# 135M model drift by up to a few tenths (measured max here: see the test).
MAX_LOGPROB_DIFF = 1.0
MIN_TOP1_AGREEMENT = 0.99
TEACHER_FORCED_STEPS = 256


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def test_fp32_greedy_equals_transformers(smollm2, tokenizer):
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    with running_llm(smollm2, dtype="float32") as llm:
        outs = greedy(llm, prompts, 64)
        assert report(llm)["attention_backends"] == ["CPU_BACKEND_ATTN"]
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == hf_greedy(smollm2, prompts, 64)
    assert outs[0].outputs[0].text.startswith(" Paris.")


def _reference_sequence(smollm2, tokenizer):
    """Prompt + transformers fp32 greedy continuation, and fp32 log-probs."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = tokenizer(PROMPTS[1])["input_ids"]
    cont = hf_greedy(smollm2, [prompt], TEACHER_FORCED_STEPS + 8)[0]
    seq = prompt + cont
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([seq])).logits[0].float()
    return seq, len(prompt), torch.log_softmax(logits, dim=-1)


def test_bf16_teacher_forced_agrees_with_fp32(smollm2, smollm2_bf16, tokenizer):
    from vllm import SamplingParams

    seq, prompt_len, ref_logprobs = _reference_sequence(smollm2, tokenizer)
    with running_llm(
        smollm2_bf16, dtype="bfloat16", enable_chunked_prefill=True,
        max_num_batched_tokens=96, enable_prefix_caching=False,
    ) as llm:
        (out,) = llm.generate(
            [{"prompt_token_ids": seq}],
            SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0),
            use_tqdm=False,
        )
    positions = range(prompt_len, len(seq))
    assert len(positions) >= TEACHER_FORCED_STEPS
    agree, diffs = 0, []
    for i in positions:
        entry = out.prompt_logprobs[i]  # predicts seq[i] from seq[:i]
        top1 = next(tok for tok, lp in entry.items() if lp.rank == 1)
        agree += top1 == int(ref_logprobs[i - 1].argmax())
        diffs.append(abs(entry[seq[i]].logprob - float(ref_logprobs[i - 1, seq[i]])))
    agreement = agree / len(positions)
    print(f"bf16 top-1 agreement {agreement:.4f}, max |logprob diff| {max(diffs):.4f}")
    assert agreement >= MIN_TOP1_AGREEMENT
    assert max(diffs) <= MAX_LOGPROB_DIFF
