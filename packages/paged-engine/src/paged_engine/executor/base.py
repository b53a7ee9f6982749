"""`Executor`: the seam between the engine core and its workers.

The core hands it plain data and gets a handle back; how many workers there are, and in which
thread or process they run, is the executor's business (tensor parallelism adds one here).

    execute_model(SchedulerOutput) -> RunnerOutputHandle;   handle.get() -> ModelRunnerOutput

Steps run in submission order. A handle returned before its step finished lets the core
schedule the next step meanwhile (async scheduling), or run up to `max_concurrent_batches`
steps at once (pipeline parallelism: one per stage).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

from paged_engine.core.sched_output import SchedulerOutput
from paged_engine.worker.runner_output import ModelRunnerOutput


class EngineDeadError(RuntimeError):
    """A worker (rank) failed and the engine cannot run another step; every request in flight
    fails with this message. Build a new engine to go on."""


class RunnerOutputHandle(Protocol):
    def get(self) -> ModelRunnerOutput: ...


class Executor(ABC):
    # Steps over disjoint requests the core may keep in flight (vLLM's name): 1 unless later
    # pipeline stages can run one step while the first runs the next.
    max_concurrent_batches: int = 1

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """KV blocks every worker can hold (the minimum over workers)."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int, num_state_snapshots: int = 0) -> None:
        """The KV cache of `num_blocks` blocks, and a hybrid model's state snapshot rows."""

    @abstractmethod
    def execute_model(self, sched: SchedulerOutput) -> RunnerOutputHandle: ...

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        """Run `method` on every worker (Worker.collective_rpc); one result per rank."""
        raise ValueError(f"{type(self).__name__} cannot run collective_rpc")

    def add_lora(self, lora_id: int, path: str) -> None:
        """Load a LoRA adapter on every worker, in order with the steps. A ValueError (the
        adapter does not fit) leaves every worker as it was and the engine running."""
        raise ValueError(f"{type(self).__name__} cannot load LoRA adapters")

    def remove_lora(self, lora_id: int) -> None:
        """Unload an adapter from every worker (a no-op for one never loaded)."""
        raise ValueError(f"{type(self).__name__} cannot unload LoRA adapters")

    def check_health(self) -> None:
        """Raise EngineDeadError if a worker is known to be gone, without running a step (the
        server calls it while idle). Workers in this process cannot vanish alone."""
        return None

    @abstractmethod
    def shutdown(self) -> None:
        """Release workers and threads; idempotent."""
