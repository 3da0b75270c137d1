"""Name the damaged file when a safetensors checkpoint cannot be read.

The host's loader lets safetensors' own error through ("Error while
deserializing header: incomplete metadata, file not fully covered"), which
names neither the file nor the model. A safetensors file is an 8-byte header
length, a JSON header and the tensor data: a file is whole when the header
parses and the last tensor ends exactly at the end of the file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path


class CheckpointFileError(RuntimeError):
    pass


def damaged_safetensors(model_dir: str | Path) -> list[tuple[Path, str]]:
    """(file, what is wrong) for every unreadable *.safetensors in `model_dir`."""
    bad = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        size = path.stat().st_size
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if 8 + n > size:
                    raise ValueError(f"header of {n} bytes, file of {size}")
                header = json.loads(f.read(n))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"),
                      default=0)
            if 8 + n + end != size:
                raise ValueError(f"{size} bytes, the header describes {8 + n + end} (truncated?)")
        except (struct.error, ValueError, KeyError, TypeError) as e:
            bad.append((path, str(e) or type(e).__name__))
    return bad


def explain(model: str, error: Exception) -> CheckpointFileError:
    bad = damaged_safetensors(model) if Path(model).is_dir() else []
    files = "; ".join(f"{p}: {why}" for p, why in bad) or "(no damaged file found by name)"
    return CheckpointFileError(
        f"model {model}: a weight file cannot be read ({error}). Damaged: {files}")
