"""Counts of what ran in this process: one registry for every hot path.

The worker's `cpu_backend_report` (read by tests through
`LLM.collective_rpc("cpu_backend_report")`) returns them, to prove that our
kernels ran and the host's did not. Kept apart from the classes that count,
so no hot-path class carries test state. A count is one dict increment
(`COUNTS[name] += n`); hot loops may bind `COUNTS` to a local first.

Names: `attention_forward`, `wna16_linear`, `w8a8_linear`, `moe_experts`,
`greedy_rows`, and `kernel:<class name>` per custom op (cpu_backend.ops.custom_ops).
"""

from __future__ import annotations

from collections import Counter

COUNTS: Counter[str] = Counter()
KERNEL_PREFIX = "kernel:"


def count(name: str, n: int = 1) -> None:
    COUNTS[name] += n


def get(name: str) -> int:
    return COUNTS[name]


def kernel_calls() -> dict[str, int]:
    """Calls per custom-op class, e.g. {'CpuBackendSiluAndMul': 12}."""
    return {k[len(KERNEL_PREFIX):]: v for k, v in COUNTS.items() if k.startswith(KERNEL_PREFIX)}
