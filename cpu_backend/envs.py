"""The `VLLM_CPU_*` environment variables, parsed and validated in one place.

They keep the meaning vLLM's CPU documentation gives them. Every bad value
raises `EnvError` naming the variable and what it accepts, at engine start-up,
before any request is taken; `cpu_backend.topology` raises the same error for
a binding the machine cannot honour. The CPU-list grammar
(`parse_cpu_list` / `format_cpu_list`) is here, shared by the variables and
sysfs. Reads are not cached: tests and the host change `os.environ` between
engines. Stdlib only: everything else imports this module.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass

KVCACHE_SPACE = "VLLM_CPU_KVCACHE_SPACE"
OMP_THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"
NUM_OF_RESERVED_CPU = "VLLM_CPU_NUM_OF_RESERVED_CPU"
MOE_PREPACK = "VLLM_CPU_MOE_PREPACK"
SGL_KERNEL = "VLLM_CPU_SGL_KERNEL"
# Ours: force an ISA path (see cpu_backend.isa), e.g. "portable" in tests.
BACKEND_ISA = "VLLM_CPU_BACKEND_ISA"
# Ours: run an unquantized LM head on an int8 copy of its weight.
LM_HEAD_QUANT = "VLLM_CPU_BACKEND_LM_HEAD_QUANT"
LM_HEAD_QUANT_CHOICES = ("auto", "none", "int8")
# Ours: replay small steps from captured graphs (cpu_backend.worker.step_graphs), default 1.
STEP_GRAPHS = "VLLM_CPU_BACKEND_STEP_GRAPHS"
# Ours: run a single rank's worker inside the engine-core process, default 0.
WORKER_IN_ENGINE = "VLLM_CPU_BACKEND_WORKER_IN_ENGINE"
# Ours: move the loaded weights onto transparent huge pages, default 1.
HUGE_PAGE_WEIGHTS = "VLLM_CPU_BACKEND_HUGE_PAGE_WEIGHTS"
# Ours: where the config/tokenizer folders derived from GGUF files are cached.
GGUF_CACHE = "VLLM_CPU_BACKEND_GGUF_CACHE"
# Ours: the shared-memory all-reduce of ranks on one host (cpu_backend.shm_group):
# 1 (default) or 0 to force gloo, the slot size per rank, and how long a rank
# waits for its peers before a clear error.
SHM = "VLLM_CPU_BACKEND_SHM"
SHM_SLOT_MB = "VLLM_CPU_BACKEND_SHM_SLOT_MB"
SHM_TIMEOUT_S = "VLLM_CPU_BACKEND_SHM_TIMEOUT_S"
# Names these had before the VLLM_CPU_BACKEND_ prefix; still read, with a warning.
DEPRECATED_ALIASES = {
    SHM: "CPU_BACKEND_SHM",
    SHM_SLOT_MB: "CPU_BACKEND_SHM_SLOT_MB",
    SHM_TIMEOUT_S: "CPU_BACKEND_SHM_TIMEOUT_S",
}
# The host's: serve 4-bit checkpoints with int8 activations (W4A8), default 1.
INT4_W4A8 = "VLLM_CPU_INT4_W4A8"
# The host's own flags, read with bool(int(...)) deep inside its workers.
HOST_INT_FLAGS = ("VLLM_CPU_CI_ENV", "VLLM_CPU_ATTN_SPLIT_KV", INT4_W4A8)

_GiB = 1 << 30
# One rank's CPU list: ranges and single ids, "0-3,8"; ranks are joined by "|".
_CPU_LIST_RE = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


class EnvError(ValueError):
    """A `VLLM_CPU_*` variable holds a value we cannot use: `expected` says
    what it accepts, or `why` says why this value cannot be honoured."""

    def __init__(self, name: str, value: str, expected: str | None = None, *, why: str | None = None):
        super().__init__(f"{name}={value!r} is invalid: {why or f'expected {expected}'}.")
        self.name = name


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    if value is None and name in DEPRECATED_ALIASES:
        old = DEPRECATED_ALIASES[name]
        value = os.environ.get(old)
        if value is not None:
            warnings.warn(f"{old} is deprecated: set {name} instead", FutureWarning, stacklevel=3)
    return None if value is None or value.strip() == "" else value.strip()


def _not_empty(name: str, expected: str) -> None:
    """The host reads some variables with int() whenever they are set: an
    empty value would crash its workers with a bare "invalid literal"."""
    if name in os.environ and _raw(name) is None:
        raise EnvError(name, os.environ[name], f"{expected} (or unset it)")


def kvcache_space_bytes() -> int | None:
    """KV-cache size from `VLLM_CPU_KVCACHE_SPACE` (whole GiB); None means automatic.

    As documented for vLLM's CPU backend, 0 (the default) means automatic.
    Whole numbers only: the host parses the variable with int() in every
    process. Finer sizes: `--kv-cache-memory-bytes`.
    """
    _not_empty(KVCACHE_SPACE, "a whole number of GiB >= 0")
    value = _raw(KVCACHE_SPACE)
    if value is None:
        return None
    if not value.strip().isdigit():
        raise EnvError(
            KVCACHE_SPACE, value,
            "a whole number of GiB >= 0 (0 = automatic), e.g. 4; "
            "for other sizes use --kv-cache-memory-bytes",
        )
    gib = int(value)
    return None if gib == 0 else gib * _GiB


def parse_cpu_list(text: str, name: str = OMP_THREADS_BIND, value: str | None = None) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5]; the variables and sysfs files share this syntax.
    A bad list raises EnvError for `name`=`value` (default: the list itself)."""
    text = text.strip()
    if not text:
        return []
    if not _CPU_LIST_RE.match(text):
        raise EnvError(name, value or text, why=f"{text!r} is not a CPU list like '0-3,8,10-11'")
    ids: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if hi and int(lo) > int(hi):
            raise EnvError(name, value or text, why=f"range {part!r} must be written low-high")
        ids.extend(range(int(lo), int(hi or lo) + 1))
    return ids


