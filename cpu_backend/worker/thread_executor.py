"""A single rank's worker on a thread of the engine-core process: replaces vLLM's
`vllm.v1.executor.uniproc_executor.UniProcExecutor` when the worker runs in the
engine (a single rank's default, see `VLLM_CPU_BACKEND_WORKER_IN_ENGINE`) and is
bound to every CPU the process may use (cpu_backend.platform picks it; with CPUs
left for the frontend the host's class keeps the worker on the engine's thread).

Why not the host's class: it runs the worker on the engine core's own thread.
On a GPU that thread only launches kernels, so async scheduling still overlaps
the next step's scheduling with the forward pass; on a CPU the forward pass *is*
the thread's work, and the overlap is lost (batch-1 decode up to 20% slower here
than with a worker process). Here every call to the worker (start-up, steps,
RPCs, shutdown) runs, in order, on one dedicated thread, which owns the OpenMP
pool and is the thread the binding pins (cpu_backend.worker.binding); the
engine core's thread keeps the process's full CPU mask and schedules step N+1
while step N runs. Torch's kernels release the GIL, so the two overlap as the
two processes of vLLM's `mp` executor do, without the second process's
start-up (an import of vLLM) or the per-step message queue.

Arguments of the calls that return before the worker has run them (a step's
scheduler output and grammar) are copied the way the `mp` executor's message
queue copies them (a pickle round trip): the scheduler builds step N+1 while
the worker still reads step N's, and they may share lists.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vllm.v1.executor.uniproc_executor import UniProcExecutor

THREAD_NAME = "cpu_backend_worker"


class WorkerThreadExecutor(UniProcExecutor):
    def _init_executor(self) -> None:
        self._worker_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)
        self._worker_thread.submit(super()._init_executor).result()

    def collective_rpc(  # type: ignore[override]
        self,
        method: str | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
        non_block: bool = False,
        single_value: bool = False,
    ) -> Any:
        if non_block:
            args, kwargs = pickle.loads(pickle.dumps((args, kwargs), protocol=pickle.HIGHEST_PROTOCOL))
        future: Future = self._worker_thread.submit(
            # Blocking on the worker thread: a step's (asynchronous) output is
            # complete once the future is done.
            super().collective_rpc, method, timeout, args, kwargs, False, single_value
        )
        return future if non_block else future.result(timeout)

    def shutdown(self) -> None:
        pool = getattr(self, "_worker_thread", None)
        if pool is None:
            return
        self._worker_thread = None
        try:
            try:
                future = pool.submit(super().shutdown)
            except RuntimeError:
                # At interpreter exit (an `LLM` left to the garbage collector):
                # concurrent.futures' exit hook has already stopped the thread.
                super().shutdown()
            else:
                future.result()
        finally:
            pool.shutdown(wait=True)
