"""Shared fixtures for end-to-end tests: locally built models, engines, and
Hugging Face transformers references.

Engines are expensive (~15-30 s to start here), so each test module builds the
engines it needs once and shuts them down before the next module starts.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os

import pytest

# Before vLLM is imported anywhere in this process.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")

from integration import models  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Every test here is in the `integration` lane (`pytest -m integration`)."""
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def model_root():
    return models.default_cache_root()


@pytest.fixture(scope="session")
def tiny_llama(model_root):
    return str(models.tiny_llama(model_root))


@pytest.fixture(scope="session")
def tiny_sliding_window(model_root):
    return str(models.tiny_sliding_window(model_root))


@pytest.fixture(scope="session")
def smollm2(model_root):
    return str(models.smollm2(model_root))


@pytest.fixture(scope="session")
def perplexity_token_ids(smollm2) -> list[int]:
    """The first 1000 SmolLM2 tokens of the fixed perplexity text
    (integration/data/perplexity_text.txt)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    text = (Path(__file__).parent / "data" / "perplexity_text.txt").read_text()
    ids = AutoTokenizer.from_pretrained(smollm2)(text).input_ids
    assert len(ids) > 400
    return ids[:1000]


@pytest.fixture(scope="session")
def smollm2_gptq4(smollm2, tmp_path_factory) -> str:
    """SmolLM2-135M-Instruct as GPTQ 4-bit g64 sym (`cpu_backend.tools.quantize`)."""
    from cpu_backend.tools.quantize import quantize_checkpoint

    out = tmp_path_factory.mktemp("gptq4") / "smollm2-gptq4-g64"
    quantize_checkpoint(smollm2, out, "gptq", 4, 64, True)
    return str(out)


@pytest.fixture(scope="session")
def smollm2_bf16(model_root):
    return str(models.smollm2(model_root, dtype="bfloat16"))


@pytest.fixture
def exact_lm_head(monkeypatch):
    """The LM head on the checkpoint's own weights. Quantized checkpoints get an
    int8 copy of it by default (VLLM_CPU_BACKEND_LM_HEAD_QUANT=auto), which a
    reference built from the dequantized weights does not have; what that
    copy costs is bounded in integration/test_engine_lm_head_quant.py."""
    monkeypatch.setenv("VLLM_CPU_BACKEND_LM_HEAD_QUANT", "none")


@contextlib.contextmanager
def running_llm(model: str, **kwargs):
    """An `LLM` that is shut down (worker processes included) on exit."""
    from vllm import LLM

    kwargs.setdefault("seed", 0)
    kwargs.setdefault("max_model_len", 1024)
    llm = LLM(model=model, **kwargs)
    try:
        yield llm
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def greedy(llm, prompts: list[list[int]], max_tokens: int):
    """vLLM greedy outputs for token-id prompts, in prompt order."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def hf_greedy(model: str, prompts: list[list[int]], max_tokens: int, dtype="float32", prepare=None):
    """transformers greedy continuations: plain argmax of the logits at every
    step, one prompt at a time (no padding, no logits processors, EOS is just
    another token, as with vLLM's `ignore_eos`). `prepare(model)`, if given,
    runs on the loaded model first (e.g. to add forward hooks)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
    hf.eval()
    if prepare is not None:
        prepare(hf)
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            step = hf(torch.tensor([prompt]), use_cache=True)
            new: list[int] = []
            while True:
                new.append(int(step.logits[0, -1].argmax()))
                if len(new) == max_tokens:
                    break
                step = hf(
                    torch.tensor([[new[-1]]]), past_key_values=step.past_key_values,
                    use_cache=True,
                )
            outs.append(new)
    return outs


def prompt_logprobs(llm, token_ids: list[int]) -> list[dict]:
    """vLLM's prompt logprobs (top 2 and the actual token) after the first token."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=2, temperature=0.0)
    (out,) = llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)
    return out.prompt_logprobs[1:]


def summary(logprobs: list[dict], token_ids: list[int]) -> dict:
    """Perplexity, and per position the top-1 token and its lead over the top-2."""
    nll = [-lp[tok].logprob for lp, tok in zip(logprobs, token_ids[1:])]
    tops = []
    for lp in logprobs:
        ranked = sorted(lp.items(), key=lambda kv: kv[1].rank)
        best = [(tok, v.logprob) for tok, v in ranked if v.rank in (1, 2)]
        tops.append((best[0][0], best[0][1] - best[1][1] if len(best) > 1 else math.inf))
    return {"ppl": math.exp(sum(nll) / len(nll)), "tops": tops}


def logprob_run(model: str, token_ids: list[int], env: dict[str, str | None]) -> tuple[dict, dict]:
    """`summary` of a bf16 engine's prompt logprobs over `token_ids`, and its worker
    report, with `env` set for the engine (None: variable unset)."""
    from cpu_backend.quantization import register

    register()  # what the vllm.general_plugins entry point does when installed
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            if value is None:
                mp.delenv(name, raising=False)
            else:
                mp.setenv(name, value)
        with running_llm(model, dtype="bfloat16") as llm:
            return summary(prompt_logprobs(llm, token_ids), token_ids), report(llm)


# Positions where the reference's top-1 leads its top-2 by at least this many
# nats: closer calls are near-ties that any rounding may flip.
DECIDED_NATS = 0.5


def closeness(got: dict, ref: dict) -> tuple[float, float, int]:
    """(perplexity ratio got / ref, top-1 agreement at the positions ref decides,
    how many those are) of two `summary` results; ref decides at least a quarter."""
    decided = [i for i, (_, lead) in enumerate(ref["tops"]) if lead >= DECIDED_NATS]
    assert len(decided) >= (len(ref["tops"]) + 1) // 4
    same = sum(got["tops"][i][0] == ref["tops"][i][0] for i in decided) / len(decided)
    return got["ppl"] / ref["ppl"], same, len(decided)


def report(llm) -> dict:
    """What the (single) worker ran: see CpuBackendWorker.cpu_backend_report."""
    (rep,) = llm.collective_rpc("cpu_backend_report")
    return rep
