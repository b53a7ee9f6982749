"""`MultiprocExecutor`: one engine over `tensor_parallel_size * pipeline_parallel_size` ranks.

Rank 0 is this process: its worker (the driver) runs inline on the engine's thread. Every call
is first broadcast to the other ranks as plain data over the gloo cpu group, then run here;
each rank applies the same step to its own persistent batch and its shard of the model and KV
cache, and the collectives inside the forward keep them in lockstep. Rank 0's result is the
engine's (under pipeline parallelism the last stage sends it to rank 0). With pipeline
parallelism a step is broadcast without waiting for the other ranks to take it, and its handle
receives the result only when asked (`worker/stage_outputs.py`): rank 0 runs the first stage of
up to `pipeline_parallel_size` steps while the later stages work through the earlier ones.

Ranks 1.. are started here (torch.multiprocessing: forkserver on the CPU, spawn on CUDA;
`launch.start_method`) unless torchrun started them. They die with the engine: `shutdown()`
(also run by a finalizer at garbage collection and at exit) stops them, they exit when this
process disappears, and a rank that dies makes the next call raise `EngineDeadError` naming it,
never hang (gloo reports the closed connection).

A step that raises on every rank (the same input fails the same way on each, before any
collective one of them skipped) leaves the ranks in step: each agrees on it over the fail group
(`every_rank_failed`, at most `STEP_FAILURE_SYNC_S`) and goes on, so the engine core isolates
the step as with one process (core/step_isolation.py). A step that raises on some ranks only
kills the engine, as any other failure of a call does (after that wait), and so does any
failure under pipeline parallelism.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import os
import pickle
import time
import weakref
from typing import Any

import torch.multiprocessing as mp

from paged_engine.config import EngineConfig
from paged_engine.core.sched_output import SchedulerOutput
from paged_engine.distributed.communication import (
    broadcast_object,
    broadcast_object_async,
    every_rank_failed,
    gather_object,
    wait_sends,
)
from paged_engine.distributed.launch import (
    forkserver_context,
    free_port,
    start_method,
    torchrun_env,
)
from paged_engine.distributed.parallel_state import check_not_in_world, destroy_parallel_state
from paged_engine.executor.base import EngineDeadError, Executor, RunnerOutputHandle
from paged_engine.loader import ResolvedModel
from paged_engine.worker.extension import worker_class
from paged_engine.worker.runner_output import ModelRunnerOutput
from paged_engine.worker.stage_outputs import drain_stage_outputs
from paged_engine.worker.worker import RpcError, pick_device
from paged_engine.worker.worker_loop import (
    SHUTDOWN,
    STEP_FAILURE_SYNC_S,
    join_world,
    spawned_worker_main,
)

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # spawned ranks must import torch and reach the rendezvous by then


class _GuardedHandle:
    """A step's output; a failure while fetching it (pipeline parallelism receives it from the
    last stage) marks the engine dead like a failure in the step itself."""

    __slots__ = ("_executor", "_handle")

    def __init__(self, handle: RunnerOutputHandle, executor: MultiprocExecutor) -> None:
        self._handle, self._executor = handle, executor

    def get(self) -> ModelRunnerOutput:
        try:
            return self._handle.get()
        except Exception as e:
            raise self._executor._died(e) from e


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, resolved: ResolvedModel, hf_config) -> None:
        self.world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        self.max_concurrent_batches = config.pipeline_parallel_size
        check_not_in_world()
        self._procs: list[mp.Process] = []
        self._joined: list[bool] = [False]  # this engine's world exists: the finalizer leaves it
        self._dead: str | None = None
        self._closed = False
        env = torchrun_env()
        if env is not None:  # torchrun started every rank; we are rank 0
            if env.world_size != self.world_size or env.rank != 0:
                raise ValueError(
                    f"torchrun started {env.world_size} processes, but tensor_parallel_size * "
                    f"pipeline_parallel_size = {self.world_size}: launch that many in total "
                    "(--nnodes * --nproc-per-node)"
                )
            init_method, local_rank, local_world = "env://", env.local_rank, env.local_world_size
        else:
            init_method = f"tcp://127.0.0.1:{free_port()}"
            local_rank, local_world = 0, self.world_size
            self._spawn(config, resolved, hf_config, init_method)
        # `del llm` (or exit) without shutdown(): stop the ranks and leave the world anyway.
        self._finalizer = weakref.finalize(self, _release, self._procs, self._joined)
        try:
            join_world(config, 0, local_rank, local_world, init_method)
            self._joined[0] = True
            self.worker = worker_class(config.worker_extension_cls)(config, resolved, hf_config)
        except BaseException:
            self.shutdown()
            raise

    def _spawn(self, config: EngineConfig, resolved: ResolvedModel, hf_config, init: str) -> None:
        """Start ranks 1.. and wait until each is alive and about to join the rendezvous, so a
        rank that fails on import is reported now instead of stalling the rendezvous."""
        method = start_method(pick_device(config.device).type)
        ctx = forkserver_context() if method == "forkserver" else mp.get_context(method)
        # A forkserver's children inherit its environment, from when it started: each rank
        # gets this process's as it is now, as a spawned one would.
        environ = dict(os.environ)
        waiting = {}
        for rank in range(1, self.world_size):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=spawned_worker_main,
                args=(send, environ, config, resolved, hf_config, rank, init),
                name=f"paged-worker-{rank}",
                daemon=True,
            )
            proc.start()
            send.close()
            self._procs.append(proc)
            waiting[recv] = proc
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while waiting:
            left = deadline - time.monotonic()
            ready = multiprocessing.connection.wait(
                [*waiting, *(p.sentinel for p in waiting.values())], timeout=max(left, 0)
            )
            if not ready:
                _stop_processes(self._procs)
                raise RuntimeError(f"worker ranks did not start within {STARTUP_TIMEOUT_S:.0f}s")
            for conn in list(waiting):
                proc = waiting[conn]
                if conn in ready:
                    try:
                        conn.recv()
                    except EOFError:  # closed without a word: the process died
                        proc.join(1.0)
                    else:
                        del waiting[conn]
                        continue
                if conn in ready or proc.sentinel in ready:
                    _stop_processes(self._procs)
                    raise RuntimeError(
                        f"{proc.name} (pid {proc.pid}) exited with code {proc.exitcode} while "
                        "starting; its traceback is above"
                    )

    # ---- the Executor interface -------------------------------------------------------------
    def determine_num_blocks(self) -> int:
        return self._call("determine_num_blocks")

    def initialize_cache(self, num_blocks: int, num_state_snapshots: int = 0) -> None:
        self._call("initialize_cache", num_blocks, num_state_snapshots)

    def execute_model(self, sched: SchedulerOutput) -> RunnerOutputHandle:
        if self.max_concurrent_batches == 1:
            return _GuardedHandle(self._call("execute_model", sched, isolate=True), self)
        # Pipeline: the later stages may still run earlier steps; do not wait for them.
        return _GuardedHandle(
            self._call("execute_model", sched, bcast=broadcast_object_async), self
        )

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        # Checked before anything is sent: a message rank 0 cannot pickle would leave the
        # others waiting for it.
        try:
            pickle.dumps((method, args, kwargs))
        except Exception as e:
            raise ValueError(
                "collective_rpc with tensor or pipeline parallelism sends its method and "
                "arguments to every rank: they must pickle (a module-level function, not a "
                f"lambda or a local function): {e}"
            ) from e
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        try:
            broadcast_object(("collective_rpc", (method, args, kwargs)))
            return self.worker.collective_rpc(method, args, kwargs)
        except RpcError:
            raise  # the function failed somewhere, but every rank returned: the engine goes on
        except Exception as e:
            raise self._died(e) from e

    def add_lora(self, lora_id: int, path: str) -> None:
        # Rank 0 first: an adapter that does not fit its part fails here, before any other
        # rank saw the call. The others report instead of raising (a raise would end the
        # rank): a later pipeline stage's layers, or another shard's rows, may not fit either.
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        self.worker.add_lora(lora_id, path)
        if self.world_size == 1:
            return
        try:
            broadcast_object(("add_lora", (lora_id, path, True)))
            errors = [e for e in gather_object(None) or [] if e is not None]
        except Exception as e:
            raise self._died(e) from e
        if errors:  # every rank drops it: as if it was never loaded
            self.remove_lora(lora_id)
            raise ValueError(errors[0])

    def remove_lora(self, lora_id: int) -> None:
        self._call("remove_lora", lora_id)

    def check_health(self) -> None:
        """A rank this executor started that has exited kills the engine now, not at the next
        step (torchrun's ranks are not ours to watch: their loss shows at the next step)."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if not self._closed and any(p.exitcode is not None for p in self._procs):
            raise self._died(RuntimeError("a worker rank exited"))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._dead is None and hasattr(self, "worker"):
            with contextlib.suppress(Exception):  # a rank already gone: stopped below
                drain_stage_outputs(self.worker)  # steps the core dropped in flight
                broadcast_object((SHUTDOWN, ()))
                wait_sends()
        if self._dead is None and hasattr(self, "worker"):  # a clean stop: let the ranks leave
            for proc in self._procs:
                proc.join(timeout=10.0)
        self._finalizer()

    # ---- internals --------------------------------------------------------------------------
    def _call(self, method: str, *args: Any, bcast=broadcast_object, isolate=False) -> Any:
        """Run `method` on every rank: broadcast it, then run it on rank 0's worker. `isolate`
        (a step without pipeline stages): a failure every rank shares leaves the engine up."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        try:
            bcast((method, args))
        except Exception as e:
            raise self._died(e) from e
        try:
            return getattr(self.worker, method)(*args)
        except Exception as e:
            # Every rank raised too (the same input fails on each: a poisoned request): they
            # are in step, and the core isolates the step (core/step_isolation.py).
            if isolate and every_rank_failed(STEP_FAILURE_SYNC_S):
                raise
            # Else the ranks are out of step (some may wait in a collective forever): the
            # engine cannot go on.
            raise self._died(e) from e

    def _died(self, error: BaseException) -> EngineDeadError:
        if self._dead is None:
            deadline = time.monotonic() + 2.0  # a crashed rank may still be exiting
            gone = [p for p in self._procs if p.exitcode is not None]
            while not gone and self._procs and time.monotonic() < deadline:
                time.sleep(0.05)
                gone = [p for p in self._procs if p.exitcode is not None]
            if gone:
                why = ", ".join(f"{p.name} (pid {p.pid}) exited with {p.exitcode}" for p in gone)
            else:
                why = f"{type(error).__name__}: {error}"
            self._dead = f"a worker rank failed, the engine cannot continue: {why}"
            logger.error("%s", self._dead)
            self.shutdown()
        return EngineDeadError(self._dead)


def _release(procs: list[mp.Process], joined: list[bool]) -> None:
    _stop_processes(procs)
    if joined[0]:
        joined[0] = False
        # The peers are gone: leaving their world must not fail this process's exit.
        with contextlib.suppress(Exception):
            destroy_parallel_state()


def _stop_processes(procs: list[mp.Process]) -> None:
    """Terminate what is still running, then kill what ignores it (idempotent)."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=5.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5.0)
