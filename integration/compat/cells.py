"""The cells of one matrix row, run in one process (`python -m integration.compat.cells`).

One engine per configuration, shared by the features that use it:

- ``fp32`` engine (float32, 16-token blocks, prefix caching on, chunked prefill
  with a 64-token budget) -> cells ``fp32`` (greedy tokens == transformers fp32,
  short prompts that fit one step), ``prefix_cache`` and ``chunked_prefill``;
- ``bf16`` engine -> cell ``bf16`` (teacher-forced agreement, see `agreement`);
- one bf16 engine per quantized KV-cache dtype -> ``fp8_e5m2_kv``,
  ``fp8_e4m3_kv``, ``int8_kv`` (same agreement metric, looser bound);
- fp32 with ``tensor_parallel_size=2`` -> ``tp2`` (greedy equality);
- quantized checkpoints (`quant.py`) -> ``w8a8``, ``awq``, ``gptq`` (bf16
  activations; reference: transformers fp32 on the dequantized weights).

A cell is ``{"ok": bool, "reason"/"detail": str, ...}``. Results are written
to ``--out`` after every cell, so a crash keeps what finished; the parent
(`integration.compat.__main__`) marks the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import sys
import time
import traceback
from pathlib import Path

# Before vLLM is imported.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")

from integration import models  # noqa: E402
from integration.compat import archs  # noqa: E402

GREEDY_TOKENS = 32
TF_TOKENS = 48  # teacher-forced continuation per prompt (6 prompts: 288 positions)
DECIDED_MARGIN = 0.25  # nats between fp32's top-1 and runner-up
BUDGET = 64  # max_num_batched_tokens of the fp32 engine
BLOCK = 16
# Minimum top-1 agreement with the fp32 reference on decided positions.
MIN_DECIDED_AGREEMENT = {"bf16": 0.98, "kv": 0.95, "quant": 0.90}
# Overall agreement may trail transformers-bf16's own by at most this much.
MAX_BELOW_HF_BF16 = {"bf16": 0.03, "kv": 0.06, "quant": 0.10}
KV_DTYPES = {"fp8_e5m2_kv": "fp8_e5m2", "fp8_e4m3_kv": "fp8_e4m3", "int8_kv": "int8_per_token_head"}

QUANT = ("w8a8", "awq", "gptq")
FEATURES = ["fp32", "bf16", "prefix_cache", "chunked_prefill", *KV_DTYPES, "w8a8", "awq", "gptq", "tp2"]
# Which engine configuration serves which cells.
GROUPS = {
    "fp32": ["fp32", "prefix_cache", "chunked_prefill"],
    "bf16": ["bf16"],
    **{f: [f] for f in KV_DTYPES},
    "tp2": ["tp2"],
    "w8a8": ["w8a8"], "awq": ["awq"], "gptq": ["gptq"],
}


class CellFailure(AssertionError):
    """The engine ran but the output is wrong (the reason says how)."""


# --------------------------------------------------------------------------
# References (transformers)
# --------------------------------------------------------------------------


class Reference:
    """transformers fp32 (and bf16) of the row's checkpoint, loaded once."""

    def __init__(self, folder: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.folder = folder
        self.tok = AutoTokenizer.from_pretrained(folder)
        self.fp32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self._bf16 = None
        self.prompts = [self.tok(p).input_ids for p in models.TINY_PROMPTS]
        self._cache: dict = {}

    def greedy(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        key = ("greedy", n, tuple(map(tuple, prompts)))
        if key not in self._cache:
            from integration.conftest import hf_greedy

            self._cache[key] = hf_greedy(self.folder, prompts, n)
        return self._cache[key]

    def logprobs(self, seq: list[int], bf16: bool = False):
        import torch

        if bf16 and self._bf16 is None:
            from transformers import AutoModelForCausalLM

            self._bf16 = AutoModelForCausalLM.from_pretrained(self.folder, dtype=torch.bfloat16).eval()
        model = self._bf16 if bf16 else self.fp32
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), dim=-1)

    def explain_divergence(self, prompt: list[int], want: list[int], got: list[int]) -> str:
        """Where vLLM left transformers' greedy path, and how close a call that was."""
        pos = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
        lp = self.logprobs(prompt + want[:pos])[-1]
        top2 = lp.topk(2)
        margin = float(top2.values[0] - top2.values[1])
        runner_up = int(top2.indices[1]) == got[pos]
        return (f"first divergence at generated token {pos}: transformers' top-1 leads by "
                f"{margin:.3g} nats; vLLM picked {'its runner-up' if runner_up else 'a token ranked lower'}")


