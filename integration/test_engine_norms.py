"""Every RMSNorm of Qwen3 and Gemma3 served in bf16 runs on our kernel
(csrc/norm.cpp): the per-head q/k norms, which get a [tokens, heads, head_dim]
view into the fused qkv output, and Gemma's `x * (1 + w)`, whose weight the
host's GemmaRMSNorm passes in fp32. Until both were covered these norms fell
through to the host's native implementation (5-7 eager ops each).

Checked on the compatibility matrix's random checkpoints: the decode steps'
graphs call no native norm op (`aten::rsqrt`), and the served model keeps the
matrix's bf16 agreement with transformers (integration/compat/cells.agreement).
"""

from __future__ import annotations

import pytest

from integration.compat.__main__ import checkpoint
from integration.compat.cells import Reference, agreement
from integration.conftest import greedy, report, running_llm


@pytest.mark.parametrize("row", ["Qwen3", "Gemma3"])
def test_every_norm_runs_on_our_kernel_in_bf16(row, model_root):
    folder = str(checkpoint(row, model_root))
    with running_llm(folder, dtype="bfloat16", max_model_len=256) as llm:
        detail = agreement(llm, Reference(folder), "bf16")
        before = report(llm)["step_graphs"]["op_calls"]
        greedy(llm, [[5, 17, 29, 3]], 8)  # decode steps: replayed graphs
        after = report(llm)["step_graphs"]["op_calls"]
    calls = {op: n - before.get(op, 0) for op, n in after.items() if n > before.get(op, 0)}
    assert calls.get("cpu_backend::rms_norm", 0) > 0, calls
    assert not [op for op in calls if op in ("aten::rsqrt", "aten::pow.Tensor_Scalar")], (calls, detail)
