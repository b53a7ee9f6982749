"""Engine ids of requests whose callers' ids may repeat (standard library only: the server
imports it without torch).

A caller's (external) id may name several requests in flight; each engine request has an
internal id of its own, `internal_request_id` (vLLM's `InputProcessor.assign_request_id`), and
aborting a caller's id aborts every request added under it. Three places map one to the other:

- `AsyncLLM` and paged-server's `EngineClient` give every request an internal id, before the
  engine thread adds it (a caller that leaves early must name it), and keep their streams in a
  dict by internal id, each stream naming its caller's id; `internal_ids` and `pop_each` are
  the rules their aborts and failures share. AsyncLLM rewrites each output's id to the
  caller's; the server's groups know their members' ids, so its outputs keep the internal id.
  A server abort reaches only its own group's streams (another client may send the same
  X-Request-Id), and the `_lock` its output thread shares guards the map.
- `LLMEngine` keeps the caller's id as the engine id unless a request of that id is in flight
  (its return value, what `LLM` and callers of `abort_request` name); a duplicate's caller id
  lives in the output stage's `RequestState.external_req_id`, which also names its outputs.
  The map ends where that state ends (finish, stop string: the output stage, on the server's
  output thread), so it stays there rather than in a second map to clean per output.

Ids a failure names (`RequestFailedError.request_ids`, `SchedulerStuckError.request_ids`,
a paused pooling request) are internal ids: `pop_each` their streams.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, TypeVar


def internal_request_id(request_id: str) -> str:
    """An engine id for a request the caller named `request_id` (vLLM's
    `InputProcessor.assign_request_id`): it plus 8 random hex digits, so requests sharing the
    caller's id stay apart (two of them clash with odds 2**-32)."""
    return f"{request_id}-{uuid.uuid4().hex[:8]}"


class _Stream(Protocol):
    @property
    def request_id(self) -> str: ...  # the caller's (external) id


_S = TypeVar("_S", bound=_Stream)

# The front ends' stream maps: internal id -> a stream whose `request_id` is the caller's id.
# Plain dicts, which the per-output path reads (`get`, `del`): a dict subclass would lose the
# interpreter's fast paths there (measured 10-40 ns more an output). Not thread-safe: one owner
# thread, or the owner's lock.


def internal_ids(
    streams: Mapping[str, _S],
    request_ids: str | Iterable[str],
    where: Callable[[_S], bool] | None = None,
) -> list[str]:
    """Internal ids of the requests in `streams` added under any of the callers'
    `request_ids` (and that `where` accepts), in the order they were added; unknown or
    finished ids name none."""
    wanted = {request_ids} if isinstance(request_ids, str) else set(request_ids)
    return [
        rid for rid, s in streams.items() if s.request_id in wanted and (where is None or where(s))
    ]


def pop_each(streams: dict[str, _S], internal_ids: Iterable[str]) -> list[tuple[str, _S]]:
    """Remove the requests of these internal ids still in `streams`, each once; returns them
    (internal id, stream) in the order named. Unknown or finished ids are skipped."""
    taken = []
    for rid in internal_ids:
        stream = streams.pop(rid, None)
        if stream is not None:
            taken.append((rid, stream))
    return taken
