"""Our vLLM platform: replaces the host's `vllm.platforms.cpu.CpuPlatform`.

Why a subclass that keeps `PlatformEnum.CPU`: vLLM branches on
`current_platform.is_cpu()` in dozens of places (executor and OpenMP thread
binding, CPU tensor handling in the model runner, the gloo communicator, the
sampler, weight loading). Reporting `OOT` would switch all of those to GPU
code paths that do not work on a CPU (the stock worker dies on the sleep-mode
allocator). Keeping `CPU` keeps those paths and we take over, through the
platform's own hooks, exactly what we own:

- the attention backend (`get_attn_backend_cls`): ours, under our own name;
- the worker (`check_and_update_config` sets `worker_cls`), and where a single
  rank's worker runs: in the engine-core process, not a process of its own
  (`VLLM_CPU_BACKEND_WORKER_IN_ENGINE=0` keeps the host's worker process);
- validation of dtype, KV-cache dtype, block size, head size and the
  `VLLM_CPU_*` variables, with errors naming the setting, at start-up;
- defaults: eager execution (torch.compile costs ~1 min of start-up on a CPU
  and is opt-in with `--compilation-config '{"mode": 3}'`), a smaller KV block
  and (in the worker) a KV-cache size that does not refuse to start on a
  busy machine;
- async scheduling as vLLM decides it (on unless the user or an incompatible
  option turns it off): the host switches it off on CPU, but with its CPU
  worker's stream/event stand-ins it works there, and it overlaps the engine's
  scheduling and output handling with the worker's forward pass (batch-1
  decode ~8% faster here, same tokens).
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger
from vllm.platforms.cpu import CpuPlatform
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from cpu_backend import envs, isa

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.selector import AttentionSelectorConfig

logger = init_logger(f"vllm.{__name__}")

ATTENTION_BACKEND_NAME = "CPU_BACKEND_ATTN"
ATTENTION_BACKEND_QUALNAME = "cpu_backend.attention.backend.CpuBackendAttentionBackend"
WORKER_QUALNAME = "cpu_backend.worker.cpu_worker.CpuBackendWorker"
THREAD_EXECUTOR_QUALNAME = "cpu_backend.worker.thread_executor.WorkerThreadExecutor"
DEFAULT_BLOCK_SIZE = 64
BLOCK_SIZE_MULTIPLE = 16


def _register_attention_backend_name() -> AttentionBackendEnum:
    """Make `--attention-backend CPU_BACKEND_ATTN` a valid choice."""
    if ATTENTION_BACKEND_NAME in AttentionBackendEnum.__members__:
        return AttentionBackendEnum[ATTENTION_BACKEND_NAME]
    return AttentionBackendEnum.register(ATTENTION_BACKEND_NAME, ATTENTION_BACKEND_QUALNAME)


OUR_ATTENTION_BACKEND = _register_attention_backend_name()


class ConfigError(ValueError):
    """A vLLM setting our platform cannot run, named with what it accepts."""


class CpuBackendPlatform(CpuPlatform):
    # `_enum` stays PlatformEnum.CPU on purpose: see the module docstring.

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_attn_backend_cls(
        cls,
        selected_backend: AttentionBackendEnum | None,
        attn_selector_config: AttentionSelectorConfig,
        num_heads: int | None = None,
    ) -> str:
        cfg = attn_selector_config
        if cfg.use_mla or cfg.use_sparse:
            # Latent (MLA) and sparse attention are not ours yet: the host's
            # CPU MLA backends serve them.
            return super().get_attn_backend_cls(selected_backend, cfg, num_heads)
        if selected_backend == AttentionBackendEnum.CPU_ATTN:
            logger.info("Using the host's CPU_ATTN backend, as --attention-backend asks.")
            return selected_backend.get_path()
        if selected_backend not in (None, OUR_ATTENTION_BACKEND):
            raise ConfigError(
                f"--attention-backend {selected_backend.name} cannot run on the CPU: "
                f"use {ATTENTION_BACKEND_NAME} (the default) or CPU_ATTN."
            )
        from cpu_backend.attention.backend import CpuBackendAttentionBackend

        reasons = _validate_with(CpuBackendAttentionBackend, cfg)
        if reasons:
            raise ConfigError(
                f"{ATTENTION_BACKEND_NAME} cannot run this attention layer "
                f"(head_size={cfg.head_size}, dtype={cfg.dtype}, "
                f"kv_cache_dtype={cfg.kv_cache_dtype}, block_size={cfg.block_size}, "
                f"attn_type={cfg.attn_type}): {'; '.join(reasons)}."
            )
        return ATTENTION_BACKEND_QUALNAME

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        """Ours: shared-memory all-reduce for tensor-parallel ranks on one host
        (cpu_backend.communicator), gloo otherwise."""
        return "cpu_backend.communicator.CpuBackendCommunicator"

    @classmethod
    def use_custom_op_collectives(cls) -> bool:
        """Collectives go through the host's `torch.ops.vllm.*` custom ops, so
        torch.compile (e.g. the fullgraph compile of MLA models) sees one opaque
        op instead of tracing into our shared-memory exchange (a wait loop)."""
        return True

    @classmethod
    def import_ir_kernels(cls) -> None:
        super().import_ir_kernels()
        import cpu_backend.ops.norm  # noqa: F401 - registers the `cpu_backend` provider

    @classmethod
    def get_default_ir_op_priority(cls, vllm_config: VllmConfig):
        """Our RMSNorm kernels first in eager mode; with torch.compile the
        host's choice (native, which Inductor fuses) stands."""
        from vllm.config import CompilationMode

        priority = super().get_default_ir_op_priority(vllm_config)
        if vllm_config.compilation_config.mode == CompilationMode.NONE:
            from cpu_backend.ops.norm import PROVIDER

            for op in ("rms_norm", "fused_add_rms_norm"):
                current = getattr(priority, op)
                setattr(priority, op, [PROVIDER, *[p for p in current if p != PROVIDER]])
        return priority

    @classmethod
    def apply_config_platform_defaults(cls, vllm_config: VllmConfig) -> None:
        from vllm.config import CompilationMode

        super().apply_config_platform_defaults(vllm_config)
        model_config = vllm_config.model_config
        # MLA attention runs on the host's CPU backend, whose eager path gives
        # wrong tokens (found by the compatibility matrix: DeepSeek-V2 is
        # correct only compiled, with or without this plugin): keep the host's
        # compiled default there.
        uses_mla = model_config is not None and getattr(model_config, "use_mla", False)
        if vllm_config.compilation_config.mode is None and not uses_mla:
            vllm_config.compilation_config.mode = CompilationMode.NONE

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        """The serve command's model argument may name a GGUF file
        (cpu_backend.gguf.cli types it before the host reads a config)."""
        super().pre_register_and_update(parser)
        if parser is not None:
            from cpu_backend.gguf import cli

            cli.install(parser)

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        envs.validate_all()
        isa.selected_path()  # a bad VLLM_CPU_BACKEND_ISA fails here
        _check_model(vllm_config)
        _load_gguf_from_its_file(vllm_config)
        _plan_threads_bind(vllm_config)

        parallel_config = vllm_config.parallel_config
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = WORKER_QUALNAME

        cache_config = vllm_config.cache_config
        user_block_size = cache_config.user_specified_block_size
        # vLLM has already resolved the user's flag and its incompatibilities.
        async_scheduling = vllm_config.scheduler_config.async_scheduling
        # "uni": vLLM's choice for a single rank (or the user's).
        worker_in_engine = (
            envs.worker_in_engine()
            and parallel_config.distributed_executor_backend == "uni"
            and parallel_config.data_parallel_size == 1
        )
        super().check_and_update_config(vllm_config)
        vllm_config.scheduler_config.async_scheduling = async_scheduling
        if worker_in_engine:
            _keep_worker_in_engine_process(parallel_config)
        model_config = vllm_config.model_config
        uses_mla = model_config is not None and model_config.use_mla
        if not user_block_size and not uses_mla:
            cache_config.block_size = DEFAULT_BLOCK_SIZE
        _size_kv_cache(vllm_config)
        _log_choice_once(vllm_config)
        from cpu_backend import serve_exit

        serve_exit.install()  # `vllm serve` exits non-zero after an engine death


