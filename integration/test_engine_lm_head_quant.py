"""`VLLM_CPU_BACKEND_LM_HEAD_QUANT` end to end on SmolLM2-135M-Instruct (real
weights, tied 49152 x 576 embedding / LM head): logits computed from the int8
copy of the head (cpu_backend/quantization/lm_head.py) vs from the head's own
weights, same engine otherwise:
- in bf16, where the default (`auto`) keeps the head and `int8` asks for the copy;
- as GPTQ 4-bit g64 (`cpu_backend.tools.quantize`), where `auto` makes the
  copy and `none` keeps the head.

From vLLM's prompt logprobs over a fixed text (integration/data/perplexity_text.txt,
first 1000 tokens): perplexity ratio to the exact head, and top-1 agreement at
the positions the exact head decides (its top-1 leads its top-2 by >= 0.5
nats: `closeness` in integration/conftest.py). Bounds from the
figures measured when this was written (docs/quantization.md), with margin.
"""

from __future__ import annotations

import pytest

from integration.conftest import closeness, logprob_run

# measured: bf16 x0.9969, 497 of 497 (2026-12-01 02:11 UTC); GPTQ 4-bit: see
# docs/quantization.md#int8-lm-head
MAX_RATIO = 1.005
MIN_SAME = 0.995


def run(model: str, token_ids: list[int], mode: str | None) -> tuple[dict, dict]:
    """(logprob summary, worker report) with the variable set to `mode` (None: unset)."""
    return logprob_run(model, token_ids, {"VLLM_CPU_BACKEND_LM_HEAD_QUANT": mode})


def assert_close(name: str, int8: dict, exact: dict, record_property) -> None:
    ratio, same, decided = closeness(int8, exact)
    record_property("lm_head_quant", {"model": name, "ppl": int8["ppl"], "exact": exact["ppl"],
                                      "decided": decided, "agreement": same})
    print(f"\n{name}, int8 LM head: perplexity {int8['ppl']:.4f} vs exact head {exact['ppl']:.4f} "
          f"(x{ratio:.4f}); top-1 agreement {same:.4f} at {decided} decided positions")
    assert 1 / MAX_RATIO < ratio < MAX_RATIO
    assert same >= MIN_SAME


@pytest.mark.slow
def test_int8_head_on_bf16_model_only_when_asked(smollm2, perplexity_token_ids, record_property):
    exact, rep_exact = run(smollm2, perplexity_token_ids, None)
    int8, rep_int8 = run(smollm2, perplexity_token_ids, "int8")
    assert rep_exact["lm_head_quant"] == ["none"]  # auto: an unquantized checkpoint keeps its head
    assert rep_int8["lm_head_quant"] == ["int8"]
    assert rep_int8["linear_methods"] == ["CpuBackendLMHeadMethod", "CpuBackendLinearMethod"]
    assert_close("bf16", int8, exact, record_property)


@pytest.mark.slow
def test_quantized_checkpoint_gets_int8_head_by_default(smollm2_gptq4, perplexity_token_ids,
                                                        record_property):
    int8, rep_int8 = run(smollm2_gptq4, perplexity_token_ids, None)
    exact, rep_exact = run(smollm2_gptq4, perplexity_token_ids, "none")
    assert rep_int8["lm_head_quant"] == ["int8"]
    assert rep_exact["lm_head_quant"] == ["none"]
    assert rep_int8["linear_methods"] == ["CpuBackendLMHeadMethod", "WNA16LinearMethod"]
    assert_close("GPTQ 4-bit g64", int8, exact, record_property)
