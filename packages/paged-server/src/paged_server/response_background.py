"""Background responses (`POST /v1/responses` with `"background": true`): the request is
answered at once with the response "queued" while a thread of its own runs it through the
stream path; clients poll `GET /v1/responses/{id}` for its status (queued -> in_progress ->
completed / incomplete / failed / cancelled), cancel it (`POST .../cancel`), and, when it was
created with `"stream": true`, read its events again from any point
(`GET /v1/responses/{id}?stream=true&starting_after=N`; a cancelled one's events end with
`response.cancelled`). A client that leaves does not stop it.

Invariants: the stored body is a snapshot, replaced whole (never mutated) once published, so a
GET never reads a body the run is writing; a cancelled run's status stays "cancelled" even if
its last token arrived at the same moment.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from paged_server.errors import APIError, query_int

if TYPE_CHECKING:
    from paged_server.app import OpenAIApp
    from paged_server.http import Handler
    from paged_server.request_group import RequestGroup
    from paged_server.responses_api import StoredResponse

log = logging.getLogger("paged_server")

CANCEL_WAIT_S = 10.0  # how long a cancel waits for the run to abort its engine requests


class BackgroundRun:
    """One background response's run. It stands in for the HTTP handler the stream path
    writes to: its events are kept (when the request streams) for followers, and the client
    is "gone" only once the run is cancelled."""

    def __init__(self, stored: StoredResponse, keep_events: bool) -> None:
        self.stored = stored
        self.events: list[bytes] | None = [] if keep_events else None  # index = sequence_number
        self.event_bytes = 0  # the kept events' size (ResponseStore bounds the sum)
        self.ended = False  # no event follows
        self.cancelled = threading.Event()
        self.finished = False  # the final body is published (settle)
        self.cond = threading.Condition()  # guards events, ended, finished
        self.thread: threading.Thread | None = None
        self.log_extra = ""

    # ---- the Handler surface the stream path uses ------------------------------------------
    def client_gone(self) -> bool:
        return self.cancelled.is_set()

    def start_stream(self) -> None:
        pass

    def send_event(self, obj: Any, event: str | None = None) -> None:
        """Keep one event; ConnectionResetError once cancelled (a socket's send would fail:
        a run whose tokens keep coming never polls client_gone)."""
        if self.cancelled.is_set():
            raise ConnectionResetError("cancelled")
        if self.events is None:
            return
        name = (event or "message").encode()
        data = b"event: %s\ndata: %s\n\n" % (name, json.dumps(obj).encode())
        with self.cond:
            self.events.append(data)
            self.event_bytes += len(data)
            self.cond.notify_all()

    def end_stream(self, done: bool = True) -> None:
        pass  # the run's end (finish) ends the followers' streams

    # ---- the run's state -------------------------------------------------------------------
    def publish(self, body: dict[str, Any], status: str | None = None) -> None:
        """The body as GET answers it from now on (a copy: the run goes on writing `body`)."""
        snapshot = copy.deepcopy(body)
        if status is not None:
            snapshot["status"] = status
        self.stored.body = snapshot

    def settle(self, body: dict[str, Any], context: list[dict[str, Any]] | None) -> None:
        """Publish the final body once (cancelled when a cancel came first), with the
        conversation a finished response continues (`previous_response_id`)."""
        with self.cond:
            if self.finished:
                return
            if self.cancelled.is_set():
                self.publish(body, "cancelled")
            else:
                self.publish(body)
                if context is not None:
                    self.stored.context = context
            self.finished = True

    def end(self) -> None:
        """No event follows: the followers' streams end, a cancelled run's after a last
        `response.cancelled` event carrying the response (status "cancelled"), so a follower
        tells a cancel from a stream cut short. (OpenAI's stream events name no cancel -- its
        webhook event for one is `response.cancelled` --, and vLLM's followers of a cancelled
        run wait on with no event at all: a terminal event of OpenAI's name, in the shape of
        `response.completed` / `response.failed`.)"""
        with self.cond:
            if self.events is not None and self.stored.body.get("status") == "cancelled":
                event = {
                    "type": "response.cancelled",
                    "sequence_number": len(self.events),
                    "response": self.stored.body,
                }
                data = b"event: response.cancelled\ndata: %s\n\n" % json.dumps(event).encode()
                self.events.append(data)
                self.event_bytes += len(data)
            self.ended = True
            self.cond.notify_all()

    def cancel(self) -> bool:
        """Ask the run to stop; False when it already finished otherwise (nothing to cancel)."""
        with self.cond:
            if self.finished and not self.cancelled.is_set():
                return False
            self.cancelled.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(CANCEL_WAIT_S)
        return True

    def follow(self, after: int, gone: Callable[[], bool], poll: float) -> Iterator[bytes]:
        """The kept events after sequence number `after`, then each as it comes, until the run
        ends; ConnectionResetError when the follower left while nothing came."""
        assert self.events is not None
        i = after + 1
        while True:
            with self.cond:
                if i >= len(self.events) and not self.ended:
                    self.cond.wait(poll)
                batch, ended = self.events[i:], self.ended
            yield from batch
            i += len(batch)
            if ended and i >= len(self.events):
                return
            if not batch and gone():
                raise ConnectionResetError("client disconnected")


def start(
    app: OpenAIApp,
    h: Handler,
    run: BackgroundRun,
    group: RequestGroup,
    rids: list[str],
    body: dict[str, Any],
    work: Callable[[], None],
    structured_param: str | None = None,
) -> None:
    """Hand a submitted group to a thread of its own once the engine took it (a refusal is
    still this request's HTTP error, one of the constraint naming `structured_param`). `work`
    runs the response through `run`, writing `body`, and settles it when it finishes; a cancel
    or an error settles it here."""
    try:
        app._await_added(h, group, structured_param)
    except BaseException:
        if not group.done:
            app.client.abort(rids, group)
        raise
    rid = body["id"]

    def main() -> None:
        try:
            with app._in_flight(run, group, rids):
                work()
        except ConnectionResetError:  # cancelled: _in_flight aborted the engine requests
            pass
        except Exception as e:  # the run fails alone; the server serves on
            log.exception("background response %s failed", rid)
            body["status"] = "failed"
            body["error"] = {"code": "server_error", "message": str(e) or type(e).__name__}
        finally:
            run.settle(body, None)
            run.end()
            log.info("background response %s %s%s", rid, run.stored.body["status"], run.log_extra)

    run.thread = threading.Thread(target=main, name=f"background-{rid}", daemon=True)
    run.thread.start()


def serve_events(app: OpenAIApp, h: Handler, stored: StoredResponse, query: dict) -> None:
    """`GET /v1/responses/{id}?stream=true[&starting_after=N]`: a background streamed
    response's events after sequence number N (from the first without it), then the rest as
    they come."""
    run = stored.run
    rid = stored.body["id"]
    if run is None or run.events is None:
        raise APIError(
            400,
            f"Response {rid!r} cannot be streamed: only a response created with "
            "'background': true and 'stream': true keeps its events",
            "stream",
        )
    # (no stream holds 10**18 events)
    after = query_int(
        query, "starting_after", -1, 0, 10**18 - 1, "a sequence number (an integer >= 0)"
    )
    h.start_stream()
    for event in run.follow(after, h.client_gone, app.poll_interval):
        h.send_chunk(event)
    h.end_stream(done=False)
