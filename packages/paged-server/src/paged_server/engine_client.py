"""The engine loop thread and the thread-safe handles HTTP threads use to talk to it.

Invariants:
- Exactly one thread (the engine thread) calls the engine's add_request / step / abort_request /
  get_stats. HTTP threads only push commands onto `_commands` and read their own `RequestGroup`.
- The engine thread never blocks on a socket or on a consumer: outputs go to unbounded per-request
  queues, and since outputs are cumulative a slow consumer simply skips to the newest one.
- `stats` is an immutable snapshot replaced by the engine thread after every step and every batch
  of commands, so /metrics and /health never wait for the engine.
"""

from __future__ import annotations

import inspect
import logging
import queue
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from paged_server.errors import APIError, bad_request
from paged_server.metrics import Metrics

log = logging.getLogger("paged_server")


@dataclass(slots=True)
class SeqSnapshot:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(slots=True)
class OutputSnapshot:
    """A copy of one RequestOutput taken on the engine thread (the engine may reuse its objects)."""

    request_id: str
    prompt_token_ids: list[int]
    prompt_logprobs: list | None
    outputs: list[SeqSnapshot]
    finished: bool


def _snapshot(out: Any) -> OutputSnapshot:
    seqs = [
        SeqSnapshot(
            index=o.index,
            text=o.text,
            token_ids=list(o.token_ids),
            cumulative_logprob=o.cumulative_logprob,
            logprobs=None if o.logprobs is None else list(o.logprobs),
            finish_reason=o.finish_reason,
            stop_reason=getattr(o, "stop_reason", None),
        )
        for o in out.outputs
    ]
    prompt_lp = getattr(out, "prompt_logprobs", None)
    return OutputSnapshot(
        request_id=out.request_id,
        prompt_token_ids=list(out.prompt_token_ids or []),
        prompt_logprobs=None if prompt_lp is None else list(prompt_lp),
        outputs=seqs,
        finished=bool(out.finished),
    )


@dataclass(slots=True)
class _Tracking:
    """Engine-thread bookkeeping for the latency histograms."""

    arrival: float
    first_token: float | None = None
    last_token: float = 0.0
    num_tokens: int = 0


class RequestGroup:
    """The HTTP side of the engine requests of one HTTP request (one per prompt).

    The engine thread puts `(index, OutputSnapshot | APIError)` on one shared queue, so a single
    blocking `get` wakes on progress of any member.
    """

    def __init__(self, request_ids: list[str]):
        self.request_ids = request_ids
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.latest: list[OutputSnapshot | None] = [None] * len(request_ids)
        self.num_finished = 0
        self.add_error: APIError | None = None  # set by the engine thread before `_added`
        self._num_added = 0  # engine thread only
        self._added = threading.Event()

    def wait_added(self, timeout: float) -> bool:
        """True once the engine took (or refused) every member; then raises a refusal."""
        if not self._added.wait(timeout):
            return False
        if self.add_error is not None:
            raise self.add_error
        return True

    @property
    def done(self) -> bool:
        return self.num_finished == len(self.request_ids)

    def next(self, timeout: float) -> set[int]:
        """Indices that progressed, after waiting up to `timeout` for the first; may be empty.

        Raises the APIError the engine thread reported for any member.
        """
        try:
            item = self.queue.get(timeout=timeout)
        except queue.Empty:
            return set()
        updated: set[int] = set()
        while True:
            index, snap = item
            if isinstance(snap, APIError):
                raise snap
            self.latest[index] = snap
            if snap.finished:
                self.num_finished += 1
            updated.add(index)
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return updated


@dataclass
class _Add:
    group: RequestGroup
    index: int
    prompt: str | list[int]
    params: Any
    arrival: float


