"""`UniprocExecutor`: one worker in this process.

The worker runs inline on the caller's thread, the one that drives the engine. On CUDA that
overlaps already: kernels are queued asynchronously, so the core schedules the next step while
the device computes. On CPU every op computes before it returns, so with `overlap=True` (async
scheduling) the worker lives on one thread of its own instead, from loading the model to every
step, and the core's host work overlaps the forward (torch releases the GIL in ops).

Why from loading the model on: torch's CPU ops run on an OpenMP team per calling thread, and
two teams on the same cores make every parallel op wait for sleeping threads (measured on 2
cores: an engine stepped from another thread than the one that loaded it ran 2x slower). The
same holds for the caller: drive an engine from the thread that built it (`paged-server` runs
its engine loop on the main thread for this reason).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from paged_engine.config import EngineConfig
from paged_engine.core.sched_output import SchedulerOutput
from paged_engine.distributed.parallel_state import outside_world
from paged_engine.executor.base import Executor, RunnerOutputHandle
from paged_engine.loader import ResolvedModel
from paged_engine.worker.extension import worker_class
from paged_engine.worker.runner_output import ModelRunnerOutput
from paged_engine.worker.worker import Worker, pick_device


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
        self._thread: ThreadPoolExecutor | None = None
        if overlap and pick_device(config.device).type != "cuda":
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="paged-worker")
        cls = worker_class(config.worker_extension_cls)
        self.worker: Worker = self._call(cls, config, resolved, hf_config)

    def _call(self, fn, *args):
        """Run fn on the worker's thread (or inline) and wait for it."""
        if self._thread is None:
            return _unsharded(fn, *args)
        return self._thread.submit(_unsharded, fn, *args).result()

    def determine_num_blocks(self) -> int:
        return self._call(self.worker.determine_num_blocks)

    def initialize_cache(self, num_blocks: int, num_state_snapshots: int = 0) -> None:
        self._call(self.worker.initialize_cache, num_blocks, num_state_snapshots)

    def execute_model(self, sched: SchedulerOutput) -> RunnerOutputHandle:
        if self._thread is None:
            return _unsharded(self.worker.execute_model, sched)
        return _FutureHandle(self._thread.submit(_unsharded, self.worker.execute_model, sched))

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        return self._call(self.worker.collective_rpc, method, args, kwargs)

    def add_lora(self, lora_id: int, path: str) -> None:
        self._call(self.worker.add_lora, lora_id, path)

    def remove_lora(self, lora_id: int) -> None:
        self._call(self.worker.remove_lora, lora_id)

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None


def _unsharded(fn, *args):
    # An engine with ranks may share this process (its rank 0): this worker is a world of 1
    # all the same, from building its layers to every step.
    with outside_world():
        return fn(*args)
