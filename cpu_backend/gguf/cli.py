"""`vllm serve /path/model.gguf`: the model argument names a GGUF file.

The host reads a model's config (and probes it for speculators) from the
model argument as a folder or hub id before any plugin hook sees the engine
arguments, so a `.gguf` path fails there. The hook it gives platforms before
it parses a command line, `Platform.pre_register_and_update(parser)`, lets us
type the serve command's model arguments (`model_tag`, `--model`): a path to
a `.gguf` file becomes the folder derived from it (cpu_backend.gguf.model_dir)
and everything else is left as it is. The path as typed stays the served
model name unless --served-model-name says otherwise. `LLM(...)` builds its engine arguments without a parser:
there, `cpu_backend.gguf.prepare(path)` gives the folder to pass.
"""

from __future__ import annotations

import argparse

MODEL_DESTS = ("model_tag", "model")
# derived folder -> the GGUF path as the user typed it, in this process
_typed: dict[str, str] = {}


def model_argument(value: str) -> str:
    from cpu_backend.gguf.model_dir import is_gguf_file, prepare

    if not is_gguf_file(value):
        return value
    from cpu_backend.gguf.checkpoint import GGUFFileError

    try:
        folder = prepare(value)
    except GGUFFileError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    _typed[folder] = value
    return folder


def served_name_of(folder: str) -> str | None:
    return _typed.get(folder)


class _ModelAction(argparse._StoreAction):
    """Stores the (converted) model argument; for a GGUF file also the path as
    typed as the served name, unless --served-model-name is given (the API
    server names the model from the parsed arguments)."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        typed = served_name_of(values) if isinstance(values, str) else None
        if typed and getattr(namespace, "served_model_name", None) is None:
            namespace.served_model_name = [typed]


def install(parser: argparse.ArgumentParser) -> None:
    """Type the parser's model arguments (and its sub-commands')."""
    for action in parser._actions:  # argparse keeps no public list
        if action.dest in MODEL_DESTS and action.type in (None, str):
            action.type = model_argument
            if type(action) is argparse._StoreAction:
                action.__class__ = _ModelAction
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                install(sub)
