"""Our fused-MoE experts in real engines: tiny Mixtral and Qwen3-MoE (4 experts,
top-2) through `LLM(...)` in fp32, greedy tokens identical to transformers fp32
(6 prompts x 32 tokens, the compatibility matrix's fp32 cell, plus its prefix
cache and chunked prefill cells on the same engine).

The worker report proves which MoE path ran: every MoE layer's method is
`CpuBackendUnquantizedFusedMoEMethod` with `CpuBackendMoEExperts` (not the
host's CPU experts), and our experts were called. Mixtral runs with the
default (weights prepacked for cpu_backend::linear), Qwen3-MoE with
`VLLM_CPU_MOE_PREPACK=0` (plain weights): both settings meet the reference.
"""

from __future__ import annotations

import re

import pytest

from integration.compat.__main__ import run_row

pytestmark = [pytest.mark.slow]

OURS = "MoE CpuBackendUnquantizedFusedMoEMethod/CpuBackendMoEExperts ("
FEATURES = ["fp32", "prefix_cache", "chunked_prefill"]


@pytest.mark.parametrize("row,prepack", [("Mixtral", None), ("Qwen3-MoE", "0")])
def test_moe_greedy_identical_on_our_experts(row, prepack, model_root, tmp_path, monkeypatch):
    if prepack is None:
        monkeypatch.delenv("VLLM_CPU_MOE_PREPACK", raising=False)
    else:
        monkeypatch.setenv("VLLM_CPU_MOE_PREPACK", prepack)
    result = run_row(row, FEATURES, model_root, tmp_path)
    cells = result["cells"]
    failed = {f: c.get("reason") for f, c in cells.items() if not c["ok"]}
    assert not failed, f"{row}: {failed} (log: {result.get('log')})"
    ran = cells["fp32"]["ran"]
    assert OURS in ran, ran
    calls = int(re.search(r"\((\d+) calls of ours\)", ran).group(1))
    assert calls > 0, ran


def test_bad_prepack_value_fails_engine_start_naming_it(model_root, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_MOE_PREPACK", "yes")
    result = run_row("Mixtral", ["fp32"], model_root, tmp_path)
    cell = result["cells"]["fp32"]
    assert not cell["ok"]
    assert "VLLM_CPU_MOE_PREPACK='yes' is invalid" in cell["reason"], cell["reason"]
