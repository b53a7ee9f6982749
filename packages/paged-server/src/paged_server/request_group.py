"""`RequestGroup`: the HTTP side of one HTTP request's engine requests (one per prompt)."""

from __future__ import annotations

import queue
import threading
from typing import Any

from paged_server.errors import APIError


class RequestGroup:
    """The HTTP side of the engine requests of one HTTP request (one per prompt).

    The output thread puts `(index, RequestOutput)`, and whichever thread fails the request
    `(index, APIError)`, on one shared queue, so a single blocking `get` wakes on progress of any
    member.
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

        Raises the APIError reported for any member.
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
            if isinstance(out.outputs, list):  # an embedding's output has no tokens
                self.num_generated_tokens += sum(len(o.token_ids) for o in out.outputs)
            arrived.append(item)
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return arrived
