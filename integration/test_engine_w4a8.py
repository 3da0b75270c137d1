"""W4A8 (`VLLM_CPU_INT4_W4A8`, the host's flag, default on) end to end on a real
model: SmolLM2-135M-Instruct quantized by `cpu_backend.tools.quantize` (GPTQ
4-bit g64 sym), in bf16, its 4-bit linears fed int8 activations (per 32
inputs) vs bf16 activations (`VLLM_CPU_INT4_W4A8=0`), same checkpoint, both
with the LM head a quantized checkpoint gets by default (its int8 copy).

From vLLM's prompt logprobs over the fixed text (integration/data/perplexity_text.txt,
first 1000 tokens, so prefill runs W4A8 too): perplexity ratio W4A8 / W4A16,
and top-1 agreement at the positions W4A16 decides (top-1 leads top-2 by >=
0.5 nats). Exactness of the W4A8 arithmetic itself is proven elsewhere
(plugin_tests/test_kernels_wna16.py, integration/test_engine_quantized.py);
this bounds what int8 activations cost a real model. Bounds from the figures
measured when this was written (docs/quantization.md), with margin.
"""

from __future__ import annotations

import pytest

from integration.conftest import prompt_logprobs, report, running_llm, summary

pytestmark = pytest.mark.usefixtures("worker_in_engine")

DECIDED_NATS = 0.5
# measured (2026-12-01 10:10 UTC): x0.9965 (11.124 vs 11.163), top-1 462 of 462
MAX_RATIO = 1.03
MIN_SAME = 0.97


def run(model: str, token_ids: list[int], w4a8: str) -> tuple[dict, dict]:
    from cpu_backend.quantization import register

    register()  # what the vllm.general_plugins entry point does when installed
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_INT4_W4A8", w4a8)
        with running_llm(model, dtype="bfloat16", max_model_len=1024) as llm:
            got = summary(prompt_logprobs(llm, token_ids), token_ids)
            rep = report(llm)
    return got, rep


@pytest.mark.slow
def test_w4a8_perplexity_close_to_w4a16(smollm2_gptq4, perplexity_token_ids, record_property):
    w4a16, rep16 = run(smollm2_gptq4, perplexity_token_ids, "0")
    w4a8, rep8 = run(smollm2_gptq4, perplexity_token_ids, "1")
    assert rep16["wna16_int8_act_layers"] == 0
    assert rep8["wna16_int8_act_layers"] == 30 * 4  # every decoder linear (qkv, o, gate_up, down)
    assert rep8["wna16_linear_calls"] > 0
    decided = [i for i, (_, lead) in enumerate(w4a16["tops"]) if lead >= DECIDED_NATS]
    assert len(decided) >= len(perplexity_token_ids) // 4
    same = sum(w4a8["tops"][i][0] == w4a16["tops"][i][0] for i in decided) / len(decided)
    ratio = w4a8["ppl"] / w4a16["ppl"]
    record_property("w4a8", {"ppl": w4a8["ppl"], "w4a16": w4a16["ppl"], "decided": len(decided),
                             "agreement": same})
    print(f"\nW4A8: perplexity {w4a8['ppl']:.4f} vs W4A16 {w4a16['ppl']:.4f} (x{ratio:.4f}); "
          f"top-1 agreement {same:.4f} at {len(decided)} decided positions")
    assert 1 / MAX_RATIO < ratio < MAX_RATIO
    assert same >= MIN_SAME
