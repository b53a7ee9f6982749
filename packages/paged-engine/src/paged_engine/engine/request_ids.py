"""Engine ids of requests whose callers' ids may repeat (standard library only: the server
imports it without torch)."""

from __future__ import annotations

import uuid


def internal_request_id(request_id: str) -> str:
    """An engine id for a request the caller named `request_id` (vLLM's
    `InputProcessor.assign_request_id`): it plus 8 random hex digits, so requests sharing the
    caller's id stay apart (two of them clash with odds 2**-32)."""
    return f"{request_id}-{uuid.uuid4().hex[:8]}"
