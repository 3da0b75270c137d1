"""The errors and checks every quantization method of ours shares.

Kept out of the methods' modules (config, moe, w8a8, w8a8_moe) so that each
imports them from here and none imports another to get them (no import loops).
"""

from __future__ import annotations

import torch


class QuantConfigError(ValueError):
    """A checkpoint's quantization_config asks for something we do not run."""


def is_our_platform() -> bool:
    from vllm.platforms import current_platform

    from cpu_backend.platform import CpuBackendPlatform

    return isinstance(current_platform, CpuBackendPlatform)


class QuantWeightError(ValueError):
    """A checkpoint tensor of a quantized layer does not fit its parameter."""


_QUANTIZED_DTYPES = {torch.int32: "int32 (packed quantized values)",
                     torch.int8: "int8 (quantized values)"}


def checked_loader(layer, loader):
    """The host's loaders fail on a mis-shaped checkpoint tensor with a bare
    torch error ("start (0) + length (32) exceeds dimension size (31)"), and
    would copy a float tensor into an int32 / int8 one without a word: name the
    tensor, its shape and dtype, and what the layer expects. Records what was
    loaded: the host does not check that a quantized model's tensors were all
    in the checkpoint (see check_all_loaded)."""
    if loader is None:
        return None
    loaded = layer.__dict__.setdefault("cpu_backend_loaded", {})

    def load(param, loaded_weight, *args, **kwargs):
        name = next((n for n, p in layer.named_parameters(recurse=False) if p is param), "?")
        where = f"{getattr(layer, 'prefix', type(layer).__name__)}.{name}"
        if args:
            where += f" (shard {args[0]})"
        got = f"{tuple(loaded_weight.shape)} {str(loaded_weight.dtype).replace('torch.', '')}"
        want = f"{tuple(param.shape)} {str(param.dtype).replace('torch.', '')}"
        if param.dtype in _QUANTIZED_DTYPES and loaded_weight.dtype != param.dtype:
            raise QuantWeightError(
                f"{where}: checkpoint tensor is {got}, expected {_QUANTIZED_DTYPES[param.dtype]}"
                " (if this layer is not quantized in the checkpoint, the quantization_config "
                "must list it in its ignore / modules_to_not_convert)")
        try:
            out = loader(param, loaded_weight, *args, **kwargs)
        except (RuntimeError, AssertionError, IndexError, ValueError) as e:
            raise QuantWeightError(
                f"{where}: checkpoint tensor {got} does not fit the layer's parameter {want} "
                f"({e or type(e).__name__})") from e
        loaded.setdefault(name, set()).add(args[0] if args else None)
        return out

    return load


def check_all_loaded(layer, required: tuple[str, ...]) -> None:
    """Every required tensor came from the checkpoint, for every shard of a
    fused layer (q/k/v, gate/up). Otherwise the layer would run on
    uninitialized memory: the host only checks unquantized models."""
    loaded = layer.__dict__.get("cpu_backend_loaded", {})
    shards = layer.__dict__.get("cpu_backend_wna16_shards", 1)
    prefix = getattr(layer, "prefix", type(layer).__name__)
    missing = [name for name in required
               if None not in loaded.get(name, set()) and len(loaded.get(name, set())) < shards]
    if missing:
        raise QuantWeightError(
            f"{prefix}: tensor(s) {', '.join(f'{prefix}.{m}' for m in missing)} missing from the "
            f"checkpoint (loaded shards: { {m: sorted(map(str, loaded.get(m, ()))) for m in missing} })")