def format_cpu_list(ids) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    ids = sorted(set(ids))
    parts, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


@dataclass(frozen=True)
class ThreadsBind:
    """`VLLM_CPU_OMP_THREADS_BIND`: 'auto', 'all', 'nobind' or per-rank lists."""

    mode: str  # "auto" | "all" | "nobind" | "lists"
    cpu_lists: tuple[tuple[int, ...], ...] = ()


def omp_threads_bind() -> ThreadsBind:
    """The value's syntax, and CPUs this process may run on (its affinity
    mask: the kernel keeps it inside the online CPUs and the cgroup cpuset).
    The per-rank plan (count of lists, NUMA spans) is cpu_backend.topology's."""
    value = _raw(OMP_THREADS_BIND) or "auto"
    if value in ("auto", "all", "nobind"):
        return ThreadsBind(value)
    ranks = value.split("|")
    if not all(_CPU_LIST_RE.match(r) for r in ranks):
        raise EnvError(
            OMP_THREADS_BIND,
            value,
            "'auto', 'all', 'nobind', or CPU lists per rank such as '0-31|32-63'",
        )
    lists = tuple(tuple(parse_cpu_list(r, OMP_THREADS_BIND, value)) for r in ranks)
    allowed = os.sched_getaffinity(0)
    missing = sorted({c for ids in lists for c in ids} - allowed)
    if missing:
        raise EnvError(
            OMP_THREADS_BIND, value, f"CPUs this process may use ({format_cpu_list(allowed)}); "
            f"not {format_cpu_list(missing)}"
        )
    return ThreadsBind("lists", lists)


def num_reserved_cpus() -> int | None:
    _not_empty(NUM_OF_RESERVED_CPU, "a whole number of CPUs >= 0")
    value = _raw(NUM_OF_RESERVED_CPU)
    if value is None:
        return None
    if not value.isdigit():
        raise EnvError(NUM_OF_RESERVED_CPU, value, "a whole number of CPUs >= 0")
    return int(value)


def _flag(name: str) -> bool | None:
    value = _raw(name)
    if value is None:
        return None
    if value not in ("0", "1"):
        raise EnvError(name, value, "0 or 1")
    return value == "1"


def moe_prepack() -> bool | None:
    return _flag(MOE_PREPACK)


def sgl_kernel() -> bool | None:
    return _flag(SGL_KERNEL)


def step_graphs() -> bool:
    """`VLLM_CPU_BACKEND_STEP_GRAPHS`: 1 (default) or 0 to run every step eagerly."""
    return _flag(STEP_GRAPHS) is not False


