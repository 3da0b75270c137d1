"""Bad input: bad requests against one running server get an HTTP 4xx and the
server stays healthy; bad start-up settings stop `vllm serve` with an error
naming the setting; corrupt, missing and mis-shaped quantized tensors stop the
engine with an error naming the tensor or file.

Already covered elsewhere (not repeated here): each VLLM_CPU_* parser
(plugin_tests/test_envs.py), bad settings in the platform's config check
(plugin_tests/test_config_errors.py: block size, KV dtype, head size, bind
lists vs TP), KV sizes beyond the machine and below one sequence
(integration/test_engine_memory.py), KV beyond the NUMA node
(integration/test_binding_errors.py), unsupported quantization configs
(integration/test_engine_quantized.py).

Default run: one server for the requests (~30 s start) and three `vllm serve`
starts that must fail. `CPU_BACKEND_LONG_TESTS=1`: a failing `vllm serve` per
VLLM_CPU_* variable and per quantized-tensor fault (~20 s each).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.error
import urllib.request

import pytest

from integration import reliability as rel
from integration.server import run_vllm, serve

pytestmark = [pytest.mark.slow, pytest.mark.reliability]

MODEL = "tiny"
MAX_LEN = 256


@pytest.fixture(scope="module")
def server(tiny_llama):
    with serve(tiny_llama, "--served-model-name", MODEL, "--dtype", "float32",
               "--max-model-len", str(MAX_LEN)) as s:
        yield s


def _post(server, path: str, body) -> tuple[int, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server.base_url + path, data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def config_env(monkeypatch):
    """The config check may write the translated bind plan into os.environ
    (cpu_backend.platform._plan_threads_bind): restore it after the test."""
    from cpu_backend.platform import _BIND_TRANSLATED

    for key in ("VLLM_CPU_OMP_THREADS_BIND", _BIND_TRANSLATED):
        if key in os.environ:
            monkeypatch.setenv(key, os.environ[key])
        else:
            monkeypatch.delenv(key, raising=False)
    return monkeypatch


BAD_REQUESTS = {
    "max_tokens beyond max_model_len": {"prompt": "hello", "max_tokens": MAX_LEN + 1},
    "prompt longer than max_model_len": {"prompt": [5] * (MAX_LEN + 10), "max_tokens": 4},
    "empty prompt": {"prompt": "", "max_tokens": 4},
    "empty token list": {"prompt": [], "max_tokens": 4},
    "token id outside the vocabulary": {"prompt": [5, 10**7], "max_tokens": 4},
    "negative token id": {"prompt": [5, -3], "max_tokens": 4},
    "huge n": {"prompt": "hello", "max_tokens": 4, "n": 10**9},
    "n = 0": {"prompt": "hello", "max_tokens": 4, "n": 0},
    "logit_bias key not a token id": {"prompt": "hello", "max_tokens": 4,
                                      "logit_bias": {"not-a-token": 5}},
    "logit_bias token outside the vocabulary": {"prompt": "hello", "max_tokens": 4,
                                                "logit_bias": {"99999999": 5}},
    "logit_bias value not a number": {"prompt": "hello", "max_tokens": 4,
                                      "logit_bias": {"5": "lots"}},
    "negative max_tokens": {"prompt": "hello", "max_tokens": -1},
    "negative temperature": {"prompt": "hello", "max_tokens": 4, "temperature": -1},
    "top_p above 1": {"prompt": "hello", "max_tokens": 4, "top_p": 2},
    "huge logprobs": {"prompt": "hello", "max_tokens": 4, "logprobs": 10**6},
    "unknown model": {"prompt": "hello", "max_tokens": 4, "model": "nope"},
    "malformed JSON": b'{"prompt": "hello", "max_tokens": ',
}


def test_bad_requests_get_4xx_and_the_server_stays_up(server):
    results = {}
    for name, body in BAD_REQUESTS.items():
        if isinstance(body, dict):
            body = {"model": MODEL, **body}
        status, text = _post(server, "/v1/completions", body)
        healthy = server.get("/health") is not None
        results[name] = (status, healthy, text[:160])
    # A good request still gets its tokens after all that.
    status, good = _post(server, "/v1/completions",
                         {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0})
    rows = {name: {"status": s, "healthy_after": h} for name, (s, h, _) in results.items()}
    rel.record("bad_input", "requests", {"cases": rows, "good_request_after": status})
    for name, (s, h, text) in results.items():
        print(f"{name}: {s} {text}")
    bad = {n: r for n, r in results.items() if not (400 <= r[0] < 500 and r[1])}
    assert not bad, bad
    assert status == 200 and json.loads(good)["usage"]["completion_tokens"] == 4
    assert server.proc.poll() is None


# --- start-up -------------------------------------------------------------

def _serve_fails(model: str, env: dict, *args: str) -> str:
    code, out = run_vllm(["serve", model, "--max-model-len", "256", "--port", "1", *args],
                         env=env, timeout=400)
    assert code != 0, out[-3000:]
    assert "Application startup complete" not in out
    return out


# Every VLLM_CPU_* variable we read or the host reads, with a malformed value.
BAD_ENV = [
    ("VLLM_CPU_KVCACHE_SPACE", "lots"),
    ("VLLM_CPU_KVCACHE_SPACE", ""),
    ("VLLM_CPU_OMP_THREADS_BIND", "0-x"),
    ("VLLM_CPU_OMP_THREADS_BIND", str(max(os.sched_getaffinity(0)) + 64)),  # not allowed
    ("VLLM_CPU_NUM_OF_RESERVED_CPU", "one"),
    ("VLLM_CPU_MOE_PREPACK", "yes"),
    ("VLLM_CPU_SGL_KERNEL", "2"),
    ("VLLM_CPU_BACKEND_ISA", "sse9"),
    ("VLLM_CPU_BACKEND_LM_HEAD_QUANT", "int4"),
    ("VLLM_CPU_CI_ENV", "yes"),
    ("VLLM_CPU_ATTN_SPLIT_KV", "on"),
    ("VLLM_CPU_INT4_W4A8", "true"),
]
# The default run starts one `vllm serve` (a bind outside the allowed CPUs);
# every case goes through the platform's config check in-process below.
DEFAULT_ENV = {BAD_ENV[3]}


@pytest.mark.parametrize("name,value", BAD_ENV, ids=[f"{n}={v!r}" for n, v in BAD_ENV])
def test_malformed_variable_fails_the_config_check(tiny_llama, config_env, name, value):
    """What `vllm serve` runs first: EngineArgs -> VllmConfig -> our
    check_and_update_config, in this process (no engine)."""
    from vllm.engine.arg_utils import EngineArgs

    config_env.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(f"{name}={value!r} is invalid")):
        EngineArgs(model=tiny_llama, max_model_len=256).create_engine_config()
    rel.record("bad_input", f"env {name}={value!r}", {"refused": True, "path": "config check"})


@pytest.mark.parametrize("name,value", [
    pytest.param(n, v, marks=[] if (n, v) in DEFAULT_ENV or rel.LONG else pytest.mark.skip(
        "long: CPU_BACKEND_LONG_TESTS=1")) for n, v in BAD_ENV
], ids=[f"{n}={v!r}" for n, v in BAD_ENV])
def test_malformed_variable_stops_serve_naming_it(tiny_llama, name, value):
    out = _serve_fails(tiny_llama, {name: value})
    assert f"{name}={value!r} is invalid" in out, out[-3000:]
    # Refused while the config is built: no engine process was started.
    assert "EngineCore" not in out, out[-3000:]
    rel.record("bad_input", f"env {name}={value!r} (vllm serve)",
               {"refused": True, "path": "vllm serve"})


BAD_ENGINE_ARGS = [
    ({"dtype": "float64"}, "dtype"),
    ({"dtype": "int8"}, "dtype"),
    ({"kv_cache_dtype": "int3"}, "cache_dtype"),  # pydantic names the CacheConfig field
    ({"kv_cache_dtype": "nvfp4"}, "--kv-cache-dtype nvfp4"),  # a host dtype we do not run
    ({"block_size": 24}, "--block-size 24"),
]


@pytest.mark.parametrize("kwargs,named", BAD_ENGINE_ARGS,
                         ids=[next(iter(k.items())).__str__() for k, _ in BAD_ENGINE_ARGS])
def test_unsupported_dtype_kv_dtype_block_size_fail_the_config_check(tiny_llama, config_env,
                                                                     kwargs, named):
    """The host's own validation or our platform's: either way the setting is named.
    (Unsupported head sizes: plugin_tests/test_config_errors.py.)"""
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(Exception) as info:
        EngineArgs(model=tiny_llama, max_model_len=256, **kwargs).create_engine_config()
    assert named in str(info.value), str(info.value)[:2000]
    key, value = next(iter(kwargs.items()))
    rel.record("bad_input", f"--{key.replace('_', '-')} {value}",
               {"refused": True, "path": "config check"})


# --- quantized checkpoints ------------------------------------------------

@pytest.fixture(scope="module")
def gptq(tiny_llama, tmp_path_factory):
    from cpu_backend.tools.quantize import quantize_checkpoint

    out = tmp_path_factory.mktemp("gptq") / "gptq"
    quantize_checkpoint(tiny_llama, out, "gptq", 4, 32, True, False, None)
    return out


def _faulty(gptq, tmp_path, fault: str):
    """A copy of the GPTQ checkpoint with one fault; returns (folder, tensor named)."""
    import torch
    from safetensors.torch import load_file, save_file

    bad = tmp_path / fault
    shutil.copytree(gptq, bad)
    weights = bad / "model.safetensors"
    name = "model.layers.1.mlp.down_proj.qweight"
    if fault == "truncated-file":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
        return bad, "model.safetensors"
    state = load_file(weights)
    if fault == "missing-tensor":
        del state[name]
    elif fault == "mis-shaped-tensor":
        state[name] = state[name][:-1].contiguous()
    elif fault == "wrong-dtype-tensor":
        state[name] = state[name].to(torch.float32)
    save_file(state, weights, metadata={"format": "pt"})
    return bad, name


QUANT_FAULTS = ["mis-shaped-tensor", "truncated-file", "missing-tensor", "wrong-dtype-tensor"]


@pytest.mark.parametrize("fault", [
    pytest.param(f, marks=[] if f == "mis-shaped-tensor" or rel.LONG else pytest.mark.skip(
        "long: CPU_BACKEND_LONG_TESTS=1")) for f in QUANT_FAULTS])
def test_faulty_quantized_checkpoint_stops_serve_naming_the_tensor(gptq, tmp_path, fault):
    folder, named = _faulty(gptq, tmp_path, fault)
    out = _serve_fails(str(folder), {"VLLM_CPU_KVCACHE_SPACE": "1"}, "--dtype", "float32")
    tail = out[-6000:]
    rel.record("bad_input", f"quantized checkpoint: {fault}",
               {"refused": True, "named": named in out, "path": "vllm serve"})
    assert named in out or named.rsplit(".", 1)[0] in out, tail
