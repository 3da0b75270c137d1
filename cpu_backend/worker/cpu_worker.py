"""Our worker: replaces the host's `vllm.v1.worker.cpu_worker.CPUWorker`.

It subclasses the host worker, which keeps the memory-node binding and the
executor protocol, and overrides:
- `init_device`: registers our layer overrides (native linear kernels),
  applies the rank's CPU/NUMA binding (cpu_backend.worker.binding, planned by
  cpu_backend.topology) and builds our model runner;
- `load_model`: first checks the weight shard + KV cache fit the rank's NUMA node;
  names the damaged file when safetensors cannot read one (worker/checkpoint_files.py);
  keeps the rank's thread count, which the host's GPU worker drops to one;
- `determine_available_memory`: our KV-cache sizing (`cpu_backend.worker.memory`:
  a profiled activation peak, container limits, clear errors before anything
  is allocated) instead of the host's 0.92-of-the-node rule, which refuses to
  start on machines where other processes hold memory.
"""

from __future__ import annotations

import math
import os
import threading

import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

from cpu_backend import host_compat, ops, stats
from cpu_backend.ops.custom_ops import register_custom_ops
from cpu_backend.ops.linear_layers import register_layers
from cpu_backend.ops.moe_layers import register_moe
from cpu_backend.quantization import register as register_quantization
from cpu_backend.worker import binding as cpu_binding
from cpu_backend.worker import checkpoint_files, memory
from cpu_backend.worker.model_runner import CpuBackendModelRunner, kv_cache_bytes

logger = init_logger(f"vllm.{__name__}")