# --------------------------------------------------------------------------
# Engine helpers
# --------------------------------------------------------------------------


@contextlib.contextmanager
def engine(folder: str, **kwargs):
    from integration.conftest import running_llm

    kwargs.setdefault("max_model_len", 512)
    kwargs.setdefault("max_num_seqs", 8)
    with running_llm(folder, **kwargs) as llm:
        yield llm


def ran_what(llm) -> str:
    """Which attention backend / kernels the (first) worker used."""
    try:
        rep = llm.collective_rpc("cpu_backend_report")[0]
    except Exception as exc:  # noqa: BLE001 - informative only
        return f"report unavailable ({type(exc).__name__})"
    backends = ",".join(rep.get("attention_backends") or ["(no Attention layers: MLA/other)"])
    native = rep.get("attention_native")
    text = f"attention {backends}" + (f", native kernel {native}" if native else "") + \
        f", linear {','.join(rep.get('linear_methods', []))}"
    if rep.get("moe_methods"):
        text += f", MoE {','.join(rep['moe_methods'])} ({rep.get('moe_experts_calls', 0)} calls of ours)"
    return text


def greedy_tokens(llm, prompts, n):
    from integration.conftest import greedy

    outs = greedy(llm, prompts, n)
    return [list(o.outputs[0].token_ids) for o in outs], outs


def random_prompts(lengths, vocab, seed):
    rng = random.Random(seed)
    return [[rng.randrange(7, vocab) for _ in range(n)] for n in lengths]


