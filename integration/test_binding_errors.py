"""Binding and memory errors surface from a real engine start, naming the numbers.

Opt-in (one engine start, ~1 minute): CPU_BACKEND_LONG_TESTS=1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("CPU_BACKEND_LONG_TESTS") != "1",
                       reason="long: set CPU_BACKEND_LONG_TESTS=1"),
]

REPO = Path(__file__).parents[1]
SCRIPT = (
    "from vllm import LLM\n"
    "if __name__ == '__main__':\n"
    "    import sys\n"
    "    LLM(model=sys.argv[1], dtype='float32', max_model_len=256)\n"
)


def test_kv_larger_than_the_node_is_refused_before_weights_load(tiny_llama):
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "5000", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, tiny_llama], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "NodeMemoryError: NUMA node" in proc.stderr + proc.stdout
    assert "5000.00 GiB KV cache" in proc.stderr + proc.stdout
