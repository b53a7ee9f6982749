"""The engine thread, the output thread, and the handles HTTP threads use to talk to them.

    HTTP threads --commands--> engine thread --core outputs (FIFO)--> output thread --> groups
                                    ^--------- finish: stop strings (a command) ---------'

Invariants:
- Exactly one thread (the engine thread) calls the engine's add_request / step_core /
  finish_seqs / abort_request / get_stats / add_lora / remove_lora / list_loras /
  start_profile / stop_profile: its loop is
  commands + step_core(), nothing else. An HTTP thread that needs an engine answer (loading a
  LoRA adapter) sends a `_Call` command and waits on its Future. An "idle" call (sleep mode's
  "wait") runs once the engine has nothing left to step; requests that arrive meanwhile are
  held back here and added right after it. The one engine method HTTP threads call is
  prefetch_lora (thread-safe): a request or load naming an adapter that is not loaded waits
  in its HTTP thread for the files to be read, so the engine thread never waits on a disk.
  Exactly one other thread (the output thread) calls process_outputs (detokenize, stop strings,
  logprob dicts, RequestOutputs) and hands the RequestOutputs to the groups and the metrics; a
  stop string it sees goes back to the engine thread as a command. HTTP threads only push
  commands and read their own `RequestGroup`.
- The engine's tokenizer is used by those two threads only, read-only (decode, id -> token;
  nothing changes its truncation or padding settings, which is what makes a shared HF fast
  tokenizer fail with "Already borrowed"). HTTP threads use their own copy.
- Every request asks the engine for DELTA outputs (streams) or FINAL_ONLY (one output at the
  end): each output holds only what is new, so the HTTP thread consumes all of them, in order.
  Core outputs reach the output thread in step order through one queue, and a request is
  registered (engine.add_request, `_streams`) before the step that can produce its outputs.
  RequestOutputs are fresh objects nobody touches after process_outputs: they cross as they are.
- Neither thread blocks on a socket or on a consumer: core outputs and per-request outputs go
  to unbounded queues, and a slow consumer merges what piled up. The only lock they share,
  `_lock`, is held for a few dict operations. An abort may drop a request's output-stage state
  while process_outputs runs: the stage tolerates it, and its outputs are dropped here.
- An aborted request (abort, client gone, failure) leaves `_streams` first, then the engine
  (its blocks are free again); outputs of it still queued are dropped by the output stage (no
  state) and by the dispatch (no stream).
- Failures fail requests, never a thread: a step that raises is isolated by the engine core
  (paged_engine/core/step_isolation.py), and the one request that fails alone again gets a 400
  (a ValueError) or a 500; any other exception in step_core fails every request in
  flight with a 500 (a scheduler stuck on one request that cannot fit the KV pool even alone
  fails that one with a 400); one in process_outputs or the dispatch fails that step's
  requests with a 500 (the engine thread then aborts them). Both threads go on serving.
- The engine thread is the one that loaded the engine (`paged-server` runs the loop on its
  main thread with `run_engine_loop`): torch's CPU ops use an OpenMP team per calling thread,
  and a second team on the same cores slows every parallel op (measured 4x on 2 cores).
  `start(engine_thread=True)` spawns one instead (tests, embedding).
- stop(): the engine loop fails every request still in flight with a 503 and returns; an end
  marker queued behind its last outputs ends the output thread; both are waited for.
- Request ids: the callers' ids (`RequestGroup.request_ids`, "cmpl-<X-Request-Id>-0") are
  external and may repeat (two clients sending one X-Request-Id); each engine request gets an
  internal id of its own, the external id plus 8 random hex digits (vLLM's
  `InputProcessor.assign_request_id`), which keys `_streams` and every engine call. An abort
  names external ids and reaches only the streams of its group (or of every group: no group).
- `stats` is an immutable snapshot replaced by the engine thread after every step and every batch
  of commands, so /metrics and /health never wait for the engine. A request handed over is
  counted as waiting in `_pending_adds` until a snapshot taken after its add counts it, so the
  queue limit (429) never under-counts.
"""

from __future__ import annotations

import inspect
import logging
import queue
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

