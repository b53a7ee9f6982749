"""`RequestGroup`: the HTTP side of one HTTP request's engine requests (one per prompt)."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

from paged_server.errors import APIError

log = logging.getLogger("paged_server")


@dataclass(slots=True)
class _Answer:
    """One completion's output so far, for --enable-log-outputs."""

    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


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
        # --enable-log-outputs: how much of each answer to log (None: nothing); each (member,
        # completion)'s text pieces, token ids and finish reason so far, logged as it finishes
        self.log_outputs: int | None = None
        self._answers: dict[tuple[int, int], _Answer] = {}

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
                if self.log_outputs is not None:
                    self._log_output(index, out)
            arrived.append(item)
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return arrived

    def _log_output(self, index: int, out: Any) -> None:
        """Gather a member's answers (whole, or the deltas of a stream); log each once the
        member finished: one INFO line per completion."""
        for c in out.outputs:
            answer = self._answers.setdefault((index, c.index), _Answer())
            answer.pieces.append(c.text)
            answer.token_ids.extend(c.token_ids)
            answer.finish_reason = c.finish_reason
        if not out.finished:
            return
        cut = self.log_outputs
        for key in sorted(k for k in self._answers if k[0] == index):
            answer = self._answers.pop(key)
            log.info(
                "request %s: output %d %r, output_token_ids %s, finish_reason %s",
                self.request_ids[index],
                key[1],
                "".join(answer.pieces)[:cut],
                answer.token_ids[:cut],
                answer.finish_reason,
            )
