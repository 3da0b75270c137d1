"""Perplexity of SmolLM2-135M-Instruct quantized by `cpu_backend.tools.quantize`
(GPTQ 4-bit g64 sym, GPTQ 8-bit per-channel, AWQ 4-bit g64, compressed-tensors
W8A8 INT8 with dynamic per-token activations), run by vLLM on our kernels with
bf16 activations (the 4-bit ones with int8 activations per 32 inputs: W4A8,
the default; integration/test_engine_w4a8.py compares it with W4A16), vs the
same model in bf16 on our bf16 linear.

Text: integration/data/perplexity_text.txt (the history section of Python's
LICENSE file, fixed). Perplexity = exp(mean NLL of every token after the
first), from vLLM's prompt logprobs. Bounds (ratio to bf16) are set from the
figures measured when this was written (docs/quantization.md) with margin:
round-to-nearest 4-bit costs a small model like this one a lot more than
GPTQ's error feedback or AWQ's scale search would.

Opt-in (5 engines: ~4 min on a quiet machine, 9 min measured under load), not in
the default run:
    CPU_BACKEND_RUN_PERPLEXITY=1 pytest integration/test_quantized_perplexity.py
"""

from __future__ import annotations

import math
import os

import pytest

from integration.conftest import report, running_llm

pytestmark = pytest.mark.skipif(
    os.environ.get("CPU_BACKEND_RUN_PERPLEXITY") != "1",
    reason="long: set CPU_BACKEND_RUN_PERPLEXITY=1 to run",
)

# format name -> (tool args, max perplexity ratio to bf16[, tool keyword args])
FORMATS = {
    # measured 1.046 (01:02 UTC): per-token int8 activations cost this small model more
    # than 8-bit weights alone (1.005)
    "ct-w8a8-dynamic": (("compressed-tensors", 8, -1, True), 1.10, {"activations": "dynamic"}),
    "gptq-8bit-perchannel": (("gptq", 8, -1, True), 1.03),
    "gptq-4bit-g64": (("gptq", 4, 64, True), 1.60),
    "awq-4bit-g64": (("awq", 4, 64, False), 1.45),
}


def perplexity(llm, token_ids: list[int]) -> float:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    (out,) = llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)
    nll = [-out.prompt_logprobs[i][tok].logprob for i, tok in enumerate(token_ids) if i > 0]
    return math.exp(sum(nll) / len(nll))


@pytest.fixture(scope="module")
def token_ids(perplexity_token_ids):
    return perplexity_token_ids


@pytest.fixture(scope="module")
def bf16_perplexity(smollm2, token_ids):
    with running_llm(smollm2, dtype="bfloat16", max_model_len=1024) as llm:
        return perplexity(llm, token_ids)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FORMATS))
def test_quantized_perplexity_close_to_bf16(name, smollm2, token_ids, bf16_perplexity,
                                            tmp_path, record_property):
    from cpu_backend.quantization import register
    from cpu_backend.tools.quantize import quantize_checkpoint

    register()  # what the vllm.general_plugins entry point does when installed
    (fmt, bits, gs, sym), max_ratio, *extra = FORMATS[name]
    kwargs = extra[0] if extra else {}
    qdir = tmp_path / name
    quantize_checkpoint(smollm2, qdir, fmt, bits, gs, sym, **kwargs)
    with running_llm(str(qdir), dtype="bfloat16", max_model_len=1024) as llm:
        ppl = perplexity(llm, token_ids)
        rep = report(llm)
    calls = "w8a8_linear_calls" if kwargs.get("activations") else "wna16_linear_calls"
    assert rep[calls] > 0
    ratio = ppl / bf16_perplexity
    record_property("perplexity", {"format": name, "ppl": ppl, "bf16": bf16_perplexity})
    print(f"\nPPL {name}: {ppl:.3f} vs bf16 {bf16_perplexity:.3f} (x{ratio:.3f})")
    assert 1 / max_ratio < ratio < max_ratio
