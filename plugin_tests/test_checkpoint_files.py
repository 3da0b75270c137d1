"""cpu_backend.worker.checkpoint_files finds truncated and garbled safetensors files."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from cpu_backend.worker.checkpoint_files import damaged_safetensors, explain


def test_whole_truncated_and_garbled_files(tmp_path):
    save_file({"a": torch.zeros(64), "b": torch.ones(3, 5)}, tmp_path / "good.safetensors")
    data = (tmp_path / "good.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-10])
    (tmp_path / "head.safetensors").write_bytes(data[:20])
    (tmp_path / "junk.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00nope!")
    bad = {p.name: why for p, why in damaged_safetensors(tmp_path)}
    assert set(bad) == {"cut.safetensors", "head.safetensors", "junk.safetensors"}
    assert "truncated" in bad["cut.safetensors"]
    msg = str(explain(str(tmp_path), RuntimeError("incomplete metadata")))
    assert "cut.safetensors" in msg and "incomplete metadata" in msg and str(tmp_path) in msg