def worker_in_engine() -> bool:
    """`VLLM_CPU_BACKEND_WORKER_IN_ENGINE`: 1 (default) runs a single rank's
    worker in the engine-core process, 0 in a process of its own (the host's
    layout)."""
    return _flag(WORKER_IN_ENGINE) is not False


def huge_page_weights() -> bool:
    """`VLLM_CPU_BACKEND_HUGE_PAGE_WEIGHTS`: 1 (default) or 0 to leave the
    loaded weights where the loader put them (cpu_backend.worker.huge_pages)."""
    return _flag(HUGE_PAGE_WEIGHTS) is not False


def lm_head_quant() -> str:
    """`VLLM_CPU_BACKEND_LM_HEAD_QUANT`: 'auto' (default: int8 for quantized
    checkpoints, see cpu_backend.quantization.lm_head.resolve_mode), 'none' or 'int8'."""
    value = (_raw(LM_HEAD_QUANT) or "auto").lower()
    if value not in LM_HEAD_QUANT_CHOICES:
        raise EnvError(LM_HEAD_QUANT, os.environ[LM_HEAD_QUANT], f"one of {list(LM_HEAD_QUANT_CHOICES)}")
    return value


def gguf_cache_dir() -> str:
    """`VLLM_CPU_BACKEND_GGUF_CACHE`: the folder for what is derived from GGUF
    files (default `$XDG_CACHE_HOME/vllm-cpu-backend/gguf`, `~/.cache/...`
    without XDG_CACHE_HOME). It must not be an existing file."""
    value = _raw(GGUF_CACHE)
    if value is None:
        base = _raw("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "vllm-cpu-backend", "gguf")
    path = os.path.abspath(os.path.expanduser(value))
    if os.path.exists(path) and not os.path.isdir(path):
        raise EnvError(GGUF_CACHE, os.environ[GGUF_CACHE], "a directory (this is a file)")
    return path


def shm() -> bool:
    """`VLLM_CPU_BACKEND_SHM`: 1 (default) or 0 to force gloo between ranks
    on one host (to compare, or to test the multi-host path)."""
    return _flag(SHM) is not False


def _positive(name: str, default: float, expected: str, kind=float) -> float:
    value = _raw(name)
    if value is None:
        return default
    try:
        number = kind(value)
    except ValueError:
        number = 0
    if not number > 0:
        raise EnvError(name, value, expected)
    return number


def shm_slot_bytes() -> int:
    """`VLLM_CPU_BACKEND_SHM_SLOT_MB`: MiB of shared memory per rank and
    message parity (default 8); larger messages go through gloo."""
    return _positive(SHM_SLOT_MB, 8, "a whole number of MiB > 0, e.g. 8", int) << 20


def shm_timeout_s() -> float:
    """`VLLM_CPU_BACKEND_SHM_TIMEOUT_S`: seconds a rank waits for its peers
    in a shared-memory collective before raising (default 600)."""
    return _positive(SHM_TIMEOUT_S, 600.0, "a number of seconds > 0, e.g. 600")


def int4_w4a8() -> bool:
    """`VLLM_CPU_INT4_W4A8`, read as the host reads it (bool(int(...)), default 1):
    whether 4-bit weight-only linears quantize their activations to int8."""
    value = _raw(INT4_W4A8)
    if value is None:
        return True
    try:
        return bool(int(value))
    except ValueError:
        raise EnvError(INT4_W4A8, os.environ[INT4_W4A8], "0 or 1") from None


def host_int_flags() -> None:
    """The host's integer flags must parse as the host parses them."""
    for name in HOST_INT_FLAGS:
        if name in os.environ:
            try:
                int(os.environ[name])
            except ValueError:
                raise EnvError(name, os.environ[name], "0 or 1") from None


def validate_all() -> None:
    """Parse every variable once so a bad one fails at start-up."""
    host_int_flags()
    kvcache_space_bytes()
    omp_threads_bind()
    num_reserved_cpus()
    moe_prepack()
    sgl_kernel()
    lm_head_quant()
    step_graphs()
    shm()
    shm_slot_bytes()
    shm_timeout_s()
    worker_in_engine()
    huge_page_weights()
    gguf_cache_dir()
