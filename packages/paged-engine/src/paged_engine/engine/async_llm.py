"""`AsyncLLM` (also `AsyncLLMEngine`): the engine behind asyncio, vLLM's interface for code
that serves requests itself (a FastAPI app, Ray Serve, an RL rollout loop).

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model="..."))
    async for out in engine.generate("Hello", SamplingParams(max_tokens=32), "req-1"):
        print(out.outputs[0].text)          # cumulative text, as vLLM's default output kind

One thread of its own owns the engine: it builds it (so torch's CPU thread team is that
thread's, as `LLM` and paged-server run it), then loops: commands from the callers (add,
abort, calls such as sleep or collective_rpc), one `step()`, the step's outputs handed to each
request's asyncio queue on the caller's event loop. Callers never touch the engine.

Invariants:
- A request's queue is registered before the engine can produce its outputs (both happen on
  the engine thread, the add first), and is dropped with its finished output; a consumer that
  stops iterating early (break, cancellation, an exception) aborts its request, and `abort()`
  ends a request's generator with asyncio.CancelledError (vLLM's behaviour). A pause or sleep
  with mode "abort" finishes the requests instead (finish_reason "abort"), as on `LLMEngine`;
  a pooling request, which has no partial result, ends with CancelledError then.
- Request ids, as vLLM's: each request gets an internal id (the caller's plus 8 random hex
  digits, `internal_request_id`) that keys `_streams` and every engine call, so requests sharing
  the caller's id in flight are all served; their outputs carry the caller's id. A generator
  left early aborts its internal id only; `abort(request_id)` ends every request of that id.
- A slow consumer merges: cumulative outputs (CUMULATIVE, FINAL_ONLY) keep only the newest of
  those queued; DELTA outputs are all yielded, in order.
- A request or `add_lora` naming a LoRA adapter that is not loaded waits on the caller's side
  for its files to be read (a loader thread, lora/loader.py), so no step waits on the disk.
- Failures fail requests, not the loop: an add's ValueError is raised to its caller; a
  step that raises is isolated by the engine core (core/step_isolation.py): its requests
  recompute, each alone, and only one that fails alone again gets the exception (its
  generator raises what the step raised); the others go on. A request that cannot fit the
  KV pool even alone (the scheduler names it) fails alone with a ValueError. Any other
  exception of a step (pipeline micro-batching, the scheduler) fails every request in flight
  with it (they are aborted) and the loop serves on, unless the engine is dead (a lost worker
  rank: `errored`, `dead_error`), when every later call raises it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from paged_engine.config import EngineConfig
from paged_engine.config_views import ModelConfig
from paged_engine.core.scheduler import SchedulerStuckError
from paged_engine.core.step_isolation import RequestFailedError
from paged_engine.engine.request_ids import internal_ids, internal_request_id, pop_each
from paged_engine.executor.base import EngineDeadError
from paged_engine.lora.request import LoRARequest
from paged_engine.outputs import RequestOutput
from paged_engine.pooling import PoolingParams, PoolingRequestOutput
from paged_engine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class EngineArgs:
    """vLLM's `EngineArgs`: the engine's options by name, the keyword arguments `LLM` takes
    (`EngineArgs(model=..., tensor_parallel_size=2)`); checked when the engine is built."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.model = model
        self.__dict__.update(kwargs)

    def options(self) -> dict[str, Any]:
        """The options as `EngineConfig.from_kwargs` takes them."""
        return dict(vars(self))

    def create_engine_config(self) -> EngineConfig:
        return EngineConfig.from_kwargs(**self.options())

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k != "hf_token")
        return f"{type(self).__name__}({shown})"


class AsyncEngineArgs(EngineArgs):
    """vLLM's `AsyncEngineArgs`: `EngineArgs` plus `enable_log_requests` (one INFO line per
    request added; vLLM's older `disable_log_requests=False` means the same)."""

    def __init__(
        self,
        model: str | None = None,
        *,
        enable_log_requests: bool = False,
        disable_log_requests: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, **kwargs)
        self.enable_log_requests = enable_log_requests or disable_log_requests is False

    def options(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "enable_log_requests"}


