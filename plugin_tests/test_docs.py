"""The documentation builds (`mkdocs build --strict`), tolerates pages added
without a nav entry, and states the errors users get exactly as the code
raises them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
CONFIGURATION = (DOCS / "configuration.md").read_text()


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True, text=True, timeout=300,
    )


def test_mkdocs_build_strict(tmp_path):
    proc = _mkdocs_build(REPO / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    site = tmp_path / "site"
    for page in ("install", "quickstart", "configuration", "features", "compatibility",
                 "performance", "tuning", "troubleshooting", "architecture"):
        assert (site / page / "index.html").exists(), page
    # benchmarks/results/ is published: the performance page's plots resolve.
    assert (site / "results" / "e2e_avx2.png").exists()
    assert 'src="../results/e2e_avx2.png"' in (site / "performance" / "index.html").read_text()


def _copy_site_sources(tmp_path: Path) -> Path:
    """mkdocs.yml pointing at a copy of docs/ (the hook stays the repo's)."""
    docs = tmp_path / "docs"
    shutil.copytree(DOCS, docs)
    text = (REPO / "mkdocs.yml").read_text()
    text = text.replace("docs_dir: docs", f"docs_dir: {docs}")
    text = text.replace("  - mkdocs_hooks.py", f"  - {REPO / 'mkdocs_hooks.py'}")
    config = tmp_path / "mkdocs.yml"
    config.write_text(text)
    return config


def test_a_new_page_needs_no_nav_entry_but_a_broken_link_fails(tmp_path):
    config = _copy_site_sources(tmp_path)
    new = tmp_path / "docs" / "kv_cache.md"
    new.write_text("# KV cache\n\nSee [the architecture](architecture.md).\n")
    proc = _mkdocs_build(config, tmp_path / "site")
    assert proc.returncode == 0, proc.stderr
    index = (tmp_path / "site" / "index.html").read_text()
    assert "kv_cache/" in index  # listed in the navigation, under "More"

    new.write_text("# KV cache\n\nSee [nothing](no_such_page.md).\n")
    proc = _mkdocs_build(config, tmp_path / "site2")
    assert proc.returncode != 0 and "no_such_page.md" in proc.stderr


BAD_ENV_VALUES = [
    ("VLLM_CPU_KVCACHE_SPACE", "lots", "kvcache_space_bytes"),
    ("VLLM_CPU_OMP_THREADS_BIND", "0-3;4-7", "omp_threads_bind"),
    ("VLLM_CPU_OMP_THREADS_BIND", "3-0", "omp_threads_bind"),
    ("VLLM_CPU_NUM_OF_RESERVED_CPU", "-1", "num_reserved_cpus"),
    ("VLLM_CPU_MOE_PREPACK", "yes", "moe_prepack"),
    ("VLLM_CPU_SGL_KERNEL", "true", "sgl_kernel"),
    ("VLLM_CPU_BACKEND_LM_HEAD_QUANT", "int4", "lm_head_quant"),
    ("VLLM_CPU_INT4_W4A8", "true", "int4_w4a8"),
    ("VLLM_CPU_BACKEND_HUGE_PAGE_WEIGHTS", "true", "huge_page_weights"),
    ("VLLM_CPU_BACKEND_GGUF_CACHE", "/etc/passwd", "gguf_cache_dir"),
    ("VLLM_CPU_BACKEND_SHM_TIMEOUT_S", "soon", "shm_timeout_s"),
]


@pytest.mark.parametrize("name,value,parser", BAD_ENV_VALUES)
def test_documented_env_error_is_the_real_one(monkeypatch, name, value, parser):
    from cpu_backend import envs

    monkeypatch.setenv(name, value)
    with pytest.raises(envs.EnvError) as err:
        getattr(envs, parser)()
    assert str(err.value) in CONFIGURATION


def test_every_variable_we_read_is_documented():
    from cpu_backend import envs

    names = {v for k, v in vars(envs).items() if k.isupper() and str(v).startswith("VLLM_CPU_")}
    assert len(names) >= 6
    for name in names:
        assert re.search(rf"^### .*`{name}`", CONFIGURATION, re.M), name


def test_documented_isa_and_cpu_list_errors_match(monkeypatch):
    from cpu_backend import envs, isa

    monkeypatch.setenv("VLLM_CPU_BACKEND_ISA", "amx512")
    with pytest.raises(envs.EnvError) as err:
        isa.selected_path()
    supported = isa.supported_paths()
    documented = re.search(r"^VLLM_CPU_BACKEND_ISA='amx512' .*$", CONFIGURATION, re.M).group(0)
    assert documented.replace("['avx512', 'avx_vnni', 'avx2', 'portable']", str(supported)) == str(err.value)

    cpus = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"0-{cpus[-1] + 1}")
    with pytest.raises(envs.EnvError) as err:
        envs.omp_threads_bind()
    prefix = str(err.value).split(" is invalid")[1].split("(")[0]  # ": expected CPUs this process may use "
    assert f"is invalid{prefix}(" in CONFIGURATION


def _config_error(build, **kwargs) -> str:
    """Our message, from inside pydantic's `1 validation error for VllmConfig`."""
    with pytest.raises(ValueError) as err:
        build(**kwargs)
    text = str(err.value)
    found = re.search(r"Value error, (.*?) \[type=value_error", text, re.S)
    return found.group(1) if found else text


def test_documented_option_errors_are_the_real_ones(llama_config_dir):
    from plugin_tests.test_config_errors import build_config

    model = llama_config_dir()
    assert _config_error(build_config, model=model, block_size=24) in CONFIGURATION
    assert _config_error(build_config, model=model, kv_cache_dtype="nvfp4") in CONFIGURATION
    model48 = llama_config_dir(head_dim=48)
    msg = _config_error(build_config, model=model48).replace(repr(model48), "'MODEL'")
    assert msg in CONFIGURATION

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from cpu_backend.platform import CpuBackendPlatform

    cfg = SimpleNamespace(use_mla=False, use_sparse=False)
    with pytest.raises(ValueError) as err:
        CpuBackendPlatform.get_attn_backend_cls(AttentionBackendEnum.FLASH_ATTN, cfg)
    assert str(err.value) in CONFIGURATION


def test_readme_links_into_existing_docs():
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert len(links) >= 5
    for link in links:
        assert (REPO / link).exists(), link