class EngineClient:
    def __init__(
        self,
        engine: Any,
        sampling_params_cls: type,
        *,
        metrics: Metrics | None = None,
        max_queued_requests: int | None = None,
    ):
        self.engine = engine
        self._sp_cls = sampling_params_cls
        self._sp_fields = set(inspect.signature(sampling_params_cls).parameters)
        self.metrics = metrics or Metrics("model")
        self.max_queued = max_queued_requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[RequestGroup, int]] = {}  # engine thread only
        self._tracking: dict[str, _Tracking] = {}  # engine thread only
        self._pending_lock = threading.Lock()
        self._pending_adds = 0
        self._stopping = False
        self.stats = engine.get_stats()
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)

    # ---- HTTP-thread API -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def num_in_flight(self) -> int:
        return len(self._streams) + self._pending_adds

    def make_params(self, kwargs: dict[str, Any], beam: bool) -> Any:
        """Build SamplingParams in the calling thread; its ValueErrors become 400s."""
        if beam:
            kwargs = {**kwargs, "use_beam_search": True}
        unknown = sorted(k for k in kwargs if k not in self._sp_fields)
        if unknown:
            raise bad_request(
                f"parameter '{unknown[0]}' is not supported by this engine", unknown[0]
            )
        try:
            return self._sp_cls(**kwargs)
        except (ValueError, TypeError) as e:
            raise bad_request(str(e), _guess_param(str(e), self._sp_fields)) from None

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
        self, request_ids: list[str], prompts: list[str | list[int]], params: Any
    ) -> RequestGroup:
        group = RequestGroup(request_ids)
        now = time.monotonic()
        with self._pending_lock:
            self._pending_adds += len(prompts)
        for i, prompt in enumerate(prompts):
            self._commands.put(_Add(group, i, prompt, params, now))
        self._wake.set()
        return group

    def abort(self, request_ids: list[str]) -> None:
        self._commands.put(("abort", list(request_ids)))
        self._wake.set()

    def abort_all(self) -> None:
        self._commands.put(("abort_all", None))
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    # ---- engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            try:
                self._iterate()
            except Exception:  # the engine's state is unknown: fail what is in flight, go on
                log.exception("engine loop error; failing the requests in flight")
                self._fail_all(APIError(500, "internal engine error"))
        self._fail_all(APIError(503, "the server is shutting down"))

    def _iterate(self) -> None:
        handled = self._drain()
        if self.engine.has_unfinished_requests():
            self._dispatch(self.engine.step())
            self._refresh_stats()
        else:
            if handled:
                self._refresh_stats()
            self._wake.wait(1.0)
            self._wake.clear()

    def _drain(self) -> int:
        handled = adds = 0
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            handled += 1
            if isinstance(cmd, _Add):
                self._do_add(cmd)
                adds += 1
            elif cmd[0] == "abort":
                self._do_abort(cmd[1])
            elif cmd[0] == "abort_all":
                self._fail_all(APIError(503, "the server is shutting down"))
        if adds:
            # Refresh before un-counting, so waiting requests are always counted in one of
            # `stats.num_waiting` and `_pending_adds` (the queue limit never under-counts).
            self._refresh_stats()
            with self._pending_lock:
                self._pending_adds -= adds
        return handled

    def _do_add(self, cmd: _Add) -> None:
        group = cmd.group
        rid = group.request_ids[cmd.index]
        try:
            # arrival: when the HTTP thread handed it over (monotonic, the engine's clock too)
            self.engine.add_request(rid, cmd.prompt, cmd.params, arrival_time=cmd.arrival)
        except ValueError as e:
            group.add_error = group.add_error or bad_request(
                str(e), _guess_param(str(e), self._sp_fields)
            )
        except Exception as e:
            log.exception("add_request(%s) failed", rid)
            group.add_error = group.add_error or APIError(500, f"internal error adding {rid}: {e}")
        else:
            self._streams[rid] = (group, cmd.index)
            self._tracking[rid] = _Tracking(arrival=cmd.arrival)
        group._num_added += 1
        if group._num_added == len(group.request_ids):
            group._added.set()

    def _do_abort(self, request_ids: list[str]) -> None:
        live = [r for r in request_ids if r in self._streams]
        for rid in live:
            self._streams.pop(rid)
            self._tracking.pop(rid, None)
        if live:
            try:
                self.engine.abort_request(live)
            except Exception:
                log.exception("abort_request(%s) failed", live)
            self.metrics.requests_aborted += len(live)

    def _fail_all(self, err: APIError) -> None:
        rids = list(self._streams)
        for rid in rids:
            group, index = self._streams.pop(rid)
            group.queue.put((index, err))
            self._tracking.pop(rid, None)
        if rids:
            try:
                self.engine.abort_request(rids)
            except Exception:
                log.exception("abort_request failed while failing all requests")

    def _dispatch(self, outputs: list[Any]) -> None:
        now = time.monotonic()
        for out in outputs:
            member = self._streams.get(out.request_id)
            if member is None:  # aborted after this step was scheduled
                continue
            snap = _snapshot(out)
            member[0].queue.put((member[1], snap))
            self._observe(out, snap, now)
            if snap.finished:
                del self._streams[out.request_id]
                self._tracking.pop(out.request_id, None)

    def _observe(self, out: Any, snap: OutputSnapshot, now: float) -> None:
        t = self._tracking.get(snap.request_id)
        if t is None:
            return
        m = self.metrics
        num = sum(len(s.token_ids) for s in snap.outputs)
        if num > t.num_tokens:
            if t.first_token is None:
                t.first_token = now
                m.ttft.observe(now - t.arrival)
                rm = getattr(out, "metrics", None)
                sched, arr = (
                    getattr(rm, "first_scheduled_time", None),
                    getattr(rm, "arrival_time", None),
                )
                if sched is not None and arr is not None:
                    m.queue_time.observe(max(0.0, sched - arr))
            else:
                m.itl.observe(now - t.last_token)
            t.last_token = now
            t.num_tokens = num
        if snap.finished:
            m.e2e.observe(now - t.arrival)
            for s in snap.outputs:
                m.finished[s.finish_reason or "unknown"] += 1

    def _refresh_stats(self) -> None:
        try:
            self.stats = self.engine.get_stats()
        except Exception:
            log.exception("get_stats failed")


def _guess_param(message: str, fields: set[str]) -> str | None:
    """The engine's ValueErrors name the parameter: the first field named as a whole word."""
    hits = [(m.start(), f) for f in fields if (m := re.search(rf"\b{re.escape(f)}\b", message))]
    if hits:
        return min(hits)[1]
    return "prompt" if "prompt" in message else None