class CpuBackendWorker(CPUWorker):
    def __init__(self, vllm_config: VllmConfig, *args, **kwargs) -> None:
        cache_config = vllm_config.cache_config
        # None: automatic sizing, done in determine_available_memory. The host's
        # __init__ refuses to start unless 0.92 of the node is free when it sees
        # None, so it is shown a placeholder for the duration of that call.
        self.requested_kv_bytes = cache_config.kv_cache_memory_bytes
        self.kv_plan: memory.KVPlan | None = None
        if self.requested_kv_bytes is None:
            cache_config.kv_cache_memory_bytes = 0
        try:
            super().__init__(vllm_config, *args, **kwargs)
        finally:
            cache_config.kv_cache_memory_bytes = self.requested_kv_bytes
        self.cpu_binding = cpu_binding.rank_binding(self.parallel_config, self.local_rank)

    def init_device(self) -> None:
        self.device = torch.device("cpu")
        cpu_binding.apply(self.cpu_binding)
        host_compat.log_checks(logger)
        # The CPU communicator names its shared-memory segments after this.
        init_method = self.distributed_init_method
        os.environ["VLLM_DIST_IDENT"] = (
            os.path.basename(init_method.removeprefix("file://"))
            if init_method.startswith("file://")
            else init_method.split(":")[-1]
        )
        init_worker_distributed_environment(
            self.vllm_config,
            self.rank,
            self.distributed_init_method,
            self.local_rank,
            current_platform.dist_backend,
        )
        set_random_seed(self.model_config.seed)
        # Before the model is built: its layers are instantiated from these.
        register_layers()
        register_moe()
        register_custom_ops()
        register_quantization()  # also the general-plugin entry point; idempotent
        if self.use_v2_model_runner:
            # The V2 runner is the host's; our attention backend still serves it.
            from vllm.v1.worker.cpu.model_runner import CPUModelRunner as HostV2Runner

            logger.info("Using the host's V2 CPU model runner.")
            self.model_runner = HostV2Runner(self.vllm_config, self.device)
        else:
            self.model_runner = CpuBackendModelRunner(self.vllm_config, self.device)
        cpu_binding.log_binding(self.rank, self.local_rank, self.cpu_binding)

    def load_model(self, *args, **kwargs):
        cpu_binding.check_before_load(self.vllm_config, self.cpu_binding)
        threads = torch.get_num_threads()
        try:
            return super().load_model(*args, **kwargs)
        except Exception as e:
            if type(e).__name__ != "SafetensorError":
                raise
            raise checkpoint_files.explain(self.vllm_config.model_config.model, e) from e
        finally:
            # The host's GPU worker ends load_model by dropping torch to one
            # thread "for serving" (set_torch_threads_for_runtime): its model
            # runs on the GPU. Ours runs on these threads; in a worker living
            # in the caller's process (VLLM_ENABLE_V1_MULTIPROCESSING=0) that
            # halved decode speed. The host's CPUWorker disables
            # torch.set_num_threads for the whole process instead.
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)

    def _should_warm_up_model(self) -> bool:
        # Our runner's warm-up is one small step in eager mode: always worth it.
        return True

    def determine_available_memory(self) -> int:
        """KV-cache bytes for this rank (see cpu_backend.worker.memory)."""
        self.model_runner.warming_up_model()
        specs = self.model_runner.get_kv_cache_spec()
        if not specs:
            return 0
        block_size = self.cache_config.block_size
        bytes_per_token = sum(s.page_size_bytes / s.block_size for s in specs.values())
        activation_peak = self.model_runner.profile_activation_peak()
        self.kv_plan = memory.plan_kv_cache(
            memory.read_memory(memory.worker_memory_node()),
            requested=self.requested_kv_bytes,
            utilization=self.cache_config.gpu_memory_utilization,
            activation_peak=activation_peak,
            bytes_per_block=math.ceil(bytes_per_token * block_size),
            block_size=block_size,
            max_model_len=self.model_config.max_model_len,
            shares=cpu_binding.ranks_on_node(self.parallel_config, self.cpu_binding),
        )
        logger.info("cpu_backend rank %d: %s", self.rank, self.kv_plan.summary())
        return self.kv_plan.kv_bytes

    def cpu_backend_report(self) -> dict:
        """What this worker runs, for `LLM.collective_rpc("cpu_backend_report")`:
        the classes in use and how often our attention ran in this process."""
        from vllm import ir
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        from cpu_backend.ops import custom_ops
        from cpu_backend.ops.moe_layers import describe_moe

        layers = get_layers_from_vllm_config(self.vllm_config, Attention)
        model = self.model_runner.get_model()
        return {
            "kernels_isa": ops.loaded_isa(),
            "linear_methods": sorted(
                {type(m.quant_method).__name__ for m in model.modules()
                 if isinstance(m, (LinearBase, ParallelLMHead))}
            ),
            "lm_head_quant": sorted(
                {getattr(getattr(m, "cpu_backend_lm_head", None), "mode", "none")
                 for m in model.modules() if isinstance(m, ParallelLMHead)}
            ),
            "rms_norm_providers": {
                op: getattr(ir.ops, op).get_priority() for op in ("rms_norm", "fused_add_rms_norm")
            },
            "attention_native": sorted(
                {bool(getattr(layer.impl, "_native", False)) for layer in layers.values()}
            ),
            "worker": type(self).__qualname__,
            "bound_cpus": list(self.cpu_binding.cpus) if self.cpu_binding else None,
            "thread_cpus": cpu_binding.thread_cpus(),
            "omp_thread_cpus": cpu_binding.omp_thread_cpus(),
            "pid": os.getpid(),
            "thread": threading.current_thread().name,
            "torch_threads": torch.get_num_threads(),
            "communicator": _tp_communicator_name(),
            "model_runner": type(self.model_runner).__qualname__,
            "async_scheduling": bool(getattr(self.model_runner, "use_async_scheduling", False)),
            "attention_backends": sorted(
                {layer.attn_backend.get_name() for layer in layers.values()}
            ),
            "attention_impls": sorted({type(layer.impl).__qualname__ for layer in layers.values()}),
            "attention_forward_calls": stats.get("attention_forward"),
            "memory": self._memory_report(model),
            "wna16_linear_calls": stats.get("wna16_linear"),
            "wna16_int8_act_layers": sum(bool(getattr(m, "cpu_backend_int8_act", False))
                                         for m in model.modules()),
            "w8a8_linear_calls": stats.get("w8a8_linear"),
            "moe_methods": describe_moe(model),
            "moe_experts_calls": stats.get("moe_experts"),
            "custom_ops": sorted(
                {type(m).__name__ for m in model.modules() if type(m).__module__ == custom_ops.__name__}
            ),
            "custom_op_kernel_calls": stats.kernel_calls(),
            "step_graphs": self.model_runner.step_graphs_report(),
            "sampler": type(self.model_runner.sampler).__qualname__,
            "greedy_rows_sampled": stats.get("greedy_rows"),
        }

    def _memory_report(self, model) -> dict:
        """Bytes: what the KV plan saw and what the process holds now."""
        plan = self.kv_plan
        kv_allocated, kv_huge_pages = kv_cache_bytes(self.model_runner.kv_caches)
        moved = getattr(self.model_runner, "moved_weights", None)
        return {
            "weights": sum(p.numel() * p.element_size() for p in model.parameters()),
            "weights_moved": moved.nbytes if moved else 0,
            "weights_huge_pages": moved.huge_page_bytes() if moved else 0,
            "kv_allocated": kv_allocated,
            "kv_huge_pages": kv_huge_pages,
            "kv_planned": plan.kv_bytes if plan else None,
            "kv_source": plan.source if plan else None,
            "num_blocks": plan.num_blocks if plan else None,
            "activation_peak": plan.activation_peak if plan else None,
            "rss_at_plan": plan.readings.rss if plan else None,
            "rss_now": memory.rss_bytes(),
        }


def _tp_communicator_name() -> str:
    from vllm.distributed.parallel_state import get_tp_group

    comm = get_tp_group().device_communicator  # None with one TP rank
    return type(comm.dist_module).__name__ if comm is not None else "none"
