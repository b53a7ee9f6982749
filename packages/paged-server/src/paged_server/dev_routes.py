"""vLLM's development routes: what RL loops call to drive a server between rollouts.

They exist only when the server starts with PAGED_SERVER_DEV_MODE=1 (or vLLM's
VLLM_SERVER_DEV_MODE=1), as in vLLM; without it they are unknown routes (404). `--api-key`
guards them as it guards /v1. Each runs on the engine thread (engine_client.py) between steps;
the engine side is paged_engine/engine/sleep_mode.py.

    POST /sleep?level=1&mode=abort       sleep mode (needs --enable-sleep-mode for levels 1, 2
         /sleep?tags=weights&tags=kv_cache   and tags); level 0 pauses only
    POST /wake_up[?tags=weights]         take memory back; all awake: scheduling resumes
    GET  /is_sleeping                    {"is_sleeping": bool}: memory asleep or paused
    POST /pause?mode=abort&clear_cache=true   stop scheduling ("abort", "wait", "keep")
    POST /resume                         schedule again
    GET  /is_paused                      {"is_paused": bool}
    POST /reset_prefix_cache[?reset_running_requests=true&reset_external=true]
                                         reset_external: the KV connector's stored blocks too
                                         ({"reset": false} without a connector)
    POST /collective_rpc {"method": "reload_weights", "args": [], "kwargs": {}, "timeout": s}
                                         {"results": [one per rank]}

mode "abort" ends the requests in flight with finish_reason "abort" (their tokens so far are
the answer; an embedding in flight gets a 503); "wait" answers once they have finished,
holding new requests back meanwhile (their streams go on); "keep" freezes them until the
wake-up. Requests that arrive while the engine sleeps wait in the queue.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from paged_server.errors import APIError, bad_request

if TYPE_CHECKING:
    from paged_server.engine_client import EngineClient
    from paged_server.http import Handler

DEV_ENV = ("PAGED_SERVER_DEV_MODE", "VLLM_SERVER_DEV_MODE")
ROUTES = frozenset(
    {
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        "/pause",
        "/resume",
        "/is_paused",
        "/reset_prefix_cache",
        "/collective_rpc",
    }
)
# Offloading a large model's weights to host memory (and back) takes a while.
_TIMEOUT = 1800.0
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def dev_mode() -> bool:
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in DEV_ENV)


def dev_routes(client: EngineClient) -> dict[str, dict[str, Callable[[Handler], None]]]:
    """The routes, or none without the dev-mode variable."""
    if not dev_mode():
        return {}
    engine = client.engine

    def sleep(h: Handler) -> None:
        q = _query(h)
        level = _int(q, "level", 1)
        tags = _tags(q)
        mode = _mode(q)
        from paged_engine.engine.sleep_mode import check_sleep_args  # torch is imported by now

        check_sleep_args(level, tags, mode)  # before a "wait" holds requests back for it
        client.call(lambda: engine.sleep(level, tags, mode), _TIMEOUT, when_idle=mode == "wait")
        h.send_json(200, {"is_sleeping": True})

    def wake_up(h: Handler) -> None:
        tags = _tags(_query(h))
        client.call(lambda: engine.wake_up(tags), _TIMEOUT)
        h.send_json(200, {"is_sleeping": client.call(engine.is_sleeping, 60.0)})

    def pause(h: Handler) -> None:
        q = _query(h)
        mode = _mode(q)
        clear = _bool(q, "clear_cache", True)
        if _bool(q, "wait_for_inflight_requests", False):  # vLLM's older spelling of "wait"
            mode = "wait"
        client.call(
            lambda: engine.pause_generation(mode, clear), _TIMEOUT, when_idle=mode == "wait"
        )
        h.send_json(200, {"status": "paused"})

    def resume(h: Handler) -> None:
        client.call(engine.resume_generation, 60.0)
        h.send_json(200, {"status": "resumed"})

    def reset_prefix_cache(h: Handler) -> None:
        q = _query(h)
        running = _bool(q, "reset_running_requests", False)
        external = _bool(q, "reset_external", False)  # vLLM's: the KV connector's cache too
        done = client.call(lambda: engine.reset_prefix_cache(running, external), 60.0)
        h.send_json(200, {"reset": done})

    def collective_rpc(h: Handler) -> None:
        method, args, kwargs, timeout = _rpc_body(h.read_json())
        results = client.call(lambda: engine.collective_rpc(method, None, args, kwargs), timeout)
        h.send_json(200, {"results": [_jsonable(r) for r in results]})

    def state(name: str, fn: Callable[[], bool]) -> Callable[[Handler], None]:
        return lambda h: h.send_json(200, {name: client.call(fn, 60.0)})

    return {
        "/sleep": {"POST": _engine_errors(sleep)},
        "/wake_up": {"POST": _engine_errors(wake_up)},
        "/is_sleeping": {"GET": state("is_sleeping", engine.is_sleeping)},
        "/pause": {"POST": _engine_errors(pause)},
        "/resume": {"POST": _engine_errors(resume)},
        "/is_paused": {"GET": state("is_paused", engine.is_paused)},
        "/reset_prefix_cache": {"POST": reset_prefix_cache},
        "/collective_rpc": {"POST": _engine_errors(collective_rpc)},
    }


def _engine_errors(route: Callable[[Handler], None]) -> Callable[[Handler], None]:
    """The engine's ValueError (a bad argument) is a 400; RuntimeError (resume while asleep,
    a failed rpc) a 409 / 500 naming it."""

    def run(h: Handler) -> None:
        try:
            route(h)
        except ValueError as e:
            message = str(e)
            first = message.split(maxsplit=1)[0].rstrip(":") if message else ""
            raise bad_request(message, first if first in _PARAMS else None) from None
        except RuntimeError as e:
            # the engine's "resume while asleep" is a conflict; a failed rpc or a lost rank not
            if type(e).__name__ in ("RpcError", "EngineDeadError"):
                raise APIError(500, str(e)) from None
            raise APIError(409, str(e)) from None

    return run


_PARAMS = frozenset({"level", "tags", "mode", "enable_sleep_mode", "method"})


def _query(h: Handler) -> dict[str, list[str]]:
    return parse_qs(urlsplit(h.path).query, keep_blank_values=True)


def _one(q: dict[str, list[str]], name: str) -> str | None:
    values = q.get(name)
    if not values:
        return None
    if len(values) > 1:
        raise bad_request(f"query parameter '{name}' is given {len(values)} times", name)
    return values[0]


def _int(q: dict[str, list[str]], name: str, default: int) -> int:
    value = _one(q, name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise bad_request(f"'{name}' must be an integer, got {value!r}", name) from None


def _bool(q: dict[str, list[str]], name: str, default: bool) -> bool:
    value = _one(q, name)
    if value is None:
        return default
    if value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() in _FALSE:
        return False
    raise bad_request(f"'{name}' must be true or false, got {value!r}", name)


def _mode(q: dict[str, list[str]]) -> str:
    """The engine checks the value (a 400 naming `mode` through `_engine_errors`)."""
    return _one(q, "mode") or "abort"


def _tags(q: dict[str, list[str]]) -> list[str] | None:
    """`?tags=a&tags=b` (vLLM's) or `?tags=a,b`; None when absent. The engine checks them."""
    if "tags" not in q:
        return None
    return [t.strip() for value in q["tags"] for t in value.split(",") if t.strip()]


def _rpc_body(body: Any) -> tuple[str, tuple, dict[str, Any], float]:
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object with 'method'")
    unknown = sorted(set(body) - {"method", "args", "kwargs", "timeout"})
    if unknown:
        raise bad_request(f"unknown field '{unknown[0]}'", unknown[0])
    method = body.get("method")
    if not isinstance(method, str) or not method or method.startswith("_"):
        raise bad_request("'method' must name a public Worker method", "method")
    from paged_engine.worker.worker import Worker  # the engine is loaded: torch is imported

    if not callable(getattr(Worker, method, None)):
        raise bad_request(f"the Worker has no method {method!r}", "method")
    args = [] if body.get("args") is None else body["args"]
    kwargs = {} if body.get("kwargs") is None else body["kwargs"]
    if not isinstance(args, list):
        raise bad_request("'args' must be a list", "args")
    if not isinstance(kwargs, dict):
        raise bad_request("'kwargs' must be an object", "kwargs")
    timeout = body.get("timeout")
    if timeout is None:
        timeout = _TIMEOUT
    elif (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not (0 < timeout < math.inf)
    ):
        raise bad_request("'timeout' must be a positive number of seconds", "timeout")
    return method, tuple(args), kwargs, float(timeout)


def _jsonable(value: Any) -> Any:
    """A result as JSON has it, else its repr (a device, a tensor)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return repr(value)
    return value
