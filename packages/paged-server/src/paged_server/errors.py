"""OpenAI-style API errors: every failure the server reports is one `APIError`."""

from __future__ import annotations

import json
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
