"""Our fused-MoE experts in real engines: tiny Mixtral and Qwen3-MoE (4 experts,
top-2) through `LLM(...)` in fp32, greedy tokens identical to transformers fp32
(6 prompts x 32 tokens, the compatibility matrix's fp32 cell, plus its prefix
cache and chunked prefill cells on the same engine).

The worker report proves which MoE path ran: every MoE layer's method is
`CpuBackendUnquantizedFusedMoEMethod` with `CpuBackendMoEExperts` (not the
host's CPU experts), and our experts were called. Mixtral runs with the
default (weights prepacked for cpu_backend::linear), Qwen3-MoE with
`VLLM_CPU_MOE_PREPACK=0` (plain weights): both settings meet the reference.

The W8A8 cell of Qwen2-MoE runs its int8 experts on our `CpuBackendW8A8MoEMethod`.

Long lane (CPU_BACKEND_LONG_TESTS=1): GPTQ and compressed-tensors weight-only
MoE checkpoints on our WNA16 experts against transformers on the dequantized
weights (AWQ/GPTQ 4-bit also run in the compatibility matrix's cells).
"""

from __future__ import annotations

import os
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


def test_w8a8_moe_on_our_int8_experts(model_root, tmp_path):
    """The compatibility matrix's W8A8 cell on Qwen2-MoE (experts, shared expert
    and attention int8 W8A8 with dynamic per-token activations; router not
    quantized): our `CpuBackendW8A8MoEMethod` serves every MoE layer (the host's
    needs AMX) and the bf16 engine meets the cell's bound against transformers
    on the dequantized weights."""
    result = run_row("Qwen2-MoE", ["w8a8"], model_root, tmp_path)
    cell = result["cells"]["w8a8"]
    assert cell["ok"], f"{cell.get('reason')} (log: {result.get('log')})"
    assert "MoE CpuBackendW8A8MoEMethod/CpuBackendW8A8MoEExperts (" in cell["ran"], cell["ran"]
    assert int(re.search(r"\((\d+) calls of ours\)", cell["ran"]).group(1)) > 0


LONG = pytest.mark.skipif(os.environ.get("CPU_BACKEND_LONG_TESTS") != "1",
                          reason="long: set CPU_BACKEND_LONG_TESTS=1 to run")
QUANT_CASES = {
    # row: (format, bits, group_size, sym) written by cpu_backend.tools.quantize
    "Mixtral": ("compressed-tensors", 4, 32, False),
    "Qwen3-MoE": ("gptq", 8, -1, False),
}


@LONG
@pytest.mark.usefixtures("exact_lm_head")  # the reference's head is the checkpoint's
@pytest.mark.parametrize("row", list(QUANT_CASES))
def test_quantized_moe_matches_dequantized_transformers(row, model_root, tmp_path):
    """Weight-only MoE checkpoints (experts quantized, router not) on our
    WNA16 experts, fp32 activations: greedy tokens identical to transformers
    fp32 on the dequantized weights (reference dequantizers of
    plugin_tests/quant_reference.py)."""
    from cpu_backend.quantization import register
    from cpu_backend.tools.quantize import quantize_checkpoint
    from integration.compat import archs, checkpoints
    from integration.conftest import greedy, hf_greedy, report, running_llm
    from integration.test_engine_quantized import dequantized_reference, random_prompts

    register()
    fmt, bits, gs, sym = QUANT_CASES[row]
    qdir = tmp_path / "q"
    quantize_checkpoint(checkpoints.build(archs.get(row), model_root), qdir, fmt, bits, gs, sym,
                        False, None)
    dense = dequantized_reference(qdir, tmp_path / "dense")
    prompts = random_prompts([1, 6, 17, 40])
    with running_llm(str(qdir), dtype="float32", block_size=16) as llm:
        got = [list(o.outputs[0].token_ids) for o in greedy(llm, prompts, 24)]
        rep = report(llm)
    assert rep["moe_methods"] == ["CpuBackendWNA16MoEMethod/CpuBackendWNA16MoEExperts"], rep
    assert rep["moe_experts_calls"] > 0
    assert got == hf_greedy(str(dense), prompts, 24)
