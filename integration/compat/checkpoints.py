"""Tiny random-weight checkpoints for the rows of the matrix.

Same recipe as `integration.models` (locally trained BPE tokenizer, seeded
weights made peaky, a seed search so that greedy decoding never hinges on a
near-tie), generalised to any transformers causal-LM class: the output
embedding is found with `get_output_embeddings()` (GPT-NeoX calls it
`embed_out`), tied embeddings stay tied where vLLM's model ties them.
"""

from __future__ import annotations

from pathlib import Path

from integration import models
from integration.compat.archs import Arch


def build(arch: Arch, root: Path | str) -> Path:
    """The cached checkpoint folder of `arch` under `root`."""
    spec = {"arch": arch.name, "config": arch.config_cls, "kwargs": repr(sorted(arch.kwargs.items())),
            "tie": arch.tie_word_embeddings, "compat_recipe": 1}
    name = "compat-" + arch.name.lower().replace(" ", "-")
    return models._cached(root, name, spec, lambda out: _build(out, arch))


def _build(out: Path, arch: Arch) -> None:
    import torch
    import transformers
    from transformers import GenerationConfig

    tok = models._tiny_tokenizer("Qwen2" if arch.tokenizer == "qwen2" else arch.name)
    kwargs = dict(
        vocab_size=len(tok),
        initializer_range=0.15,  # attention scores with std ~3: position-sensitive
        tie_word_embeddings=arch.tie_word_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    kwargs.update(arch.kwargs)
    if kwargs.get("pad_token_id", 0) is None:
        kwargs["pad_token_id"] = tok.pad_token_id
    config = getattr(transformers, arch.config_cls)(**kwargs)
    config.dtype = torch.float32
    model_cls = getattr(transformers, arch.model_cls)
    for attempt in range(32):
        seed = arch.seed + 1000 * attempt
        model = _random_model(config, model_cls, tok, seed)
        _, margins = models._greedy_margins(model, tok)
        if min(margins) > models.TINY_MIN_MARGIN:
            break
    else:
        raise RuntimeError(f"no seed gives greedy margins > {models.TINY_MIN_MARGIN} for {arch.name}")
    models._log(f"{arch.name}: seed {seed}, min greedy margin {min(margins):.3g}")
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)
    models._patch_json(out / "tokenizer_config.json", add_bos_token=True, add_eos_token=False)
    models._check_tiny(out)


def _random_model(config, model_cls, tok, seed: int):
    import torch

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or name.endswith("ln_1.weight") or name.endswith("ln_2.weight"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=gen))
            elif name.endswith(".bias") or name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        head = model.get_output_embeddings().weight
        head.mul_(4.0)  # logit std ~7
        # Special and non-printable tokens get a zero output row: greedy text
        # stays printable and never ends early on EOS.
        head[models._unprintable_ids(tok)] = 0.0
    return model
