"""The Hugging Face folder the host reads for a GGUF file: config and tokenizer.

vLLM reads a model's config.json and tokenizer from a folder. For a GGUF file
both are derived once from the file's own metadata by transformers (its GGUF
integration maps every architecture we load and converts the embedded
tokenizer to a fast one), written to a folder under the cache directory
(`VLLM_CPU_BACKEND_GGUF_CACHE`, default `$XDG_CACHE_HOME/vllm-cpu-backend/gguf`,
never beside the user's file), and reused while the file's path, size and
modification time stay the same. The weights stay in the GGUF file:
config.json's `quantization_config` names it (`quant_method:
"cpu_backend_gguf"`) and lists every tensor's block type, so each process
picks its layers' methods without re-reading the file's metadata, and our
model loader (load format "gguf") reads the tensors from it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from cpu_backend import envs

QUANT_METHOD = "cpu_backend_gguf"
_RECIPE = 2  # bump when what is written changes
_MARKER = ".cpu_backend_gguf.json"


def is_gguf_file(model: object) -> bool:
    return isinstance(model, (str, os.PathLike)) and os.fspath(model).endswith(".gguf") \
        and os.path.isfile(model)


def _source_key(path: str) -> dict:
    st = os.stat(path)
    return {"gguf_file": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "recipe": _RECIPE}


def prepare(gguf_file: str | os.PathLike) -> str:
    """The folder (config.json, tokenizer, generation config) for `gguf_file`,
    derived on first use. Raises GGUFFileError for a file we cannot serve."""
    from cpu_backend.gguf.checkpoint import GGUFFileError

    path = os.path.abspath(os.fspath(gguf_file))
    if not os.path.isfile(path):
        raise GGUFFileError(f"{path}: no such GGUF file")
    key = _source_key(path)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(envs.gguf_cache_dir())
    dest = root / f"{Path(path).stem}-{digest}"
    if _complete(dest, key):
        return str(dest)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _locked(root / f".{dest.name}.lock"):
            if not _complete(dest, key):
                tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=root))
                try:
                    _derive(path, tmp)
                    (tmp / _MARKER).write_text(json.dumps(key))
                    shutil.rmtree(dest, ignore_errors=True)
                    os.replace(tmp, dest)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:  # read-only, not ours, full: say where and what to set
        raise GGUFFileError(
            f"{path}: cannot write its derived config and tokenizer into {root} "
            f"({e.strerror or e}); set {envs.GGUF_CACHE} to a writable folder") from None
    return str(dest)


def _complete(dest: Path, key: dict) -> bool:
    try:
        return json.loads((dest / _MARKER).read_text()) == key
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _locked(lock: Path):
    with open(lock, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _derive(path: str, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from cpu_backend.gguf.checkpoint import GGUFCheckpoint, GGUFFileError

    ckpt = GGUFCheckpoint(path)  # checks the file before transformers reads it
    folder, name = os.path.split(path)
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except ImportError as e:  # transformers reads GGUF metadata with the `gguf` package
        raise GGUFFileError(f"{path}: reading a GGUF file's config and tokenizer needs the `gguf` "
                            f"package (pip install gguf): {e}") from None
    except (ValueError, KeyError, OSError) as e:
        raise GGUFFileError(f"{path}: transformers cannot derive the config or tokenizer of "
                            f"this {ckpt.architecture} GGUF file ({e})") from None
    if not config.architectures:  # transformers' GGUF config names none; the causal LM class
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.quantization_config = {
        "quant_method": QUANT_METHOD,
        "gguf_file": path,
        "tensor_types": ckpt.tensor_types,
    }
    # Activations in bf16 unless --dtype says otherwise (the weights stay in
    # their blocks either way; our kernels run bf16 on every ISA).
    config.dtype = "bfloat16"
    if "lm_head.weight" not in ckpt.tensor_types:
        config.tie_word_embeddings = True
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    add_bos = ckpt.fields.get("tokenizer.ggml.add_bos_token")
    if add_bos is not None:
        _patch_json(out / "tokenizer_config.json", add_bos_token=bool(add_bos))
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=getattr(config, "pad_token_id", None)).save_pretrained(out)


def _patch_json(path: Path, **updates) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(updates)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