from paged_engine.engine.request_ids import internal_ids, internal_request_id, pop_each
from paged_engine.engine.request_latency import RequestClock, request_clock
from paged_engine.sampling_params import RequestOutputKind, SamplingParams
from paged_engine.structured_output.grammar import GrammarBusyError
from paged_server.errors import APIError, bad_request
from paged_server.metrics import Metrics
from paged_server.openai_protocol import model_not_found
from paged_server.request_group import RequestGroup
from paged_server.structured_request import busy

log = logging.getLogger("paged_server")

_SP_FIELDS = frozenset(inspect.signature(SamplingParams).parameters)
# what else an engine ValueError may name: PoolingParams' fields, and the request's priority
_POOLING_FIELDS = frozenset(
    {"dimensions", "normalize", "use_activation", "task", "truncate_prompt_tokens", "priority"}
)
# Unloaded adapter ids remembered to refuse requests resolved before their unload: far more
# unloads than can happen while one request is between its resolution and the engine thread.
MAX_UNLOADED_LORAS = 1024

_PAUSED = APIError(503, "the request was aborted: the engine was paused (POST /pause or /sleep)")


@dataclass(slots=True, eq=False)
class _Stream:
    """One engine request in flight: where its outputs go, and its latency bookkeeping."""

    group: RequestGroup
    index: int  # in the group
    # its latency bookkeeping (output thread only); arrival: when the HTTP thread handed it
    # over (monotonic: the engine's clock too)
    clock: RequestClock

    @property
    def request_id(self) -> str:
        """The caller's (external) id, which `request_ids.internal_ids` matches."""
        return self.group.request_ids[self.index]


@dataclass
class _Add:
    group: RequestGroup
    index: int
    engine_id: str  # the engine's (internal, unique) id of group member `index`
    prompt: dict[str, Any]  # {"prompt_token_ids": ids} and, for a text prompt, "prompt": text
    params: SamplingParams
    arrival: float
    lora_request: Any = None  # the adapter's LoRARequest (lora.py), None for the base model
    priority: int = 0


@dataclass
class _Call:
    """Run `fn` on the engine thread (the engine's owner) and hand its result back."""

    fn: Callable[[], Any]
    future: Future


