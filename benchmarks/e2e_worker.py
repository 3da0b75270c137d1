"""One end-to-end benchmark run: one backend, one model, one dtype, in this process.

Started by ``benchmarks/e2e.py`` in a fresh subprocess whose environment picks the
backend (``VLLM_PLUGINS`` unset: ours; ``VLLM_PLUGINS=none``: the host's in-tree
CPU backend). Prints exactly one stdout line starting with ``E2E_RESULT `` followed
by a JSON object; everything else (vLLM's logs) is noise to the caller.

    .venv/bin/python -m benchmarks.e2e_worker --model DIR --dtype bfloat16 [--enforce-eager]
        [--ttft-reps 5] [--decode-reps 3] [--num-prompts 64]

Measured, all with token-id prompts and ``SamplingParams(temperature=0, ignore_eos=True)``:
- start_s: wall time of ``LLM(...)`` (construction until the engine is ready);
- ttft_s: median wall time of single requests, 128-token prompt, max_tokens=1;
- decode_tok_s: batch 1, 128-token prompt, 128 new tokens: 127 / (total - median ttft),
  median over repetitions;
- throughput: NUM_PROMPTS random 128-token prompts x 128 new tokens in one
  ``generate`` call (after one warm-up call), output tokens / wall time.
Every request uses fresh random prompt tokens, so the prefix cache never hits.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
import traceback

MARKER = "E2E_RESULT "
PROMPT_LEN = 128
OUTPUT_LEN = 128
WARMUP_LENGTHS = (96, 160, 128)


def _emit(result: dict) -> None:
    sys.stdout.flush()
    print(MARKER + json.dumps(result), flush=True)


def _engine_info(llm) -> dict:
    info: dict = {}
    with contextlib.suppress(Exception):
        from vllm.platforms import current_platform

        info["platform"] = type(current_platform).__qualname__
        info["platform_module"] = type(current_platform).__module__
    with contextlib.suppress(Exception):
        cfg = llm.llm_engine.vllm_config
        mode = getattr(cfg.compilation_config, "mode", None)
        info["compilation_mode"] = getattr(mode, "name", str(mode))
        info["enforce_eager"] = bool(cfg.model_config.enforce_eager)
        info["max_num_seqs"] = cfg.scheduler_config.max_num_seqs
        info["async_scheduling"] = bool(cfg.scheduler_config.async_scheduling)
        info["max_num_batched_tokens"] = cfg.scheduler_config.max_num_batched_tokens
        info["max_model_len"] = cfg.model_config.max_model_len
        info["model_dtype"] = str(cfg.model_config.dtype)
        info["prefix_caching"] = bool(cfg.cache_config.enable_prefix_caching)
    # Ours only: what the worker really runs. Not asked of the host's worker: its
    # engine treats the failed RPC as fatal and the next generate() waits forever.
    if info.get("platform_module", "").startswith("cpu_backend"):
        (rep,) = llm.collective_rpc("cpu_backend_report")
        info["report"] = {k: rep[k] for k in ("worker", "attention_backends") if k in rep}
    return info


def run(args, result: dict) -> None:
    import numpy as np

    t_import = time.perf_counter()
    from vllm import LLM, SamplingParams

    import_s = time.perf_counter() - t_import

    kwargs = dict(model=args.model, dtype=args.dtype, seed=0)
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    if args.max_model_len:
        kwargs["max_model_len"] = args.max_model_len
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - t0
    result.update(import_s=import_s, start_s=start_s, engine=_engine_info(llm))

    try:
        vocab = llm.llm_engine.model_config.get_vocab_size()
        with contextlib.suppress(Exception):
            vocab = min(vocab, len(llm.get_tokenizer()))
        rng = np.random.default_rng(args.seed)

        def prompts(n: int, length: int = PROMPT_LEN) -> list[dict]:
            ids = rng.integers(100, vocab, size=(n, length))
            return [{"prompt_token_ids": row.tolist()} for row in ids]

        def params(max_tokens: int):
            return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)

        def timed(batch, max_tokens: int) -> tuple[float, list]:
            t = time.perf_counter()
            outs = llm.generate(batch, params(max_tokens), use_tqdm=False)
            return time.perf_counter() - t, outs

        # Warm-up: first requests pay one-off costs (allocations, lazy init).
        # Prompts of a few lengths, as a server sees them before it is timed:
        # an engine that prepares per step size (compiled or recorded graphs)
        # has then seen more than one.
        for length in WARMUP_LENGTHS:
            timed(prompts(1, length), 8)

        ttfts = [timed(prompts(1), 1)[0] for _ in range(args.ttft_reps)]
        ttft = statistics.median(ttfts)
        result.update(ttft_s=ttft, ttft_samples=ttfts)

        totals, rates = [], []
        for _ in range(args.decode_reps):
            dt, outs = timed(prompts(1), OUTPUT_LEN)
            n_out = len(outs[0].outputs[0].token_ids)
            assert n_out == OUTPUT_LEN, f"got {n_out} tokens"
            totals.append(dt)
            rates.append((OUTPUT_LEN - 1) / max(dt - ttft, 1e-9))
        result.update(decode_tok_s=statistics.median(rates), decode_samples=rates,
                      decode_total_s=totals)

        # Throughput, like `vllm bench throughput --dataset-name random`, greedy.
        timed(prompts(args.warmup_prompts), args.warmup_tokens)
        batch = prompts(args.num_prompts)
        dt, outs = timed(batch, OUTPUT_LEN)
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        assert n_out == args.num_prompts * OUTPUT_LEN, f"got {n_out} output tokens"
        result.update(
            throughput_s=dt, throughput_out_tok_s=n_out / dt,
            throughput_total_tok_s=(n_out + args.num_prompts * PROMPT_LEN) / dt,
            num_prompts=args.num_prompts,
        )
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--max-model-len", type=int, default=0)
    ap.add_argument("--ttft-reps", type=int, default=5)
    ap.add_argument("--decode-reps", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--warmup-prompts", type=int, default=16)
    ap.add_argument("--warmup-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    result: dict = {}
    try:
        run(args, result)  # fills result as it goes: a failure keeps what was measured
        result["ok"] = True
    except BaseException as exc:  # reported, not raised: the caller makes a row of it
        traceback.print_exc()
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
    result["vllm_plugins"] = os.environ.get("VLLM_PLUGINS")
    _emit(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