def check_equal(ref: Reference, prompts, got, want, what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            raise CellFailure(f"{what}: prompt {i} (len {len(prompts[i])}) differs from transformers fp32; "
                              + ref.explain_divergence(prompts[i], w, g))


# --------------------------------------------------------------------------
# Cells
# --------------------------------------------------------------------------


def cell_fp32(llm, ref: Reference) -> str:
    prompts = ref.prompts
    assert sum(map(len, prompts)) <= BUDGET, "greedy prompts must fit one step"
    got, _ = greedy_tokens(llm, prompts, GREEDY_TOKENS)
    check_equal(ref, prompts, got, ref.greedy(prompts, GREEDY_TOKENS), "fp32 greedy")
    return f"{len(prompts)} prompts x {GREEDY_TOKENS} tokens identical to transformers fp32"


def cell_prefix_cache(llm, ref: Reference) -> str:
    vocab = len(ref.tok)
    prefix = random_prompts([3 * BLOCK], vocab, seed=3)[0]
    tails = random_prompts([3, 9, 1, 20], vocab, seed=4)
    prompts = [prefix + t for t in tails]
    greedy_tokens(llm, [prefix + [7]], 1)  # fills the cache with the prefix
    got, outs = greedy_tokens(llm, prompts, GREEDY_TOKENS)
    cached = [o.num_cached_tokens or 0 for o in outs]
    if min(cached) <= 0:
        raise CellFailure(f"no prefix-cache hit: num_cached_tokens={cached}")
    check_equal(ref, prompts, got, ref.greedy(prompts, GREEDY_TOKENS), "prefix cache")
    return f"num_cached_tokens={cached} (prefix {len(prefix)}); outputs identical to transformers fp32"


def cell_chunked(llm, ref: Reference) -> str:
    prompts = random_prompts([100, 45, 3, 150, 70], len(ref.tok), seed=5)
    sched = llm.llm_engine.vllm_config.scheduler_config
    if not (sched.enable_chunked_prefill and sched.max_num_batched_tokens == BUDGET):
        raise CellFailure(f"engine not chunked: {sched.enable_chunked_prefill=}, {sched.max_num_batched_tokens=}")
    got, _ = greedy_tokens(llm, prompts, GREEDY_TOKENS)
    check_equal(ref, prompts, got, ref.greedy(prompts, GREEDY_TOKENS), "chunked prefill")
    return f"prompts {[len(p) for p in prompts]} with a {BUDGET}-token budget identical to transformers fp32"


def agreement(llm, ref: Reference, kind: str) -> str:
    """Teacher-forced top-1 agreement with transformers fp32.

    Over each reference prompt + transformers' fp32 greedy continuation
    (TF_TOKENS), vLLM's top-1 prediction (prompt_logprobs) must equal fp32's
    top-1 on >= MIN_DECIDED_AGREEMENT[kind] of the *decided* positions (fp32
    top-1 leads by >= DECIDED_MARGIN nats; below that, rounding alone decides),
    and overall agreement may trail transformers-bf16's own by at most
    MAX_BELOW_HF_BF16[kind]. Where transformers' own bf16 model stays under
    the decided bound (a tiny MoE whose router flips experts under bf16
    rounding), the decided bound is transformers-bf16's decided agreement
    minus the same slack: we cannot demand more than the reference achieves.
    """
    from vllm import SamplingParams

    conts = ref.greedy(ref.prompts, TF_TOKENS)
    seqs = [p + c for p, c in zip(ref.prompts, conts)]
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs],
                        SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0), use_tqdm=False)
    n = agree = decided = agree_decided = hf_agree = hf_agree_decided = 0
    max_diff = 0.0
    for prompt, seq, out in zip(ref.prompts, seqs, outs):
        lp32, lp16 = ref.logprobs(seq), ref.logprobs(seq, bf16=True)
        for i in range(len(prompt), len(seq)):
            entry = out.prompt_logprobs[i]
            ours = next(t for t, lp in entry.items() if lp.rank == 1)
            top2 = lp32[i - 1].topk(2)
            want = int(top2.indices[0])
            n += 1
            agree += ours == want
            hf_ok = int(lp16[i - 1].argmax()) == want
            hf_agree += hf_ok
            if float(top2.values[0] - top2.values[1]) >= DECIDED_MARGIN:
                decided += 1
                agree_decided += ours == want
                hf_agree_decided += hf_ok
            max_diff = max(max_diff, abs(entry[seq[i]].logprob - float(lp32[i - 1, seq[i]])))
    detail = (f"top-1 agreement {agree_decided}/{decided} decided positions "
              f"({agree_decided / max(decided, 1):.3f}), {agree}/{n} overall "
              f"(transformers bf16: {hf_agree_decided}/{decided} decided, {hf_agree}/{n} overall); "
              f"max |logprob diff| {max_diff:.3f}")
    if decided < n // 2:
        raise CellFailure(f"too few decided positions to judge: {detail}")
    slack = MAX_BELOW_HF_BF16[kind]
    decided_bound = min(MIN_DECIDED_AGREEMENT[kind], hf_agree_decided / decided - slack)
    if agree_decided / decided < decided_bound or agree / n < hf_agree / n - slack:
        raise CellFailure(f"below bound (decided >= {decided_bound:.3f}, overall >= "
                          f"transformers bf16 - {slack}): {detail}")
    return detail


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------


_GENERIC = ("Engine core initialization failed", "EngineDeadError", "WorkerProc initialization failed",
            "died unexpectedly", "See root cause above", "See stack trace for root cause")


def _reason(exc: BaseException, log: Path | None, log_start: int) -> str:
    """A one-line cause: the exception, or for an engine that died in its own
    process, the first root-cause error it printed to the shared log."""
    msg = f"{type(exc).__name__}: {exc}".strip()
    generic = any(g in msg for g in _GENERIC)
    if generic and log is not None and log.exists():
        with open(log, errors="replace") as fh:
            fh.seek(log_start)
            lines = fh.read().splitlines()
        # vLLM logs the root cause in the failing process as
        # "(Worker pid=N) ERROR <date> [file:line] SomeError: message": take the first.
        for ln in lines:
            m = re.search(r"\b([A-Za-z_][\w.]*(?:Error|Exception)): (.*)$", ln)
            if m and not any(g in ln for g in _GENERIC):
                msg = f"{m.group(1)}: {m.group(2).strip()}  [root cause in the engine log]"
                break
    msg = " ".join(msg.split())
    # pydantic's echo of every engine argument says nothing about the cause.
    msg = re.sub(r"\s*\[type=\w+, input_value=.*?input_type=\w+\]", "", msg)
    msg = re.sub(r"\s*For further information visit \S+", "", msg)
    return msg[:600]


