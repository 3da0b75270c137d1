"""Our model runner: replaces the host's `vllm.v1.worker.cpu_model_runner.CPUModelRunner`.

Difference from the host: in eager mode (our default) the host skips warm-up
entirely, so the first request pays one-time costs (allocator growth, oneDNN
primitive creation, lazy imports) in its time to first token. We run one small
dummy step instead; the host's full-size profile run is kept for compiled mode,
where it triggers compilation. `profile_activation_peak` measures what a
forward step adds to resident memory, for the worker's KV sizing.
The KV cache is allocated on transparent huge pages (`huge_pages`), through
the host's `kv_cache_allocation_context` argument, and the loaded weights are
moved onto them (`load_model`; not with LoRA, whose adapters write into
weight views we do not track). Small steps run from
captured graphs (`step_graphs`), through the host's `_model_forward` hook,
with the host's attention ops lowered to our kernels (`attention.step_ops`).
Greedy sampling runs our argmax kernel (`sampler`). A batch of one request
skips the host's decode/prefill reordering (`_may_reorder_batch`), which has
nothing to move.
"""

from __future__ import annotations

import contextlib
import time

import torch

from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
from vllm.config import CompilationMode
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec,
                                        SlidingWindowSpec)
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from cpu_backend import envs, host_compat
from cpu_backend.attention import step_ops
from cpu_backend.worker import huge_pages, memory, sampler, step_graphs
from cpu_backend.worker.step_graphs import StepGraphs

logger = init_logger(f"vllm.{__name__}")

WARM_UP_TOKENS = 16
# Token rows of the step graphs' buffers when every count up to their limit
# has a graph, the most they hold; each row the size of one token's
# activations in the profile step.
GRAPH_BUFFER_TOKEN_ROWS = step_graphs.MAX_TOKENS * (step_graphs.MAX_TOKENS + 1) // 2
# The least reserved for them: a small model's profile step can run in memory
# its allocator holds already and show no growth at all (seen in CI: a tiny
# GPTQ model's reserve came out 0, and no step was captured).
GRAPH_BUFFER_MIN_BYTES = 64 << 20
# KV-cache layouts whose layers keep no state but the cache the attention ops
# write: replaying a step on the same inputs changes nothing.
_STATELESS_KV_SPECS = (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec)


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
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Not with speculative decoding: its rejection sampler holds the host's.
        ours = None if self.speculative_config else sampler.replacing(self.sampler)
        if ours is not None:
            self.sampler = ours

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        self.moved_weights = None
        if not envs.huge_page_weights() or self.lora_config is not None:
            return
        self.moved_weights = huge_pages.move_weights(self.model)
        if self.moved_weights.buffer is not None:
            logger.info("cpu_backend: weights (%.0f MB in %d tensors) moved onto huge pages in %.2f s, "
                        "%.0f MB of them on huge pages now (transparent huge pages: %s)",
                        self.moved_weights.nbytes / 1e6, self.moved_weights.tensors,
                        self.moved_weights.seconds, self.moved_weights.huge_page_bytes() / 1e6,
                        huge_pages.thp_mode())

    # Each override below only where the host method takes what it was
    # written for (cpu_backend.host_compat; the host's runs otherwise).
    if host_compat.matches("kv_cache_init"):

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

    if host_compat.matches("model_forward"):

        def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None,
                           inputs_embeds=None, **model_kwargs):
            graphs = self._step_graphs()
            if graphs is not None and graphs.covers(input_ids, intermediate_tensors,
                                                    inputs_embeds, model_kwargs):
                return graphs(input_ids, positions)
            return super()._model_forward(input_ids, positions, intermediate_tensors,
                                          inputs_embeds, **model_kwargs)

    if host_compat.matches("reorder_batch"):

        def _may_reorder_batch(self, scheduler_output) -> None:
            # A batch of one request is in every order already: skip the
            # host's ~20 numpy operations (~0.15 ms of a batch-1 decode step).
            if len(self.input_batch.req_ids) > 1:
                super()._may_reorder_batch(scheduler_output)

    def _step_graphs(self) -> StepGraphs | None:
        """This engine's step graphs, or None where steps must run eagerly."""
        if "_cpu_backend_step_graphs" not in self.__dict__:
            why_not = self._why_no_step_graphs()
            self._cpu_backend_step_graphs = None if why_not else StepGraphs(
                self.model, lower=step_ops.lower,
                buffer_budget=self.__dict__.get("_cpu_backend_graph_buffer_budget"))
            if why_not:
                logger.info("cpu_backend: steps run eagerly (%s).", why_not)
            else:
                logger.info("cpu_backend: steps of up to %d tokens run from captured graphs, "
                            "larger ones from one graph for every count.",
                            self._cpu_backend_step_graphs.max_tokens)
        return self._cpu_backend_step_graphs

    def step_graphs_report(self) -> dict:
        """"on" is None until the first step has decided it."""
        decided = "_cpu_backend_step_graphs" in self.__dict__
        graphs = self._cpu_backend_step_graphs if decided else None
        if graphs is None:
            return {"on": False if decided else None, "token_counts": [], "replays": 0,
                    "op_calls": {}}
        return graphs.report()

    def _why_no_step_graphs(self, kv_cache_known: bool = True) -> str | None:
        """Why steps must run eagerly, or None. Before the KV cache is set up
        (`kv_cache_known=False`) its layers are not looked at."""
        parallel = self.parallel_config
        specs = ([group.kv_cache_spec for group in self.kv_cache_config.kv_cache_groups]
                 if kv_cache_known else [])
        reasons = {
            f"{envs.STEP_GRAPHS}=0": not envs.step_graphs(),
            "torch.compile mode": self.compilation_config.mode != CompilationMode.NONE,
            "parallel ranks": parallel.world_size > 1 or parallel.data_parallel_size > 1,
            "LoRA": self.lora_config is not None,
            "speculative decoding": self.speculative_config is not None,
            "encoder-decoder or multimodal model": (self.model_config.is_encoder_decoder
                                                    or self.model_config.is_multimodal_model),
            "auxiliary hidden states": self.use_aux_hidden_state_outputs,
            "a model the host cannot trace once": not any(
                isinstance(module, TorchCompileWithNoGuardsWrapper)
                for module in self.model.modules()),
            "layers with state beside the KV cache": kv_cache_known and (not specs or any(
                type(spec) not in _STATELESS_KV_SPECS for spec in specs)),
        }
        return ", ".join(reason for reason, applies in reasons.items() if applies) or None

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
        activations = int(growth * budget / num_tokens)
        # Step graphs keep their activation buffers for good (StepGraphs
        # stops capturing when they would outgrow this).
        graph_buffers = 0
        if self._why_no_step_graphs(kv_cache_known=False) is None:
            graph_buffers = max(int(growth * GRAPH_BUFFER_TOKEN_ROWS / num_tokens),
                                GRAPH_BUFFER_MIN_BYTES)
        self._cpu_backend_graph_buffer_budget = graph_buffers
        logger.debug("Activation peak %.1f MB for %d tokens, step-graph buffers %.1f MB.",
                     activations / 1e6, budget, graph_buffers / 1e6)
        return activations + graph_buffers
