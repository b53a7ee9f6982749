"""`UniprocExecutor`: one worker in this process.

On CUDA the worker runs inline: its kernels are queued asynchronously already, so the core
thread schedules the next step while the device computes. On CPU every op computes before it
returns, so with `overlap=True` (async scheduling) the worker runs on one thread of its own
(torch releases the GIL inside ops) and the core's host work overlaps the forward there. One
thread keeps the steps in submission order.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from paged_engine.config import EngineConfig
from paged_engine.core.sched_output import SchedulerOutput
from paged_engine.executor.base import Executor, RunnerOutputHandle
from paged_engine.loader import ResolvedModel
from paged_engine.worker.runner_output import ModelRunnerOutput
from paged_engine.worker.worker import Worker


class _FutureHandle:
    """A step running on the worker thread; get() waits for it, then for its copies."""

    __slots__ = ("_future",)

    def __init__(self, future: Future) -> None:
        self._future = future

    def get(self) -> ModelRunnerOutput:
        return self._future.result().get()


class UniprocExecutor(Executor):
    def __init__(
        self, config: EngineConfig, resolved: ResolvedModel, hf_config, *, overlap: bool
    ) -> None:
        self.worker = Worker(config, resolved, hf_config)
        self._thread: ThreadPoolExecutor | None = None
        if overlap and self.worker.device.type != "cuda":
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="paged-worker")

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> RunnerOutputHandle:
        if self._thread is None:
            return self.worker.execute_model(sched)
        return _FutureHandle(self._thread.submit(self.worker.execute_model, sched))

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