def run_row(row: str, folder: str, features: list[str], out: Path, log: Path | None) -> dict:
    results: dict = {"row": row, "model": folder, "cells": {}}

    def save():
        out.write_text(json.dumps(results, indent=1) + "\n")

    ref = Reference(folder)
    arch = archs.BY_NAME.get(row.lower())
    for group, cells in GROUPS.items():
        wanted = [c for c in cells if c in features]
        if not wanted:
            continue
        log_start = log.stat().st_size if log is not None and log.exists() else 0
        t0 = time.monotonic()
        print(f"[compat] {row}: {group} engine for {wanted}", file=sys.stderr, flush=True)
        try:
            gref = ref
            if group in QUANT:  # compare with transformers on the dequantized weights
                from integration.compat import quant

                gref = Reference(str(quant.reference(group, folder)))
            with _engine_for(group, folder, arch, ref) as llm:
                ran = "?"
                for cell in wanted:
                    t1 = time.monotonic()
                    try:
                        detail = CELL_FNS[cell](llm, gref)
                        results["cells"][cell] = {"ok": True, "detail": detail,
                                                  "seconds": round(time.monotonic() - t1, 1)}
                    except Exception as exc:  # noqa: BLE001 - a failing cell is a finding
                        results["cells"][cell] = {"ok": False, "reason": _reason(exc, log, log_start),
                                                  "traceback": traceback.format_exc(limit=-6)}
                    if ran == "?":  # after a forward: the backend decides its kernel then
                        ran = ran_what(llm)
                    results["cells"][cell]["ran"] = ran
                    save()
        except Exception as exc:  # noqa: BLE001 - engine did not start
            reason = _reason(exc, log, log_start)
            for cell in wanted:
                results["cells"][cell] = {"ok": False, "reason": reason,
                                          "traceback": traceback.format_exc(limit=-6)}
        results.setdefault("engine_seconds", {})[group] = round(time.monotonic() - t0, 1)
        save()
    return results


@contextlib.contextmanager
def _engine_for(group: str, folder: str, arch, ref: Reference):
    block = {} if (arch is not None and arch.mla) else {"block_size": BLOCK}
    if group == "fp32":
        kw = dict(dtype="float32", enable_prefix_caching=True, enable_chunked_prefill=True,
                  max_num_batched_tokens=BUDGET, **block)
    elif group == "bf16":
        kw = dict(dtype="bfloat16", enable_prefix_caching=False, **block)
    elif group in KV_DTYPES:
        kw = dict(dtype="bfloat16", kv_cache_dtype=KV_DTYPES[group], enable_prefix_caching=False, **block)
    elif group == "tp2":
        kw = dict(dtype="float32", tensor_parallel_size=2, distributed_executor_backend="mp", **block)
    elif group in QUANT:
        from integration.compat import quant

        folder = str(quant.checkpoint(group, folder))
        kw = dict(dtype=quant.DTYPE[group], enable_prefix_caching=False, **block)
    else:
        raise ValueError(group)
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if group == "tp2" else {}
    if group in QUANT:  # the reference's LM head is the checkpoint's, not our int8 copy
        env["VLLM_CPU_BACKEND_LM_HEAD_QUANT"] = "none"
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with engine(folder, **kw) as llm:
            yield llm
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v




CELL_FNS = {
    "fp32": cell_fp32,
    "prefix_cache": cell_prefix_cache,
    "chunked_prefill": cell_chunked,
    "bf16": lambda llm, ref: agreement(llm, ref, "bf16"),
    **{f: (lambda llm, ref: agreement(llm, ref, "kv")) for f in KV_DTYPES},
    "tp2": cell_fp32,
    # Reference: transformers fp32 on the dequantized weights. W8A8 also
    # quantizes activations (per token, dynamic): the looser bound.
    "w8a8": lambda llm, ref: agreement(llm, ref, "quant"),
    "awq": lambda llm, ref: agreement(llm, ref, "bf16"),
    "gptq": lambda llm, ref: agreement(llm, ref, "bf16"),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m integration.compat.cells")
    p.add_argument("row")
    p.add_argument("folder")
    p.add_argument("--features", default=",".join(FEATURES))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--log", type=Path, default=None, help="this process's stderr file (for engine errors)")
    args = p.parse_args(argv)
    run_row(args.row, args.folder, args.features.split(","), args.out, args.log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
