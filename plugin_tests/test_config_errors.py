"""Bad configuration fails while vLLM builds its config (before any engine or
request), with an error naming the setting."""

from __future__ import annotations

import pytest


def build_config(model: str, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, skip_tokenizer_init=True, **kwargs).create_engine_config()


def test_good_config_gets_our_worker_and_defaults(llama_config_dir, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    cfg = build_config(llama_config_dir())
    assert cfg.parallel_config.worker_cls == "cpu_backend.worker.cpu_worker.CpuBackendWorker"
    assert cfg.cache_config.block_size == 64
    assert cfg.cache_config.kv_cache_memory_bytes == 2 << 30
    assert cfg.compilation_config.mode.name == "NONE"
    # vLLM's default, which the host turns off on CPU.
    assert cfg.scheduler_config.async_scheduling is True


def test_user_choices_are_kept(llama_config_dir, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")  # 0 = automatic
    cfg = build_config(
        llama_config_dir(), block_size=32, compilation_config={"mode": 3}, async_scheduling=False
    )
    assert cfg.cache_config.block_size == 32
    assert cfg.compilation_config.mode.name != "NONE"
    assert cfg.cache_config.kv_cache_memory_bytes != 0
    assert cfg.scheduler_config.async_scheduling is False


@pytest.mark.parametrize(
    "kwargs,env,match",
    [
        ({"block_size": 24}, {}, "--block-size 24"),
        ({"kv_cache_dtype": "nvfp4"}, {}, "--kv-cache-dtype nvfp4"),
        ({}, {"VLLM_CPU_KVCACHE_SPACE": "lots"}, "VLLM_CPU_KVCACHE_SPACE"),
        ({}, {"VLLM_CPU_OMP_THREADS_BIND": "0-x"}, "VLLM_CPU_OMP_THREADS_BIND"),
        ({}, {"VLLM_CPU_SGL_KERNEL": "maybe"}, "VLLM_CPU_SGL_KERNEL"),
    ],
)
def test_bad_setting_is_named(llama_config_dir, monkeypatch, kwargs, env, match):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        build_config(llama_config_dir(), **kwargs)


def test_unsupported_head_size_is_named(llama_config_dir):
    with pytest.raises(ValueError, match="head size 48"):
        build_config(llama_config_dir(head_dim=48))


def _bind_env(monkeypatch, value):
    from cpu_backend.platform import _BIND_TRANSLATED

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", value)
    monkeypatch.delenv(_BIND_TRANSLATED, raising=False)  # restored after the test
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)


def test_threads_bind_planned_into_explicit_lists_for_the_host(llama_config_dir, monkeypatch):
    import os

    from cpu_backend import topology

    _bind_env(monkeypatch, "auto")
    model = llama_config_dir()
    expected = {
        n: topology.plan(topology.discover(), "auto", n).host_value() for n in (1, 2)
    }
    build_config(model, tensor_parallel_size=2, distributed_executor_backend="mp")
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == expected[2]
    # A second engine in this process plans from the user's value, not ours.
    build_config(model)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == expected[1]
    _bind_env(monkeypatch, "all")
    build_config(model)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == topology.format_cpu_list(
        topology.discover().allowed
    )


def test_threads_bind_list_count_must_match_tp(llama_config_dir, monkeypatch):
    _bind_env(monkeypatch, "0")
    with pytest.raises(ValueError, match=r"VLLM_CPU_OMP_THREADS_BIND='0'.*2 local rank"):
        build_config(llama_config_dir(), tensor_parallel_size=2, distributed_executor_backend="mp")


def test_our_communicator_is_chosen():
    from vllm.platforms import current_platform

    assert current_platform.get_device_communicator_cls() == (
        "cpu_backend.communicator.CpuBackendCommunicator"
    )


def test_sgl_kernel_warns_once_moe_prepack_does_not(monkeypatch):
    from cpu_backend import platform

    lines = []
    monkeypatch.setattr(platform.logger, "warning", lambda msg, *a: lines.append(msg % a))
    monkeypatch.setattr(platform.logger, "info", lambda msg, *a: lines.append(msg % a))
    monkeypatch.setenv("LD_PRELOAD", "")
    monkeypatch.setenv("VLLM_CPU_MOE_PREPACK", "1")
    monkeypatch.setenv("VLLM_CPU_SGL_KERNEL", "1")
    platform._start_up_hints()
    # VLLM_CPU_MOE_PREPACK has an effect now (cpu_backend.ops.moe_layers).
    assert len(lines) == 2
    assert "libtcmalloc is not in LD_PRELOAD" in lines[0]
    assert "VLLM_CPU_SGL_KERNEL=1 has no effect" in lines[1]
    lines.clear()
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc_minimal.so.4")
    monkeypatch.setenv("VLLM_CPU_MOE_PREPACK", "0")
    monkeypatch.delenv("VLLM_CPU_SGL_KERNEL")
    platform._start_up_hints()
    assert lines == []
