"""Our worker: replaces the host's `vllm.v1.worker.cpu_worker.CPUWorker`.

It subclasses the host worker, which keeps memory-node checks, KV sizing and
the executor protocol, and overrides `init_device` to register our layer
overrides (native linear kernels) and build our model runner.
NUMA/OpenMP binding and the memory profiler grow here.
"""

from __future__ import annotations

import os

import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

from cpu_backend import ops
from cpu_backend.ops.linear_layers import register_layers
from cpu_backend.quantization import register as register_quantization
from cpu_backend.worker.memory import size_kv_cache_if_unset
from cpu_backend.worker.model_runner import CpuBackendModelRunner

logger = init_logger(f"vllm.{__name__}")


class CpuBackendWorker(CPUWorker):
    def __init__(self, vllm_config: VllmConfig, *args, **kwargs) -> None:
        # Before the host's __init__, which refuses to start when the automatic
        # size does not fit in free memory.
        size_kv_cache_if_unset(vllm_config)
        super().__init__(vllm_config, *args, **kwargs)

    def init_device(self) -> None:
        self.device = torch.device("cpu")
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
        register_quantization()  # also the general-plugin entry point; idempotent
        if self.use_v2_model_runner:
            # The V2 runner is the host's; our attention backend still serves it.
            from vllm.v1.worker.cpu.model_runner import CPUModelRunner as HostV2Runner

            logger.info("Using the host's V2 CPU model runner.")
            self.model_runner = HostV2Runner(self.vllm_config, self.device)
        else:
            self.model_runner = CpuBackendModelRunner(self.vllm_config, self.device)
        logger.info(
            "cpu_backend worker rank %d: %d torch threads on CPUs %s",
            self.rank,
            torch.get_num_threads(),
            sorted(os.sched_getaffinity(0)),
        )

    def _should_warm_up_model(self) -> bool:
        # Our runner's warm-up is one small step in eager mode: always worth it.
        return True

    def cpu_backend_report(self) -> dict:
        """What this worker runs, for `LLM.collective_rpc("cpu_backend_report")`:
        the classes in use and how often our attention ran in this process."""
        from vllm import ir
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        from cpu_backend.attention.impl import CpuBackendAttentionImpl
        from cpu_backend.quantization.config import WNA16LinearMethod

        layers = get_layers_from_vllm_config(self.vllm_config, Attention)
        model = self.model_runner.get_model()
        return {
            "kernels_isa": ops.loaded_isa(),
            "linear_methods": sorted(
                {type(m.quant_method).__name__ for m in model.modules()
                 if isinstance(m, (LinearBase, ParallelLMHead))}
            ),
            "rms_norm_providers": {
                op: getattr(ir.ops, op).get_priority() for op in ("rms_norm", "fused_add_rms_norm")
            },
            "attention_native": sorted(
                {bool(getattr(layer.impl, "_native", False)) for layer in layers.values()}
            ),
            "worker": type(self).__qualname__,
            "model_runner": type(self.model_runner).__qualname__,
            "attention_backends": sorted(
                {layer.attn_backend.get_name() for layer in layers.values()}
            ),
            "attention_impls": sorted({type(layer.impl).__qualname__ for layer in layers.values()}),
            "attention_forward_calls": CpuBackendAttentionImpl.forward_calls,
            "wna16_linear_calls": WNA16LinearMethod.apply_calls,
        }