def _keep_worker_in_engine_process(parallel_config) -> None:
    """One rank (unless `VLLM_CPU_BACKEND_WORKER_IN_ENGINE=0`): the worker runs
    in the engine-core process, which the host replaces by a separate worker process
    because OpenMP placement must be in the environment before a process
    starts; ours pins the running pool instead (cpu_backend.worker.binding).
    Saves the second process's start-up (an import of vLLM) and the per-step
    message queue. Which thread runs it (figures in docs/threads_and_tp.md):
    - the worker bound to every CPU the process may use: a thread of its own
      (our WorkerThreadExecutor), so async scheduling still overlaps the
      engine's scheduling with the forward pass;
    - CPUs left over for the frontend (`auto`): the engine's own thread (vLLM's
      `uni` executor); a second thread there only fights the first for the GIL
      and the frontend for its CPU."""
    from cpu_backend import topology

    topo = topology.discover()
    plan = topology.plan_from_env(1, topo)
    takes_every_cpu = not plan.ranks or set(plan.ranks[0].cpus) >= topo.allowed
    parallel_config.distributed_executor_backend = THREAD_EXECUTOR_QUALNAME if takes_every_cpu else "uni"
    # What the host's executor gives an Intel OpenMP worker, for this process's
    # children (the engine core reads them when its runtime starts).
    os.environ.setdefault("KMP_BLOCKTIME", "5")
    os.environ.setdefault("KMP_TPAUSE", "0")


