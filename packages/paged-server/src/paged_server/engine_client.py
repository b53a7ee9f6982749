"""The engine loop thread and the thread-safe handles HTTP threads use to talk to it.

Invariants:
- Exactly one thread (the engine thread) calls the engine's add_request / step / abort_request /
  get_stats and uses the engine's tokenizer. HTTP threads only push commands onto `_commands` and
  read their own `RequestGroup`.
- Every request asks the engine for DELTA outputs (streams) or FINAL_ONLY (one output at the
  end): each output holds only what is new, so the HTTP thread consumes all of them, in order.
  Outputs are fresh objects the engine never touches after step(): they cross threads as they are.
- The engine thread never blocks on a socket or on a consumer: outputs go to unbounded per-request
  queues, and a slow consumer merges what piled up.
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

from paged_engine.sampling_params import RequestOutputKind, SamplingParams
from paged_server.errors import APIError, bad_request
from paged_server.metrics import Metrics

log = logging.getLogger("paged_server")

_SP_FIELDS = frozenset(inspect.signature(SamplingParams).parameters)


@dataclass(slots=True)
class _Tracking:
    """Engine-thread bookkeeping for the latency histograms."""

    arrival: float
    last_token: float | None = None  # None until the first token arrived


class RequestGroup:
    """The HTTP side of the engine requests of one HTTP request (one per prompt).

    The engine thread puts `(index, RequestOutput | APIError)` on one shared queue, so a single
    blocking `get` wakes on progress of any member.
    """

    def __init__(self, request_ids: list[str]):
        self.request_ids = request_ids
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        # The newest output of each member: with FINAL_ONLY, the whole result once it finished.
        self.latest: list[Any] = [None] * len(request_ids)
        self.num_finished = 0
        self.num_generated_tokens = 0  # over every output so far (each holds only new tokens)
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

    def next(self, timeout: float) -> list[tuple[int, Any]]:
        """Every `(member index, RequestOutput)` that arrived, in order, after waiting up to
        `timeout` for the first; may be empty.

        Raises the APIError the engine thread reported for any member.
        """
        try:
            item = self.queue.get(timeout=timeout)
        except queue.Empty:
            return []
        arrived = []
        while True:
            index, out = item
            if isinstance(out, APIError):
                raise out
            self.latest[index] = out
            self.num_finished += out.finished
            self.num_generated_tokens += sum(len(o.token_ids) for o in out.outputs)
            arrived.append(item)
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return arrived


@dataclass
class _Add:
    group: RequestGroup
    index: int
    prompt: dict[str, Any]  # {"prompt_token_ids": ids} and, for a text prompt, "prompt": text
    params: SamplingParams
    arrival: float


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
        self, request_ids: list[str], prompts: list[dict[str, Any]], params: SamplingParams
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
                str(e), _guess_param(str(e), _SP_FIELDS)
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
            member[0].queue.put((member[1], out))
            self._observe(out, now)
            if out.finished:
                del self._streams[out.request_id]
                self._tracking.pop(out.request_id, None)

    def _observe(self, out: Any, now: float) -> None:
        """Latency histograms from the engine's token times (its clock is ours: monotonic).

        One output may cover several steps (FINAL_ONLY, or beams): the span from its first (or
        the previous output's last) token to its last is observed as that many equal gaps, so
        the inter-token sum and count are those of per-step observation.
        """
        t = self._tracking.get(out.request_id)
        if t is None:
            return
        m, rm = self.metrics, out.metrics
        steps = max((len(o.token_ids) for o in out.outputs), default=0)
        if steps:
            first, last = (now, now) if rm is None else (rm.first_token_time, rm.last_token_time)
            if t.last_token is None:
                m.ttft.observe(first - t.arrival)
                if rm is not None and rm.first_scheduled_time is not None:
                    m.queue_time.observe(max(0.0, rm.first_scheduled_time - rm.arrival_time))
                start, gaps = first, steps - 1
            else:
                start, gaps = t.last_token, steps
            if gaps:
                m.itl.observe((last - start) / gaps, count=gaps)
            t.last_token = last
        if out.finished:
            m.e2e.observe(now - t.arrival)
            for s in out.outputs:
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