class EngineClient:
    def __init__(
        self,
        engine: Any,
        *,
        metrics: Metrics | None = None,
        max_queued_requests: int | None = None,
    ):
        self.engine = engine
        self.metrics = metrics or Metrics("model")
        self.max_queued = max_queued_requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # -> the engine thread
        self._wake = threading.Event()
        # -> the output thread: each step's core outputs, in step order; None ends the thread
        self._core_outputs: queue.SimpleQueue = queue.SimpleQueue()
        # Requests in flight. The engine thread adds, aborts and fails them; the output thread
        # delivers to them and removes the finished (and fails a step's requests on an error).
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards `_streams`: a few dict operations at a time
        self._pending_lock = threading.Lock()
        self._pending_adds = 0
        self._stopping = False
        self._dead: str | None = None  # why the engine can run no more steps (a rank died)
        # Called once, on the engine thread, when `_dead` is set (paged-server shuts down).
        self.on_engine_death: Callable[[], None] | None = None
        # Engine thread only. Adapters unloaded by id: a request for one still queued when it
        # was unloaded fails with a 404 instead of loading it again. Only a request resolved
        # before the unload can name one, so the newest MAX_UNLOADED_LORAS ids are kept (an
        # insertion-ordered set; one per unload would grow without end). `_lora_removals`:
        # those the engine refused to remove while requests used them, retried after each step.
        self._unloaded_loras: dict[int, None] = {}
        self._lora_removals: set[int] = set()
        # Engine thread only. Calls that run once the engine has nothing left to step (a
        # "wait" pause); while one is queued, new requests are held back here, not added.
        self._idle_calls: list[_Call] = []
        self._held_adds: list[_Add] = []
        # Imported here, with the engine built: its module imports torch, and the server's
        # modules never do (paged-server binds its port before anything imports torch).
        from paged_engine.core.scheduler import SchedulerStuckError
        from paged_engine.core.step_isolation import RequestFailedError
        from paged_engine.executor.base import EngineDeadError

        self._dead_error: type[Exception] = EngineDeadError
        self._stuck_error: type[SchedulerStuckError] = SchedulerStuckError
        self._request_failed: type[RequestFailedError] = RequestFailedError
        self.stats = engine.get_stats()
        self._check_health: Callable[[], None] | None = getattr(engine, "check_health", None)
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._loop_done = threading.Event()
        self._loop_running = False
        self._output_thread = threading.Thread(
            target=self._output_loop, name="engine-output", daemon=True
        )

    # ---- HTTP-thread API -------------------------------------------------------------------
    def start(self, engine_thread: bool = True) -> None:
        """Start the output thread, and the engine loop on a thread of its own unless the
        caller runs it (`run_engine_loop`, on the thread that loaded the engine).

        The client is `alive` from here on either way: a caller that runs the loop itself
        announces the server before it enters the loop, and a /health in between is not a
        dead engine. Commands sent before the loop runs wait in its queue."""
        self._loop_running = True
        self._output_thread.start()
        if engine_thread:
            self._thread.start()

    def run_engine_loop(self) -> None:
        """Run the engine loop on the calling thread until stop(); after start(False)."""
        self._loop_running = True
        self._loop()

    @property
    def alive(self) -> bool:
        return (
            self._loop_running
            and self._output_thread.is_alive()
            and not self._stopping
            and self._dead is None
        )

    @property
    def failure(self) -> str | None:
        """Why the engine can serve no more requests (a rank died), or None."""
        return self._dead

    def num_in_flight(self) -> int:
        return len(self._streams) + self._pending_adds

    @staticmethod
    def make_params(kwargs: dict[str, Any], *, beam: bool, stream: bool) -> SamplingParams:
        """Build SamplingParams in the calling thread; its ValueErrors become 400s. A stream
        gets DELTA outputs, anything else one FINAL_ONLY output."""
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        kwargs = {**kwargs, "output_kind": kind}
        if beam:
            kwargs["use_beam_search"] = True
        unknown = sorted(k for k in kwargs if k not in _SP_FIELDS)
        if unknown:
            raise bad_request(
                f"parameter '{unknown[0]}' is not supported by this engine", unknown[0]
            )
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as e:
            raise bad_request(str(e), _guess_param(str(e), _SP_FIELDS)) from None

    def check_queue(self) -> None:
        if self.max_queued is None:
            return
        waiting = self.stats.num_waiting + self._pending_adds
        if waiting >= self.max_queued:
            raise APIError(
                429,
                f"The server is busy: {waiting} requests are waiting "
                f"(--max-queued-requests {self.max_queued}). Retry later.",
                code="queue_full",
                headers={"Retry-After": "1"},
            )

    def add(
        self,
        request_ids: list[str],
        prompts: list[dict[str, Any]],
        params: SamplingParams,
        lora_request: Any = None,
        priority: int = 0,
    ) -> RequestGroup:
        self._read_adapter(lora_request)
        group = RequestGroup(request_ids)
        now = time.monotonic()
        with self._pending_lock:
            self._pending_adds += len(prompts)
        for i, prompt in enumerate(prompts):
            engine_id = internal_request_id(request_ids[i])
            self._commands.put(
                _Add(group, i, engine_id, prompt, params, now, lora_request, priority)
            )
        self._wake.set()
        return group

    def add_lora(self, lora_request: Any, timeout: float = 300.0) -> bool:
        """engine.add_lora on the engine thread; its ValueError (a bad adapter) is raised here."""
        self._read_adapter(lora_request, timeout)
        return self.call(lambda: self.engine.add_lora(lora_request), timeout)

    def _read_adapter(self, lora_request: Any, timeout: float = 300.0) -> None:
        """Wait (this thread) for the adapter's files to be read; the engine thread's add then
        installs it, or raises the read's ValueError. After `timeout` the add waits instead."""
        prefetch = getattr(self.engine, "prefetch_lora", None)
        if lora_request is None or prefetch is None:
            return
        read = prefetch(lora_request)
        if read is not None:
            wait([read], timeout)

    def remove_lora(self, lora_int_id: int, timeout: float = 60.0) -> None:
        """Unload an adapter: requests for it not yet in the engine fail with a 404; if
        requests in the engine use it, it is removed once the engine lets go of it."""
        self.call(lambda: self._remove_lora(lora_int_id), timeout)

    def start_profile(self, timeout: float = 60.0) -> None:
        self.call(self.engine.start_profile, timeout)

    def stop_profile(self, timeout: float = 60.0) -> list[str]:
        """The trace files written, one per rank."""
        return self.call(self.engine.stop_profile, timeout)

    def call(self, fn: Callable[[], Any], timeout: float, *, when_idle: bool = False) -> Any:
        """Run `fn` on the engine thread between steps and return its result (its exception
        is raised here); `when_idle`: once every request in the engine has finished, with new
        ones held back until then (sleep mode's "wait")."""
        if not self.alive:
            raise APIError(503, "the engine loop is not running")
        future: Future = Future()
        self._send(("idle_call" if when_idle else "call", _Call(fn, future)))
        if not self._loop_running:  # the loop ended after the check: nobody will run it
            self._fail_calls()
        try:
            return future.result(timeout)
        except TimeoutError:
            raise APIError(503, f"the engine did not answer within {timeout:.0f} s") from None

    def abort(self, request_ids: list[str], group: RequestGroup | None = None) -> None:
        """Abort the requests of these external ids; with `group`, only its own (another
        client's request may carry the same id: it goes on)."""
        self._send(("abort", list(request_ids), group))

    def abort_all(self) -> None:
        self._send(("abort_all", None))

    def stop(self, timeout: float = 10.0) -> None:
        """End both threads: every request still in flight fails with a 503."""
        deadline = time.monotonic() + timeout
        self._stopping = True
        self._wake.set()
        if self._loop_running:
            self._loop_done.wait(timeout)
        self._core_outputs.put(None)  # behind the engine thread's last outputs
        self._output_thread.join(max(0.0, deadline - time.monotonic()))

    def _send(self, cmd: tuple[str, Any]) -> None:
        self._commands.put(cmd)
        self._wake.set()

    # ---- engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping:
                try:
                    self._iterate()
                except self._dead_error as e:  # a worker rank died: no step can run again
                    log.error("the engine failed: %s", e)
                    first = self._dead is None
                    self._dead = f"the engine failed and cannot serve requests: {e}"
                    self._fail_all(APIError(500, self._dead))
                    if first and self.on_engine_death is not None:
                        self.on_engine_death()
                except self._stuck_error as e:
                    self._fail_stuck(e)
                except self._request_failed as e:  # a step failed with these alone: only them
                    log.error("%s", e)
                    status = 400 if isinstance(e.cause, ValueError) else 500
                    self._fail(e.request_ids, APIError(status, f"the request failed: {e.cause}"))
                except Exception:  # the engine's state is unknown: fail what is in flight
                    log.exception("engine loop error; failing the requests in flight")
                    self._fail_all(APIError(500, "internal engine error"))
            self._fail_all(APIError(503, "the server is shutting down"))
        finally:
            self._loop_running = False
            self._loop_done.set()
            self._fail_calls()

    def _iterate(self) -> None:
        handled = self._drain()
        if self.engine.can_step():  # requests while not paused (sleep mode), or held outputs
            # Registration before outputs: `_drain` ran engine.add_request and filled `_streams`
            # for a request before the first step_core that can schedule it (the scheduler sees
            # only added requests), and that step's outputs are queued after it returns. The
            # queue orders the put after those writes and the output thread's get after the put,
            # so no output reaches the output thread before its request is known to both.
            core_outputs = self.engine.step_core()
            if core_outputs:
                self._core_outputs.put(core_outputs)
            self._refresh_stats()
        elif self._idle_calls:
            self._run_idle_calls()
        else:
            if handled:
                self._refresh_stats()
            if self._dead is None and self._check_health is not None:
                self._check_health()  # a rank lost while idle: EngineDeadError, as in a step
            self._wake.wait(0.1 if self._lora_removals else 1.0)
            self._wake.clear()
        if self._lora_removals:
            self._retry_lora_removals()

    def _drain(self) -> int:
        handled = adds = 0
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            handled += 1
            if isinstance(cmd, _Add):
                if self._idle_calls:  # behind a "wait" pause: added once it ran
                    self._held_adds.append(cmd)
                    continue
                self._do_add(cmd)
                adds += 1
            elif cmd[0] == "finish":  # stop strings the output stage saw
                self.engine.finish_seqs(cmd[1])
            elif cmd[0] == "abort":
                self._do_abort(cmd[1], cmd[2])
            elif cmd[0] == "failed":  # the output stage failed them: free them in the engine
                self._abort_in_engine(cmd[1])
            elif cmd[0] == "abort_all":
                self._fail_all(APIError(503, "the server is shutting down"))
            elif cmd[0] == "call":
                self._do_call(cmd[1])
            elif cmd[0] == "idle_call":
                self._idle_calls.append(cmd[1])
        if adds:
            # Refresh before un-counting, so waiting requests are always counted in one of
            # `stats.num_waiting` and `_pending_adds` (the queue limit never under-counts).
            self._refresh_stats()
            with self._pending_lock:
                self._pending_adds -= adds
        return handled

    def _run_idle_calls(self) -> None:
        """The engine has nothing left to step: run the calls that waited for it, then add
        the requests held back meanwhile."""
        calls, self._idle_calls = self._idle_calls, []
        for call in calls:
            self._do_call(call)
        held, self._held_adds = self._held_adds, []
        for cmd in held:
            self._do_add(cmd)
        self._refresh_stats()
        if held:
            with self._pending_lock:
                self._pending_adds -= len(held)

    def _fail_stuck(self, e: Any) -> None:
        """A request that cannot fit the KV pool even alone (n sequences grown past it) fails
        on its own with a 400; the others go on. Without a named culprit, everything fails."""
        if not e.request_ids:
            log.error("%s; failing the requests in flight", e)
            self._fail_all(APIError(500, "internal engine error"))
            return
        log.warning("%s: failing %s", e, ", ".join(e.request_ids))
        err = bad_request(e.culprit_message(), "max_tokens")
        self._fail(e.request_ids, err)
        self._abort_in_engine(e.request_ids)  # free it even if its stream was already gone

    def _do_add(self, cmd: _Add) -> None:
        group = cmd.group
        rid = cmd.engine_id
        lora = cmd.lora_request
        try:
            if self._dead is not None:  # /health says 503 too: restart the server
                raise self._dead_error(self._dead)
            if lora is not None and lora.lora_int_id in self._unloaded_loras:
                raise model_not_found(lora.lora_name)
            # arrival: when the HTTP thread handed it over (monotonic, the engine's clock too)
            extra: dict[str, Any] = {} if lora is None else {"lora_request": lora}
            if cmd.priority:
                extra["priority"] = cmd.priority
            self.engine.add_request(rid, cmd.prompt, cmd.params, arrival_time=cmd.arrival, **extra)
        except self._dead_error as e:
            group.add_error = group.add_error or APIError(503, str(e))
        except GrammarBusyError as e:  # no thread for its grammar: the server's state
            group.add_error = group.add_error or busy(e)
        except APIError as e:
            group.add_error = group.add_error or e
        except ValueError as e:
            # The client named the adapter by `model`: an adapter the engine refuses is that.
            param = "model" if lora is not None and "lora" in str(e).lower() else None
            group.add_error = group.add_error or bad_request(
                str(e), param or _guess_param(str(e), _SP_FIELDS | _POOLING_FIELDS)
            )
        except Exception as e:
            log.exception("add_request(%s) failed", rid)
            group.add_error = group.add_error or APIError(500, f"internal error adding {rid}: {e}")
        else:
            with self._lock:
                clock = request_clock(cmd.arrival, cmd.params)
                self._streams[rid] = _Stream(group, cmd.index, clock)
        group._num_added += 1
        if group._num_added == len(group.request_ids):
            group._added.set()

    def _do_call(self, call: _Call) -> None:
        if not call.future.set_running_or_notify_cancel():
            return
        try:
            result = call.fn()
        except Exception as e:  # the caller's to handle (ValueError: a bad adapter)
            call.future.set_exception(e)
        else:
            call.future.set_result(result)

    def _fail_calls(self) -> None:
        """After the loop: calls still queued get a 503 (adds and the rest need no answer)."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            call = None if isinstance(cmd, _Add) or cmd[0] not in ("call", "idle_call") else cmd[1]
            if call is not None and call.future.set_running_or_notify_cancel():
                call.future.set_exception(APIError(503, "the server is shutting down"))
        calls, self._idle_calls = self._idle_calls, []
        for call in calls:
            if call.future.set_running_or_notify_cancel():
                call.future.set_exception(APIError(503, "the server is shutting down"))

    def _remove_lora(self, lora_int_id: int) -> None:
        self._unloaded_loras[lora_int_id] = None
        if len(self._unloaded_loras) > MAX_UNLOADED_LORAS:
            del self._unloaded_loras[next(iter(self._unloaded_loras))]  # the oldest unload
        if not self.engine.remove_lora(lora_int_id) and lora_int_id in self.engine.list_loras():
            self._lora_removals.add(lora_int_id)  # requests in the engine still use it

    def _retry_lora_removals(self) -> None:
        try:
            loaded = self.engine.list_loras()
            for lora_id in list(self._lora_removals):
                if lora_id not in loaded or self.engine.remove_lora(lora_id):
                    self._lora_removals.discard(lora_id)
        except Exception:
            log.exception("removing unloaded LoRA adapters failed")

    def _do_abort(self, request_ids: list[str], group: RequestGroup | None = None) -> None:
        """`request_ids` are external: each names every engine request of it (in `group`)."""
        ids = set(request_ids)
        mine = None if group is None else (lambda s: s.group is group)
        with self._lock:
            streams = self._streams
            live = [rid for rid, _ in pop_each(streams, internal_ids(streams, ids, mine))]
        if live:
            self._abort_in_engine(live)
            self.metrics.requests_aborted += len(live)
        if self._held_adds:  # held back by a "wait" pause: never added now
            dropped = [
                c
                for c in self._held_adds
                if c.group.request_ids[c.index] in ids and group in (None, c.group)
            ]
            self._held_adds = [c for c in self._held_adds if c not in dropped]
            for c in dropped:  # counted as handed over, so nothing waits on them
                c.group._num_added += 1
                if c.group._num_added == len(c.group.request_ids):
                    c.group._added.set()
            if dropped:
                with self._pending_lock:
                    self._pending_adds -= len(dropped)

    def _fail_all(self, err: APIError) -> None:
        rids = self._fail(None, err)
        if rids:
            self._abort_in_engine(rids)

    def _abort_in_engine(self, request_ids: list[str]) -> None:
        try:
            self.engine.abort_request(request_ids)
        except Exception:
            log.exception("abort_request(%s) failed", request_ids)

    def _refresh_stats(self) -> None:
        try:
            self.stats = self.engine.get_stats()
        except Exception:
            log.exception("get_stats failed")

    # ---- output thread ---------------------------------------------------------------------
    def _output_loop(self) -> None:
        while (core_outputs := self._core_outputs.get()) is not None:
            try:
                processed = self.engine.process_outputs(core_outputs)
                if processed.stopped:
                    self._send(("finish", processed.stopped))
                if processed.aborted:  # embeddings a pause aborted: they have no answer
                    self._fail(processed.aborted, _PAUSED)
                self._dispatch(processed.request_outputs)
            except Exception:  # this step's output state is unknown: fail its requests, go on
                log.exception("output stage error; failing the requests of this step")
                err = APIError(500, "internal engine error")
                failed = self._fail([co.request_id for co in core_outputs], err)
                if failed:
                    self._send(("failed", failed))
            # not held while the queue is empty: the last step's whole answers (their
            # logprobs and prompt logprobs) would stay alive for as long as the server idles
            core_outputs = processed = None

    def _dispatch(self, outputs: list[Any]) -> None:
        now = time.monotonic()
        delivered = []
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:  # aborted or failed after its step ran
                    continue
                stream.group.queue.put((stream.index, out))
                if out.finished:
                    del self._streams[out.request_id]
                delivered.append((stream, out))
        for stream, out in delivered:  # metrics only: a failure here must not fail requests
            try:
                self._observe(stream, out, now)
            except Exception:
                log.exception("metrics of request %s not observed", out.request_id)

    def _observe(self, stream: _Stream, out: Any, now: float) -> None:
        """Latency histograms from the engine's token times (engine/request_latency.py)."""
        self.metrics.latency.observe(stream.clock, out, now)

    # ---- either thread ---------------------------------------------------------------------
    def _fail(self, request_ids: list[str] | None, err: APIError) -> list[str]:
        """Fail these requests (None: every one in flight) with `err`; returns those that were
        still in flight. The caller frees them in the engine (on the engine thread)."""
        with self._lock:
            streams = self._streams
            failed = pop_each(streams, list(streams) if request_ids is None else request_ids)
            for _, stream in failed:
                stream.group.queue.put((stream.index, err))
        return [rid for rid, _ in failed]


def _guess_param(message: str, fields: set[str]) -> str | None:
    """The engine's ValueErrors name the parameter: the first field named as a whole word."""
    hits = [(m.start(), f) for f in fields if (m := re.search(rf"\b{re.escape(f)}\b", message))]
    if hits:
        return min(hits)[1]
    return "prompt" if "prompt" in message else None
