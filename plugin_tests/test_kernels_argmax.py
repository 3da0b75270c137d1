"""cpu_backend::argmax_rows (csrc/argmax.cpp, greedy sampling) on every ISA
library against torch.argmax(dim=-1), exactly: the first index of the
maximum, the first NaN where a row holds one.

Rows: lengths 1, 15, 16, 17, 1000 and 151936 (Qwen2.5's vocabulary), float32 /
bfloat16 / float16; ties (the maximum repeated, a bf16 row with few distinct
values), the maximum in the tail past the last whole vector, -0.0 beside 0.0,
all -inf, -inf masks, +inf, NaN before and after the maximum; strided rows
(the host's vocab-trimmed view of padded logits); 0 to 9 rows. The reference
for the scalar rule is torch itself.
"""

from __future__ import annotations

import json
import sys

import pytest

from cpu_backend import stats

try:
    from plugin_tests.isa_worker import ISA_PATHS, run_worker
except ImportError:  # run as the worker script
    ISA_PATHS, run_worker = [], None


def _rows(torch, gen):
    """(label, logits [rows, vocab]) cases."""
    inf, nan = float("inf"), float("nan")
    for n in (1, 15, 16, 17, 1000, 151936):
        for rows in (1, 3):
            yield f"random n={n} rows={rows}", torch.randn(rows, n, generator=gen)
    coarse = (torch.randn(4, 1000, generator=gen) * 2).round()  # many equal maxima
    yield "ties", coarse
    tail = torch.randn(2, 1000, generator=gen)
    tail[:, 995] = 9.0  # past the last whole vector of 16
    yield "max in the tail", tail
    zeros = torch.full((1, 40), -1.0)
    zeros[0, 7], zeros[0, 3] = 0.0, -0.0
    yield "-0.0 before 0.0", zeros
    yield "all -inf", torch.full((2, 100), -inf)
    masked = torch.randn(2, 1000, generator=gen)
    masked[:, ::3] = -inf
    yield "-inf mask", masked
    for where in (0, 5, 17, 500, 999):
        row = torch.randn(1, 1000, generator=gen)
        row[0, where] = inf
        yield f"+inf at {where}", row
        for big in (3, 998):
            row = torch.randn(1, 1000, generator=gen)
            row[0, big] = 50.0
            row[0, where] = nan
            yield f"NaN at {where}, max at {big}", row
    padded = torch.randn(3, 1024, generator=gen)
    yield "strided rows", padded[:, :1000]
    for rows in (0, 9):
        yield f"{rows} rows", torch.randn(rows, 333, generator=gen)


def _worker() -> dict:
    import os

    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from cpu_backend import ops

    isa = ops.load()
    gen = torch.Generator().manual_seed(3)
    failures, cases = [], 0
    for label, logits in _rows(torch, gen):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = logits.to(dtype)
            got = torch.ops.cpu_backend.argmax_rows(x)
            want = torch.argmax(x, dim=-1)
            cases += 1
            if got.dtype != torch.int64 or not torch.equal(got, want):
                failures.append(f"{label} {dtype}: {got.tolist()[:8]} != {want.tolist()[:8]}")
    return {"isa": isa, "cases": cases, "failures": failures}


@pytest.mark.parametrize("isa_path", ISA_PATHS)
def test_argmax_rows_matches_torch(isa_path):
    result = run_worker(__file__, isa_path)
    assert result["cases"] > 100
    assert result["failures"] == [], result["failures"][:20]


def test_argmax_rows_rejects_bad_logits():
    import torch

    from cpu_backend import ops

    ops.load()
    for bad in (torch.randn(3), torch.randn(2, 0), torch.randn(2, 3, 4)):
        with pytest.raises(RuntimeError, match="cpu_backend::argmax_rows: logits must be"):
            torch.ops.cpu_backend.argmax_rows(bad)
    with pytest.raises(RuntimeError, match="logits must be float32, bfloat16 or float16"):
        torch.ops.cpu_backend.argmax_rows(torch.ones(2, 3, dtype=torch.int32))


def test_sampler_replaces_only_the_host_greedy_argmax():
    import torch
    from vllm.v1.sample.sampler import Sampler

    from cpu_backend.worker import sampler

    host = Sampler(logprobs_mode="processed_logprobs")
    ours = sampler.replacing(host)
    assert type(ours) is sampler.CpuBackendSampler
    assert ours.logprobs_mode == "processed_logprobs"
    assert sampler.replacing(ours) is None  # not a host Sampler: kept
    logits = torch.randn(4, 5000)
    before = stats.get("greedy_rows")
    assert torch.equal(ours.greedy_sample(logits), logits.argmax(dim=-1))
    assert stats.get("greedy_rows") == before + 4


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    print(json.dumps(_worker()))
