"""`vllm serve` with our plugin, driven by the `openai` client, and the same
command with the plugin filtered out (the host's in-tree backend)."""

from __future__ import annotations

import pytest

from integration.server import serve

SERVE_ARGS = ("--max-model-len", "1024", "--served-model-name", "smol")
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(smollm2_bf16):
    # The copy `./run.sh serve` serves: bf16 on disk, served as bf16.
    with serve(smollm2_bf16, *SERVE_ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")


def test_server_runs_our_platform(server):
    log = server.log()
    assert "cpu_backend: platform=CpuBackendPlatform attention=CPU_BACKEND_ATTN" in log
    assert "worker=CpuBackendWorker" in log


def test_serving_the_bf16_copy_converts_no_weight(server):
    # The host warns once per weight whose dtype differs from the served one
    # (122 lines for an fp32 copy served in bf16).
    assert "Attempted to load weight" not in server.log()


def test_start_up_lines_logged_once(server):
    from cpu_backend import topology

    # The API server logs the plan and the platform line; the engine core
    # configures the platform again, quietly.
    log = server.log().splitlines()
    for marker in ("planned as", "cpu_backend: platform="):
        lines = [line for line in log if marker in line]
        assert len(lines) == 1 and "(APIServer" in lines[0], (marker, lines)
    plan = next(line for line in log if "planned as" in line)
    assert f"planned as '{topology.plan_from_env(1).host_value()}'" in plan


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["smol"]


def test_completion_is_the_greedy_continuation(client):
    out = client.completions.create(model="smol", prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.choices[0].text.startswith(" Paris.")
    assert out.usage.completion_tokens == 8


def test_streaming_completion_equals_non_streaming(client):
    full = client.completions.create(model="smol", prompt=PROMPT, max_tokens=24, temperature=0)
    chunks = client.completions.create(
        model="smol", prompt=PROMPT, max_tokens=24, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full.choices[0].text


def test_chat_completion(client):
    # A question the bf16 model answers with a clear greedy lead (top-1 ahead
    # of top-2 by >= 0.75 nats at each token up to "Paris", measured). "What is
    # the capital of France?" ties exactly in bf16 at its first token ("The" and
    # "L", both -1.835), so any change in summation order may flip its answer.
    messages = [{"role": "user", "content": "Name the capital city of France."}]
    out = client.chat.completions.create(
        model="smol", messages=messages, max_tokens=32, temperature=0
    )
    assert "Paris" in out.choices[0].message.content
    stream = client.chat.completions.create(
        model="smol", messages=messages, max_tokens=32, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == out.choices[0].message.content


def test_metrics_count_the_requests(client, server):
    client.completions.create(model="smol", prompt=PROMPT, max_tokens=5, temperature=0)
    metrics = server.get("/metrics")
    lines = [line for line in metrics.splitlines() if line.startswith("vllm:generation_tokens_total")]
    assert lines and float(lines[0].split()[-1]) >= 5
    assert "vllm:num_requests_running" in metrics


def test_same_command_without_our_plugin_runs_the_host_backend(smollm2, server):
    import openai

    # `none` matches no plugin name: vLLM loads no plugins, the in-tree CPU
    # platform is chosen. --enforce-eager only shortens its start-up here.
    with serve(smollm2, *SERVE_ARGS, "--enforce-eager", env={"VLLM_PLUGINS": "none"}) as host:
        log = host.log()
        client = openai.OpenAI(base_url=host.base_url + "/v1", api_key="unused")
        out = client.completions.create(model="smol", prompt=PROMPT, max_tokens=8, temperature=0)
    assert "cpu_backend:" not in log
    assert "CpuBackend" not in log
    assert out.choices[0].text.startswith(" Paris.")