@dataclass(slots=True)
class _Stream:
    """One request's outputs, delivered on the event loop of the caller that added it."""

    request_id: str  # the caller's (external) id, which its outputs carry
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    kind: RequestOutputKind

    def put(self, item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # a closed event loop: no one is left to read
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLM:
    """The engine on a thread of its own, driven from asyncio (vLLM's `AsyncLLM`)."""

    def __init__(self, model: str | None = None, *, log_requests: bool = False, **kwargs: Any):
        """Build the engine (`LLM`'s options) on the engine thread and start its loop; raises
        what building it raised."""
        from paged_engine.logging_setup import configure_default_logging

        configure_default_logging()
        self.log_requests = log_requests
        self._config = EngineConfig.from_kwargs(model=model, **kwargs)  # bad options: here
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # by internal id; engine thread only
        self._dead: BaseException | None = None
        self._stopping = False
        self._closed = False  # set once the engine thread no longer takes commands
        self._pauses = False  # a pause or sleep ran: sweep streams its aborts left unanswered
        self.engine: Any = None
        self.tokenizer: Any = None
        ready = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._main, args=(ready,), name="paged-async-engine", daemon=True
        )
        self._thread.start()
        ready.result()  # the engine's build error, raised here

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **_: Any) -> AsyncLLM:
        """vLLM's constructor of choice (`start_engine_loop`, `usage_context`, `stat_loggers`
        are accepted; the loop always starts)."""
        log = bool(getattr(engine_args, "enable_log_requests", False))
        return cls(log_requests=log, **engine_args.options())

    # ---- generation and pooling -------------------------------------------------------------
    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        **_: Any,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs as they come: cumulative by default, DELTA or FINAL_ONLY as
        `sampling_params.output_kind` says (vLLM's). `prompt`: text, token ids, or vLLM's
        TextPrompt / TokensPrompt dicts (with `multi_modal_data`). Leaving the loop early aborts
        the request. vLLM's other keywords (`trace_headers`, `tokenization_kwargs`,
        `data_parallel_rank`, ...) are accepted and unused."""
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(
                f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}"
            )
        async for out in self._run(prompt, sampling_params, request_id, lora_request, priority):
            yield out

    async def encode(
        self,
        prompt: Any,
        pooling_params: PoolingParams,
        request_id: str,
        *,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        **_: Any,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """A pooling request (embedding, classification): one output, when it finished."""
        if not isinstance(pooling_params, PoolingParams):
            raise ValueError(
                f"pooling_params must be a PoolingParams, got {type(pooling_params).__name__}"
            )
        async for out in self._run(prompt, pooling_params, request_id, lora_request, priority):
            yield out

    async def _run(
        self, prompt: Any, params: Any, request_id: str, lora: Any, priority: int
    ) -> AsyncGenerator[Any, None]:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        kind = getattr(params, "output_kind", RequestOutputKind.FINAL_ONLY)
        stream = _Stream(request_id, asyncio.get_running_loop(), asyncio.Queue(), kind)
        await self._read_adapter(lora)
        internal_id = internal_request_id(request_id)
        finished = False
        try:
            # inside: a caller cancelled while its add is under way aborts it (queued after it)
            await self._submit(("add", internal_id, prompt, params, lora, priority, stream))
            while not finished:
                item = await stream.queue.get()
                if kind != RequestOutputKind.DELTA:  # cumulative: the newest is all of it
                    while not stream.queue.empty() and not isinstance(item, BaseException):
                        item = stream.queue.get_nowait()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = bool(item.finished)
                yield item
        finally:
            if not finished:  # the caller left early: nothing more is wanted of this request
                self._commands.put(("abort", [internal_id], True))

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """Abort requests (unknown or finished ids are ignored): each caller's id names every
        request added under it (`internal=True`: engine ids, vLLM's). Their generators raise
        asyncio.CancelledError, as vLLM's do."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        await self._call(lambda e: self._abort(ids, internal))

    # ---- the rest of vLLM's engine client -----------------------------------------------------
    async def get_tokenizer(self, lora_request: LoRARequest | None = None) -> Any:
        """A copy of the engine's tokenizer (the engine thread decodes with its own)."""
        return self.tokenizer

    async def get_model_config(self) -> ModelConfig:
        return self.model_config

    @property
    def model_config(self) -> ModelConfig:
        """vLLM's view of the model and its resolved options (`max_model_len`, `hf_config`,
        `dtype`, ...; config_views.py)."""
        return self.engine.model_config

    async def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.get_default_sampling_params()

    async def check_health(self) -> None:
        """Raise EngineDeadError when a worker rank is lost."""
        await self._call(lambda e: e.check_health())

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return await self._call(
            lambda e: e.reset_prefix_cache(reset_running_requests, reset_connector)
        )

    async def sleep(self, level: int = 1, tags: list[str] | None = None, mode: str = "abort"):
        await self._call(lambda e: self._settled(lambda: e.sleep(level, tags, mode)))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call(lambda e: e.wake_up(tags))

    async def is_sleeping(self) -> bool:
        return await self._call(lambda e: e.is_sleeping())

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        await self._call(lambda e: self._settled(lambda: e.pause_generation(mode, clear_cache)))

    async def resume_generation(self) -> None:
        await self._call(lambda e: e.resume_generation())

    async def is_paused(self) -> bool:
        return await self._call(lambda e: e.is_paused())

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        await self._read_adapter(lora_request)
        return await self._call(lambda e: e.add_lora(lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._call(lambda e: e.remove_lora(lora_id))

    async def list_loras(self) -> set[int]:
        return await self._call(lambda e: e.list_loras())

    async def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """vLLM's: `method` on every worker rank, between steps; one result per rank."""
        return await self._call(lambda e: e.collective_rpc(method, timeout, args, kwargs))

    async def start_profile(self, profile_prefix: str | None = None) -> None:
        await self._call(lambda e: e.start_profile(profile_prefix))

    async def stop_profile(self) -> list[str]:
        return await self._call(lambda e: e.stop_profile())

    async def get_stats(self) -> Any:
        return await self._call(lambda e: e.get_stats())

    async def do_log_stats(self, *_: Any, **__: Any) -> None:
        """vLLM's periodic stats line (its servers call it every few seconds)."""
        stats = await self.get_stats()
        logger.info("%s", stats)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> BaseException:
        return self._dead or EngineDeadError("the engine is not dead")

    def shutdown(self) -> None:
        """Stop the loop (requests in flight fail with EngineDeadError) and the engine's
        workers. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        self._commands.put(("stop",))
        if self._thread is not threading.current_thread():
            self._thread.join(60)

    def __del__(self) -> None:
        if getattr(self, "_thread", None) is not None and not self._stopping:
            self._stopping = True
            self._commands.put(("stop",))

    # ---- callers -> the engine thread ---------------------------------------------------------
    async def _submit(self, command: tuple) -> Any:
        """Queue a command that answers through a Future (its last element's slot)."""
        if self._dead is not None:
            raise self._dead
        if self._stopping:
            raise EngineDeadError("the engine was shut down")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((*command, fut))
        if self._closed:  # the engine thread stopped after the checks above: no one else answers
            self._refuse_queued()
        return await asyncio.wrap_future(fut)

    async def _call(self, fn: Callable[[Any], Any]) -> Any:
        return await self._submit(("call", fn))

    async def _read_adapter(self, lora: Any) -> None:
        """Wait here, not on the engine thread, for a LoRA adapter's files to be read
        (LLMEngine.prefetch_lora); the add that installs it raises what the read raised."""
        if lora is None or self.engine is None:
            return
        read = self.engine.prefetch_lora(lora)
        if read is None:
            return
        # Not wrap_future: a caller that gives up must not cancel a read others may wait for.
        loop = asyncio.get_running_loop()
        ended = loop.create_future()

        def wake(_: concurrent.futures.Future) -> None:
            with contextlib.suppress(RuntimeError):  # the caller's loop closed meanwhile
                loop.call_soon_threadsafe(lambda: ended.done() or ended.set_result(None))

        read.add_done_callback(wake)
        await ended

    # ---- the engine thread --------------------------------------------------------------------
    def _main(self, ready: concurrent.futures.Future) -> None:
        try:
            from paged_engine.engine.llm_engine import LLMEngine

            self.engine = LLMEngine(self._config)
            self.tokenizer = copy.deepcopy(self.engine.tokenizer)
        except BaseException as e:  # the constructor raises it
            ready.set_exception(e)
            return
        ready.set_result(None)
        try:
            self._loop()
        finally:
            self._stopping = True
            self._fail_all(self._dead or EngineDeadError("the engine was shut down"))
            # Closed before the drain: a caller that queues after it sees `_closed` and drains.
            self._closed = True
            self._refuse_queued()
            self.engine.shutdown()

    def _refuse_queued(self) -> None:
        """Fail every queued command that answers (any thread may drain, each command once)."""
        error = self._dead or EngineDeadError("the engine was shut down")
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            fut = command[-1]
            answers = isinstance(fut, concurrent.futures.Future)
            if answers and fut.set_running_or_notify_cancel():
                fut.set_exception(error)

    def _loop(self) -> None:
        engine = self.engine
        while True:
            # Idle, it sleeps on the queue: only a command (add, call, abort, stop) run on this
            # thread can give the engine work.
            busy = engine.can_step()
            try:
                command = self._commands.get(block=not busy)
            except queue.Empty:
                command = None
            while command is not None:
                if command[0] == "stop":
                    return
                self._run_command(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if not engine.can_step():
                continue
            try:
                outputs = engine.step()
            except EngineDeadError as e:
                logger.error("the engine died: %s", e)
                self._dead = e
                return
            except RequestFailedError as e:  # the requests to blame, alone: they fail
                self._fail_culprits(e)
                continue
            except SchedulerStuckError as e:
                if not e.request_ids:  # no culprit named: fail everything in flight
                    logger.error("%s; failing the requests in flight", e)
                    self._fail_all(e)
                    continue
                self._fail_stuck(e)
                continue
            except Exception as e:  # fail the requests in flight, serve on
                logger.exception("an engine step failed; failing the requests in flight")
                self._fail_all(e)
                continue
            self._dispatch(outputs)
            if self._pauses and not (engine.engine_core.held or engine.sleep_mode.held):
                self._end_unanswered()  # (every output the pause held is dispatched by now)

    def _run_command(self, command: tuple) -> None:
        kind, *rest = command
        if kind == "abort":
            self._abort(*rest)
            return
        fut = rest[-1]
        if not fut.set_running_or_notify_cancel():
            return
        try:
            if kind == "add":
                request_id, prompt, params, lora, priority, stream, _ = rest
                self._add(request_id, prompt, params, lora, priority, stream)
                fut.set_result(None)
            else:  # "call"
                fut.set_result(rest[0](self.engine))
        except BaseException as e:
            fut.set_exception(e)

    def _add(self, request_id, prompt, params, lora, priority, stream) -> None:
        self.engine.add_request(request_id, prompt, params, lora_request=lora, priority=priority)
        self._streams[request_id] = stream
        if self.log_requests:
            logger.info("Added request %s.", request_id)

    def _abort(self, ids: list[str], internal: bool) -> None:
        """Abort the requests of these caller's ids, or (`internal`) of these engine ids."""
        streams = self._streams
        live = pop_each(streams, ids if internal else internal_ids(streams, ids))
        if live:
            self.engine.abort_request([rid for rid, _ in live])
        for _, stream in live:  # the engine says nothing more of them: their generators end here
            stream.put(_aborted(stream.request_id))

    def _dispatch(self, outputs: list[Any]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            out.request_id = stream.request_id
            stream.put(out)

    def _fail_stuck(self, e: SchedulerStuckError) -> None:
        """Requests that cannot fit the KV pool even alone (their n sequences outgrew it) fail
        on their own with a ValueError; the others go on (paged-server answers them a 400)."""
        logger.warning("%s: failing %s", e, ", ".join(e.request_ids))
        self.engine.abort_request(e.request_ids)
        error = self._too_big(e)
        for _, stream in pop_each(self._streams, e.request_ids):
            stream.put(error)

    def _too_big(self, e: SchedulerStuckError) -> ValueError:
        error = ValueError(f"max_tokens: {e.culprit_message()}")
        error.__cause__ = e
        return error

    def _fail_culprits(self, e: RequestFailedError) -> None:
        cause = e.cause
        if isinstance(cause, SchedulerStuckError):  # named by a "wait" pause's steps: as above
            cause = self._too_big(cause)
        for _, stream in pop_each(self._streams, e.request_ids):
            stream.put(cause)

    def _settled(self, pause: Callable[[], None]) -> None:
        """Run a pause or sleep; requests a "wait" pause saw fail alone fail their streams (the
        pause itself succeeded)."""
        self._pauses = True
        try:
            pause()
        except RequestFailedError as e:
            self._fail_culprits(e)

    def _end_unanswered(self) -> None:
        """End the streams whose requests the engine dropped without an output: a pooling
        request a pause or sleep aborted (it has no partial result, and LLMEngine.step returns
        none) ends with asyncio.CancelledError, as abort() ends it. Run once the outputs the
        pause held were dispatched."""
        self._pauses = False
        states = self.engine.output_processor.states
        gone = [rid for rid in self._streams if rid not in states]
        for _, stream in pop_each(self._streams, gone):
            stream.put(_aborted(stream.request_id))

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        if streams and self.engine is not None and not isinstance(error, EngineDeadError):
            try:
                self.engine.abort_request(list(streams))
            except Exception:  # the engine is in trouble already; the requests fail anyway
                logger.exception("aborting the failed requests")
        for stream in streams.values():
            stream.put(error)


def _aborted(request_id: str) -> BaseException:
    return asyncio.CancelledError(f"request {request_id} was aborted")


AsyncLLMEngine = AsyncLLM  # vLLM's older name, the same class in vLLM v1
