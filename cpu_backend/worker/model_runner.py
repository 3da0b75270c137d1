"""Our model runner: replaces the host's `vllm.v1.worker.cpu_model_runner.CPUModelRunner`.

Difference from the host: in eager mode (our default) the host skips warm-up
entirely, so the first request pays one-time costs (allocator growth, oneDNN
primitive creation, lazy imports) in its time to first token. We run one small
dummy step instead; the host's full-size profile run is kept for compiled mode,
where it triggers compilation. `profile_activation_peak` measures what a
forward step adds to resident memory, for the worker's KV sizing.
"""

from __future__ import annotations

from vllm.config import CompilationMode
from vllm.logger import init_logger
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from cpu_backend.worker import memory

logger = init_logger(f"vllm.{__name__}")

WARM_UP_TOKENS = 16


class CpuBackendModelRunner(CPUModelRunner):
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
