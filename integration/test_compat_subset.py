"""CI lane of the compatibility matrix: a few architectures, fp32 and bf16,
through the same code as `python -m integration.compat` (one subprocess per
row, `integration.compat.cells`).

Rows chosen for what they exercise beyond the Llama tests: GPT-NeoX (partial
rotary, parallel residual), Gemma2 (attention and final soft-capping, sliding
window on alternate layers), Qwen3 (q/k norm). Select the lane with
`pytest -m compat`; the full matrix is `python -m integration.compat`.
"""

from __future__ import annotations

import pytest

from integration.compat.__main__ import run_row

pytestmark = [pytest.mark.compat, pytest.mark.slow]

ROWS = ["GPT-NeoX", "Gemma2", "Qwen3"]
FEATURES = ["fp32", "bf16"]


@pytest.mark.parametrize("row", ROWS)
def test_row_fp32_and_bf16(row, model_root, tmp_path):
    result = run_row(row, FEATURES, model_root, tmp_path)
    cells = result["cells"]
    failed = {f: c.get("reason") for f, c in cells.items() if not c["ok"]}
    assert not failed, f"{row}: {failed} (log: {result.get('log')})"
    assert set(cells) == set(FEATURES)
    # Our attention backend served every layer (not the host's).
    assert "CPU_BACKEND_ATTN" in cells["fp32"]["ran"], cells["fp32"]["ran"]