def _validate_with(backend_cls, cfg: AttentionSelectorConfig) -> list[str]:
    """Call the backend's `validate_configuration` with the arguments it takes."""
    accepted = inspect.signature(backend_cls.validate_configuration).parameters
    kwargs = {k: v for k, v in cfg._asdict().items() if k in accepted}
    if "device_capability" in accepted:
        kwargs["device_capability"] = None
    return backend_cls.validate_configuration(**kwargs)


def _load_gguf_from_its_file(vllm_config: VllmConfig) -> None:
    """A GGUF model's folder (cpu_backend.gguf.model_dir) holds no weights:
    they load from its file (load format "gguf")."""
    model_config = vllm_config.model_config
    from cpu_backend.gguf.model_dir import QUANT_METHOD

    if model_config is None or model_config.quantization != QUANT_METHOD:
        return
    from cpu_backend.gguf.loader import LOAD_FORMAT

    load_config = vllm_config.load_config
    if load_config.load_format not in ("auto", LOAD_FORMAT):
        raise ConfigError(f"--load-format {load_config.load_format} cannot load a GGUF model: "
                          f"leave it unset (or use {LOAD_FORMAT}).")
    load_config.load_format = LOAD_FORMAT
    tp = vllm_config.parallel_config.tensor_parallel_size
    if tp > 1:
        raise ConfigError(f"--tensor-parallel-size {tp}: GGUF models run on one rank in "
                          "cpu_backend for now (use --data-parallel-size, or a GPTQ/AWQ copy).")


def _check_model(vllm_config: VllmConfig) -> None:
    """Reject, before any process starts, what our attention cannot run."""
    from cpu_backend.attention.backend import CpuBackendAttentionBackend as backend

    cache_config = vllm_config.cache_config
    if cache_config.user_specified_block_size and (
        cache_config.block_size % BLOCK_SIZE_MULTIPLE != 0
    ):
        raise ConfigError(
            f"--block-size {cache_config.block_size} is not supported by cpu_backend: "
            f"use a multiple of {BLOCK_SIZE_MULTIPLE} (default {DEFAULT_BLOCK_SIZE})."
        )
    if not backend.supports_kv_cache_dtype(cache_config.cache_dtype):
        raise ConfigError(
            f"--kv-cache-dtype {cache_config.cache_dtype} is not supported by "
            f"cpu_backend: use one of {backend.supported_kv_cache_dtypes}."
        )
    model_config = vllm_config.model_config
    if model_config is None:
        return
    if model_config.dtype not in backend.supported_dtypes:
        raise ConfigError(
            f"--dtype {model_config.dtype} is not supported by cpu_backend: use "
            "bfloat16, float16 or float32."
        )
    if model_config.use_mla or not model_config.get_num_attention_heads(
        vllm_config.parallel_config
    ):
        return
    head_size = model_config.get_head_size()
    if not backend.supports_head_size(head_size):
        raise ConfigError(
            f"model {model_config.model!r} has attention head size {head_size}, which "
            f"cpu_backend does not support (supported: {backend.get_supported_head_sizes()})."
        )


# The user's VLLM_CPU_OMP_THREADS_BIND and what we replaced it with, so a second
# engine in the same process plans from the user's value, not from ours.
_BIND_TRANSLATED = "CPU_BACKEND_OMP_THREADS_BIND_FROM"


def _user_threads_bind() -> str:
    current = os.environ.get(envs.OMP_THREADS_BIND, "").strip() or "auto"
    original, _, written = os.environ.get(_BIND_TRANSLATED, "").partition("=>")
    return original if written and written == current else current


