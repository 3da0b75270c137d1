"""The host (vLLM) methods our overrides replace, checked by signature in one place.

An override is only correct while the host method it replaces takes the
parameters it was written for. Each `HostApi` names that method, those
parameters and the feature of ours that needs it; where the host has moved,
the override is left out (the host's own method runs) and the feature is off.
`log_checks()` says so in one line at worker start-up instead of features
switching off silently. Signatures, not version strings: the host's API may
move in any release.

Checks that raise instead (the whole piece cannot work without them) stay
beside their code: `ops/moe_layers.py`, `quantization/w8a8*.py`; custom ops
that keep the host's class on a mismatch log it in `ops/custom_ops.py`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass


@dataclass(frozen=True)
class HostApi:
    feature: str
    module: str
    qualname: str  # "Class.method"
    params: tuple[str, ...]

    def current(self) -> list[str]:
        obj = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return list(inspect.signature(obj).parameters)


_RUNNER = "vllm.v1.worker.cpu_model_runner"
APIS = {
    "kv_cache_init": HostApi(
        "KV cache on huge pages, its set-up logged", _RUNNER, "CPUModelRunner.initialize_kv_cache",
        ("self", "kv_cache_config", "is_profiling", "kv_cache_allocation_context")),
    "model_forward": HostApi(
        "step graphs", _RUNNER, "CPUModelRunner._model_forward",
        ("self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds", "model_kwargs")),
    "reorder_batch": HostApi(
        "no batch reorder for one request", _RUNNER, "CPUModelRunner._may_reorder_batch",
        ("self", "scheduler_output")),
    # The host constructs its sampler with these (gpu_model_runner.__init__).
    "sampler_init": HostApi(
        "greedy sampling kernel", "vllm.v1.sample.sampler", "Sampler.__init__",
        ("self", "logprobs_mode", "use_fp64_gumbel")),
}


@functools.cache
def matches(key: str) -> bool:
    """Whether the host method behind APIS[key] takes the parameters we override."""
    api = APIS[key]
    return api.current() == list(api.params)


def mismatches() -> list[str]:
    return [key for key in APIS if not matches(key)]


def log_checks(logger) -> None:
    """One line: every check matched, or which features are off and why."""
    off = mismatches()
    if not off:
        logger.debug("cpu_backend: the %d host methods we override take the parameters we expect",
                     len(APIS))
        return
    logger.warning_once(
        "cpu_backend: host methods changed, these features are off (the host's code runs): %s",
        "; ".join(f"{APIS[k].feature} ({APIS[k].qualname}{tuple(APIS[k].current())}, "
                  f"expected {APIS[k].params})" for k in off))
