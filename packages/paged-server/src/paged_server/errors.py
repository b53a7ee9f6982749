"""OpenAI-style API errors: every failure the server reports is one `APIError`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    411: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "internal_server_error",  # (the data-parallel front: a replica failed)
    501: "invalid_request_error",
    503: "service_unavailable_error",
}


@dataclass
class APIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | int | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.status}: {self.message}"

    def body(self) -> bytes:
        err = {
            "message": self.message,
            "type": _TYPES.get(self.status, "invalid_request_error"),
            "param": self.param,
            "code": self.code if self.code is not None else self.status,
        }
        return json.dumps({"error": err}).encode()


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def query_int(
    query: Mapping[str, list[str]], name: str, default: int | None, lo: int, hi: int, what: str
) -> int | None:
    """The last `name` of a parsed query string (`parse_qs`) as an int from `lo` to `hi`,
    `default` when it is absent; else a 400 naming it ("{name} must be {what}, got ...").
    ASCII digits only, at most 18 (str.isdigit takes '²', which int() refuses, and int()
    refuses thousands of digits)."""
    values = query.get(name)
    if not values:
        return default
    raw = values[-1]
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 18 and lo <= int(raw) <= hi):
        raise bad_request(f"{name} must be {what}, got {raw[:50]!r}", name)
    return int(raw)


@contextmanager
def renamed_params(renamed: Mapping[str, str], messages: str) -> Iterator[None]:
    """Errors of the chat path, in the terms of an API built on it: a parameter of `renamed`
    under its name there (in `param` and the message), one inside the chat messages as the
    field they came from (`messages`)."""
    try:
        yield
    except APIError as e:
        if e.param in renamed:
            old, new = e.param, renamed[e.param]
            e.param = new
            e.message = re.sub(rf"(?<![\w.]){re.escape(old)}(?!\w)", new, e.message)
        elif e.param is not None and e.param.startswith("messages"):
            e.param = messages
        raise
