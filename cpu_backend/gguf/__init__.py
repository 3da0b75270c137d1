"""GGUF files served as they are: `vllm serve /path/model.gguf`.

- `checkpoint.py`: the file (the `gguf` package's reader), its checks and its
  tensors under Hugging Face names;
- `blocks.py`: each block type as the integer view of our weight-only kernel,
  bit-exact with llama.cpp's dequantization;
- `model_dir.py`: the config/tokenizer folder derived from the metadata
  (cached), whose config.json names the file and the "cpu_backend_gguf"
  quantization;
- `quant.py`: that quantization config and its linear / embedding methods;
- `loader.py`: load format "gguf";
- `cli.py`: the serve command's model argument typed to accept a `.gguf` path.

From Python: `LLM(cpu_backend.gguf.prepare("/path/model.gguf"))`.
"""

from __future__ import annotations


def prepare(gguf_file) -> str:
    """The model folder to give `LLM(...)` / `vllm serve` for a GGUF file."""
    from cpu_backend.gguf.model_dir import prepare as _prepare

    return _prepare(gguf_file)
