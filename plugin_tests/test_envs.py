"""`VLLM_CPU_*` variables: accepted values parse, bad ones name the variable."""

from __future__ import annotations

import platform

import pytest

from cpu_backend import envs, isa


@pytest.mark.parametrize(
    "name,value",
    [
        ("VLLM_CPU_KVCACHE_SPACE", "lots"),
        ("VLLM_CPU_KVCACHE_SPACE", "-1"),
        ("VLLM_CPU_KVCACHE_SPACE", "inf"),
        ("VLLM_CPU_OMP_THREADS_BIND", "0-x"),
        ("VLLM_CPU_OMP_THREADS_BIND", "3-1"),
        ("VLLM_CPU_OMP_THREADS_BIND", "0-1|"),
        ("VLLM_CPU_OMP_THREADS_BIND", "99999"),
        ("VLLM_CPU_NUM_OF_RESERVED_CPU", "one"),
        ("VLLM_CPU_MOE_PREPACK", "yes"),
        ("VLLM_CPU_SGL_KERNEL", "2"),
        ("VLLM_CPU_BACKEND_ISA", "sse9"),
        ("VLLM_CPU_BACKEND_LM_HEAD_QUANT", "int4"),
        ("VLLM_CPU_BACKEND_STEP_GRAPHS", "on"),
        ("VLLM_CPU_BACKEND_WORKER_IN_ENGINE", "yes"),
        ("VLLM_CPU_BACKEND_HUGE_PAGE_WEIGHTS", "true"),
        ("VLLM_CPU_BACKEND_SHM", "no"),
        ("VLLM_CPU_BACKEND_SHM_SLOT_MB", "0"),
        ("VLLM_CPU_BACKEND_SHM_SLOT_MB", "1.5"),
        ("VLLM_CPU_BACKEND_SHM_TIMEOUT_S", "soon"),
        # Set but empty: the host would int('') inside its workers.
        ("VLLM_CPU_KVCACHE_SPACE", ""),
        ("VLLM_CPU_NUM_OF_RESERVED_CPU", " "),
        # The host's own integer flags.
        ("VLLM_CPU_CI_ENV", "yes"),
        ("VLLM_CPU_ATTN_SPLIT_KV", "on"),
        ("VLLM_CPU_INT4_W4A8", "true"),
    ],
)
def test_bad_values_raise_naming_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(envs.EnvError, match=name):
        envs.validate_all()
        isa.selected_path()


