"""Our model runner: replaces the host's `vllm.v1.worker.cpu_model_runner.CPUModelRunner`.

Difference from the host: in eager mode (our default) the host skips warm-up
entirely, so the first request pays one-time costs (allocator growth, oneDNN
primitive creation, lazy imports) in its time to first token. We run one small
dummy step instead; the host's full-size profile run is kept for compiled mode,
where it triggers compilation. `profile_activation_peak` measures what a
forward step adds to resident memory, for the worker's KV sizing.
The KV cache is allocated on transparent huge pages (`huge_pages`), through
the host's `kv_cache_allocation_context` argument.
"""

from __future__ import annotations

import contextlib
import inspect
import time

import torch

from vllm.config import CompilationMode
from vllm.logger import init_logger
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from cpu_backend.worker import huge_pages, memory

logger = init_logger(f"vllm.{__name__}")

WARM_UP_TOKENS = 16
_HOST_KV_INIT_PARAMS = list(inspect.signature(CPUModelRunner.initialize_kv_cache).parameters)


def kv_cache_bytes(kv_caches) -> tuple[int, int]:
    """Bytes of the distinct buffers behind the runner's KV caches, and how
    many of them are on huge pages now."""
    buffers = {t.untyped_storage().data_ptr(): t for t in kv_caches if isinstance(t, torch.Tensor)}
    return (sum(t.untyped_storage().nbytes() for t in buffers.values()),
            sum(huge_pages.huge_page_bytes(t) for t in buffers.values()))


@contextlib.contextmanager
def _on_huge_pages(outer: contextlib.AbstractContextManager | None):
    with outer or contextlib.nullcontext(), huge_pages.allocation_context():
        yield


class CpuBackendModelRunner(CPUModelRunner):
    if _HOST_KV_INIT_PARAMS == ["self", "kv_cache_config", "is_profiling",
                                "kv_cache_allocation_context"]:

        def initialize_kv_cache(self, kv_cache_config, is_profiling=False,
                                kv_cache_allocation_context=None) -> None:
            start = time.perf_counter()
            super().initialize_kv_cache(
                kv_cache_config, is_profiling,
                kv_cache_allocation_context=_on_huge_pages(kv_cache_allocation_context),
            )
            if not is_profiling:
                allocated, on_huge_pages = kv_cache_bytes(self.kv_caches)
                logger.info(
                    "cpu_backend: KV cache of %.2f GiB set up (allocated, zeroed) in %.1f s, "
                    "%.2f GiB of it on huge pages (transparent huge pages: %s)",
                    allocated / memory.GiB, time.perf_counter() - start,
                    on_huge_pages / memory.GiB,
                    huge_pages.thp_mode(),
                )

    def warming_up_model(self) -> None:
        if self.vllm_config.compilation_config.mode != CompilationMode.NONE:
            super().warming_up_model()
            return
        num_tokens = min(WARM_UP_TOKENS, self.scheduler_config.max_num_batched_tokens)
        self._dummy_run(num_tokens)
        logger.debug("Warmed up with a %d-token dummy step.", num_tokens)

    def profile_activation_peak(self) -> int:
        """Peak RSS growth of one dummy step, scaled to max_num_batched_tokens.

        Activations grow linearly with the tokens in a step; one step of
        `memory.PROFILE_TOKENS` keeps start-up fast. 0 where the kernel cannot
        reset the peak-RSS counter.
        """
        budget = self.scheduler_config.max_num_batched_tokens
        num_tokens = min(memory.PROFILE_TOKENS, budget)
        before = memory.rss_bytes()
        if not memory.reset_peak_rss():
            logger.warning("Cannot reset the peak-RSS counter: activation peak not profiled.")
            return 0
        self._dummy_run(num_tokens)
        growth = max(memory.peak_rss_bytes() - before, 0)
        return int(growth * budget / num_tokens)