def _plan_threads_bind(vllm_config: VllmConfig) -> None:
    """Turn `auto`/`all`/lists into explicit per-rank lists from our planner
    (cpu_backend.topology) and hand them to the host's executor, which sets
    `OMP_PLACES`/`OMP_NUM_THREADS` (or the KMP/GOMP equivalents) per worker.

    This makes `auto` work with several ranks on one NUMA node (the host's own
    `auto` needs a node per rank) and `all` work at all (unknown to the host
    0.32). Bad values fail here, naming the variable."""
    from cpu_backend import topology

    parallel_config = vllm_config.parallel_config
    if parallel_config.data_parallel_size > 1:
        return  # the host slices per-DP-rank lists itself; leave the value to it
    spec = _user_threads_bind()
    plan = topology.plan(
        topology.discover(), spec, parallel_config.local_world_size, envs.num_reserved_cpus()
    )
    for warning in plan.warnings:
        logger.warning(warning)
    if plan.mode == "nobind":
        return
    host_value = plan.host_value()
    os.environ[envs.OMP_THREADS_BIND] = host_value
    translated = f"{spec}=>{host_value}"
    if _start_up_logged_by_parent() and os.environ.get(_BIND_TRANSLATED) == translated:
        return  # planned the same, and logged, by the parent
    os.environ[_BIND_TRANSLATED] = translated
    logger.info(
        "cpu_backend: %s=%r planned as %r (%d local rank(s)); reserved CPUs: %s",
        envs.OMP_THREADS_BIND, spec, host_value, len(plan.ranks),
        topology.format_cpu_list(plan.reserved) or "none",
    )


def _size_kv_cache(vllm_config: VllmConfig) -> None:
    """`VLLM_CPU_KVCACHE_SPACE` (GiB; 0 = automatic) or `--kv-cache-memory-bytes`.
    Automatic sizing happens in the worker (cpu_backend.worker.memory)."""
    cache_config = vllm_config.cache_config
    explicit = envs.kvcache_space_bytes()
    if explicit is not None:
        cache_config.kv_cache_memory_bytes = explicit
    elif os.environ.get(envs.KVCACHE_SPACE, "").strip():
        # "0": the host parsed it as 0 bytes; it means automatic.
        cache_config.kv_cache_memory_bytes = None


_logged = False
# Set by the process that logged the start-up lines, for its children to see.
_START_UP_LOGGED = "CPU_BACKEND_START_UP_LOGGED"


def _start_up_logged_by_parent() -> bool:
    """In the engine core (a multiprocessing child of the API server or of the
    `LLM` script) the host configures the platform again: its start-up lines
    would repeat what the parent logged, so they are left out there."""
    return multiprocessing.parent_process() is not None and os.environ.get(_START_UP_LOGGED) == "1"


def _executor_name(backend) -> str:
    """'mp', 'uni', or an executor class's name (given as a class or qualname)."""
    return getattr(backend, "__name__", str(backend)).rsplit(".", 1)[-1]


def _log_choice_once(vllm_config: VllmConfig) -> None:
    global _logged
    if _logged:
        return
    _logged = True
    if _start_up_logged_by_parent():
        return
    os.environ[_START_UP_LOGGED] = "1"
    _start_up_hints()
    logger.info(
        "cpu_backend: platform=%s attention=%s worker=%s executor=%s isa=%s kernels=native "
        "(linear, attention, rms_norm) block_size=%d compile_mode=%s async_scheduling=%s",
        CpuBackendPlatform.__name__,
        ATTENTION_BACKEND_NAME,
        vllm_config.parallel_config.worker_cls.rsplit(".", 1)[-1],
        _executor_name(vllm_config.parallel_config.distributed_executor_backend),
        isa.describe(),
        vllm_config.cache_config.block_size,
        vllm_config.compilation_config.mode.name
        if vllm_config.compilation_config.mode is not None
        else "default",
        vllm_config.scheduler_config.async_scheduling,
    )


def _start_up_hints() -> None:
    """One line each, once per process: the allocator hint, and settings that
    have no effect with this backend."""
    if "libtcmalloc" not in os.environ.get("LD_PRELOAD", ""):
        logger.info(
            "cpu_backend: libtcmalloc is not in LD_PRELOAD; preloading it (e.g. "
            "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4) speeds up "
            "allocation-heavy steps. See docs/threads_and_tp.md."
        )
    if envs.sgl_kernel():
        has_amx = "amx_bf16" in isa.cpu_flags() or "amx_int8" in isa.cpu_flags()
        logger.warning(
            "cpu_backend: VLLM_CPU_SGL_KERNEL=1 has no effect: %s; linear layers use "
            "cpu_backend's packed GEMM kernels (isa=%s).",
            "cpu_backend has no AMX small-batch kernels yet" if has_amx
            else "this CPU has no AMX, which those kernels need",
            isa.describe(),
        )