def test_kvcache_space(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert envs.kvcache_space_bytes() is None
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")
    assert envs.kvcache_space_bytes() is None  # documented: 0 = automatic
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    assert envs.kvcache_space_bytes() == 4 << 30
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.5")  # the host int()s it in every process
    with pytest.raises(envs.EnvError, match="--kv-cache-memory-bytes"):
        envs.kvcache_space_bytes()


@pytest.mark.parametrize("name,parser", [("VLLM_CPU_BACKEND_STEP_GRAPHS", "step_graphs"),
                                         ("VLLM_CPU_BACKEND_HUGE_PAGE_WEIGHTS", "huge_page_weights"),
                                         ("VLLM_CPU_BACKEND_WORKER_IN_ENGINE", "worker_in_engine"),
                                         ("VLLM_CPU_BACKEND_SHM", "shm")])
def test_flags_on_by_default(monkeypatch, name, parser):
    monkeypatch.delenv(name, raising=False)
    assert getattr(envs, parser)() is True
    for value, on in (("0", False), ("1", True), ("", True)):
        monkeypatch.setenv(name, value)
        assert getattr(envs, parser)() is on


def test_shm_sizes_and_deprecated_names(monkeypatch):
    for name in (*envs.DEPRECATED_ALIASES, *envs.DEPRECATED_ALIASES.values()):
        monkeypatch.delenv(name, raising=False)
    assert (envs.shm_slot_bytes(), envs.shm_timeout_s()) == (8 << 20, 600.0)
    monkeypatch.setenv("VLLM_CPU_BACKEND_SHM_SLOT_MB", "16")
    monkeypatch.setenv("VLLM_CPU_BACKEND_SHM_TIMEOUT_S", "2.5")
    assert (envs.shm_slot_bytes(), envs.shm_timeout_s()) == (16 << 20, 2.5)
    monkeypatch.delenv("VLLM_CPU_BACKEND_SHM_TIMEOUT_S")
    monkeypatch.setenv("CPU_BACKEND_SHM_TIMEOUT_S", "3")  # the old name still works, with a warning
    with pytest.warns(FutureWarning, match="set VLLM_CPU_BACKEND_SHM_TIMEOUT_S instead"):
        assert envs.shm_timeout_s() == 3.0
    monkeypatch.setenv("CPU_BACKEND_SHM", "0")
    with pytest.warns(FutureWarning, match="CPU_BACKEND_SHM is deprecated"):
        assert envs.shm() is False


def test_lm_head_quant(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_BACKEND_LM_HEAD_QUANT", raising=False)
    assert envs.lm_head_quant() == "auto"
    for value, mode in (("int8", "int8"), (" INT8 ", "int8"), ("none", "none"), ("", "auto"),
                        ("Auto", "auto")):
        monkeypatch.setenv("VLLM_CPU_BACKEND_LM_HEAD_QUANT", value)
        assert envs.lm_head_quant() == mode


def test_int4_w4a8_reads_as_the_host_reads_it(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_INT4_W4A8", raising=False)
    assert envs.int4_w4a8() is True  # the host's default
    for value, on in (("0", False), ("1", True), ("2", True), (" 0 ", False)):
        monkeypatch.setenv("VLLM_CPU_INT4_W4A8", value)
        assert envs.int4_w4a8() is on
    monkeypatch.setenv("VLLM_CPU_INT4_W4A8", "yes")
    with pytest.raises(envs.EnvError, match="VLLM_CPU_INT4_W4A8"):
        envs.int4_w4a8()


def test_threads_bind(monkeypatch):
    for mode in ("auto", "all", "nobind"):
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", mode)
        assert envs.omp_threads_bind().mode == mode
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    assert envs.omp_threads_bind().cpu_lists == ((0,), (1,))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert envs.omp_threads_bind().cpu_lists == ((0, 1),)


def test_isa_paths_are_ordered_and_forceable(monkeypatch):
    supported = isa.supported_paths()
    assert supported[-1] == "portable"
    monkeypatch.delenv("VLLM_CPU_BACKEND_ISA", raising=False)
    assert isa.selected_path() == supported[0]
    monkeypatch.setenv("VLLM_CPU_BACKEND_ISA", "portable")
    assert isa.selected_path() == "portable"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 ISA paths")
def test_isa_detection_from_flags():
    assert isa.supported_paths(frozenset({"avx2", "fma", "f16c"})) == ["avx2", "portable"]
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    # without avx512_bf16 (Skylake-X .. Ice Lake) the avx512 library would fault
    assert isa.supported_paths(frozenset({"avx2", "fma", "f16c", *avx512})) == ["avx2", "portable"]
    # without avx512_vnni the W8A8 kernel's VPDPBUSD would fault
    assert isa.supported_paths(frozenset({"avx2", "fma", "f16c", "avx512_bf16", *avx512})) == [
        "avx2", "portable",
    ]
    assert isa.supported_paths(
        frozenset({"avx2", "fma", "f16c", "avx512_bf16", "avx512_vnni", *avx512})
    ) == ["avx512", "avx2", "portable"]
    assert isa.supported_paths(frozenset({"avx2"})) == ["portable"]  # no FMA
    # AVX-VNNI without AVX-512 (Alder Lake and later client parts)
    assert isa.supported_paths(frozenset({"avx2", "fma", "f16c", "avx_vnni"})) == ["avx_vnni", "avx2", "portable"]
    assert isa.supported_paths(
        frozenset({"avx2", "fma", "f16c", "avx_vnni", "avx512_bf16", "avx512_vnni", *avx512})
    ) == ["avx512", "avx_vnni", "avx2", "portable"]
