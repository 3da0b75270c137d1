"""Our sampler: replaces the host's `vllm.v1.sample.sampler.Sampler` in our
model runner, for one method: `greedy_sample`.

Why: on a CPU platform the host's greedy path calls `torch.ops._C.greedy_argmax`,
which is ATen's argmax over each row of logits: a scalar compare-and-track
loop on one thread, ~0.3 ms for one row of a 151936-token vocabulary on a
2-core AVX2 VM (2% of a decode step of a 0.5B int4 model). Ours
(`cpu_backend::argmax_rows`, csrc/argmax.cpp) takes two vector passes over
the row, rows in parallel, with torch.argmax's result: the first index of
the maximum, a NaN counting as the maximum. Everything else (temperature,
top-k/p, penalties, logprobs) stays the host's.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.sampler import Sampler

from cpu_backend import host_compat, stats
from cpu_backend.ops import load

_FLOAT_LOGITS = (torch.float32, torch.bfloat16, torch.float16)


class CpuBackendSampler(Sampler):
    @staticmethod
    def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
        if logits.dim() == 2 and logits.shape[1] > 0 and logits.dtype in _FLOAT_LOGITS:
            load()
            stats.count("greedy_rows", logits.shape[0])
            return torch.ops.cpu_backend.argmax_rows(logits)
        return Sampler.greedy_sample(logits)


def replacing(sampler: object) -> Sampler | None:
    """Ours, configured as the host's `sampler`; None where we keep the host's
    (another sampler class, or a constructor we do not know)."""
    if type(sampler) is not Sampler:
        return None
    if not host_compat.matches("sampler_init"):
        return None
    return CpuBackendSampler(logprobs_mode=sampler.logprobs_mode,
                             use_fp64_gumbel=sampler.use_fp64_gumbel)
