"""vLLM's profiling routes: `POST /start_profile` and `POST /stop_profile`.

They exist only when the server starts with PAGED_TORCH_PROFILER_DIR (or vLLM's
VLLM_TORCH_PROFILER_DIR) set, as in vLLM; without it they are unknown routes (404). Each runs
the engine's `start_profile` / `stop_profile` on the engine thread (engine_client.py): every
rank records torch.profiler events until the stop, which writes one gzipped Chrome trace per
rank into that directory and answers `{"traces": [paths]}`. Starting twice, or stopping what
is not running, is a 409. A development tool: nothing guards it but the variable.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from paged_server.errors import APIError

if TYPE_CHECKING:
    from paged_server.engine_client import EngineClient
    from paged_server.http import Handler

START, STOP = "/start_profile", "/stop_profile"
# The engine's variables (paged_engine/worker/profiler.py), read here without importing the
# engine: the server's modules never import torch.
DIR_ENV = ("PAGED_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_DIR")
# Writing a trace of a long run takes a while (vLLM's docs warn of minutes on big models).
STOP_TIMEOUT = 1800.0


def profile_routes(client: EngineClient) -> dict[str, dict[str, Callable[[Handler], None]]]:
    """The two routes, or none when profiling is off."""
    if not any(os.environ.get(name) for name in DIR_ENV):
        return {}

    def start(h: Handler) -> None:
        _engine_call(client.start_profile)
        h.send_json(200, {"status": "profiling"})

    def stop(h: Handler) -> None:
        traces = _engine_call(lambda: client.stop_profile(STOP_TIMEOUT))
        h.send_json(200, {"traces": traces})

    return {START: {"POST": start}, STOP: {"POST": stop}}


def _engine_call(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except RuntimeError as e:  # already running / not running (the engine goes on)
        raise APIError(409, str(e)) from None
