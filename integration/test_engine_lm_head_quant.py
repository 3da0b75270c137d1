"""`VLLM_CPU_BACKEND_LM_HEAD_QUANT` end to end: SmolLM2-135M-Instruct (real
weights, tied 49152 x 576 embedding / LM head) in bf16, its logits computed
from the int8 copy of the head (cpu_backend/quantization/lm_head.py) vs from
the bf16 head, same engine otherwise.

From vLLM's prompt logprobs over a fixed text (integration/data/perplexity_text.txt,
first 1000 tokens): perplexity ratio to the bf16 head, and top-1 agreement at
the positions the bf16 head decides (its top-1 leads its top-2 by >= 0.5 nats;
closer calls are near-ties that any rounding may flip). Bounds from the
figures measured when this was written (docs/quantization.md), with margin.
"""

from __future__ import annotations

import pytest

from integration.conftest import prompt_logprobs, report, running_llm, summary

DECIDED_NATS = 0.5
# mode -> (max perplexity ratio either way, min top-1 agreement at decided
# positions); measured (02:11 UTC): x0.9969, 497 of 497
BOUNDS = {"int8": (1.005, 0.995)}


@pytest.fixture(scope="module")
def token_ids(perplexity_token_ids):
    return perplexity_token_ids


@pytest.fixture(scope="module")
def bf16_head(smollm2, token_ids):
    with running_llm(smollm2, dtype="bfloat16") as llm:
        rep = report(llm)
        got = summary(prompt_logprobs(llm, token_ids), token_ids)
    assert rep["lm_head_quant"] == ["none"]
    return got


@pytest.mark.parametrize("mode", list(BOUNDS))
def test_quantized_lm_head_close_to_bf16(mode, smollm2, token_ids, bf16_head, record_property):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_BACKEND_LM_HEAD_QUANT", mode)
        with running_llm(smollm2, dtype="bfloat16") as llm:
            rep = report(llm)
            got = summary(prompt_logprobs(llm, token_ids), token_ids)
    assert rep["lm_head_quant"] == [mode]
    assert rep["linear_methods"] == ["CpuBackendLMHeadMethod", "CpuBackendLinearMethod"]
    decided = [i for i, (_, lead) in enumerate(bf16_head["tops"]) if lead >= DECIDED_NATS]
    assert len(decided) >= len(token_ids) // 4
    same = sum(got["tops"][i][0] == bf16_head["tops"][i][0] for i in decided) / len(decided)
    ratio = got["ppl"] / bf16_head["ppl"]
    record_property("lm_head_quant", {"mode": mode, "ppl": got["ppl"], "bf16": bf16_head["ppl"],
                                      "decided": len(decided), "agreement": same})
    print(f"\nLM head {mode}: perplexity {got['ppl']:.4f} vs bf16 head {bf16_head['ppl']:.4f} "
          f"(x{ratio:.4f}); top-1 agreement {same:.4f} at {len(decided)} decided positions")
    max_ratio, min_same = BOUNDS[mode]
    assert 1 / max_ratio < ratio < max_ratio
    assert same >= min_same
