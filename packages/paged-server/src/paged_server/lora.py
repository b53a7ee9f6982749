"""LoRA adapters served beside the base model, under vLLM's names and rules.

    --enable-lora --lora-modules sql=/adapters/sql '{"name": "chat", "path": "/a/chat"}'

A request whose `model` is an adapter name runs with that adapter's `LoRARequest`. Adapters get
`lora_int_id` 1, 2, ... in the order they are loaded (startup modules first, then runtime
loads); an id is never reused, so an unloaded adapter's id can never name a new one. A name is
unique among the adapters and the served model names. With PAGED_ALLOW_RUNTIME_LORA_UPDATING (or
vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING) true, `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` change the set while serving.

The registry is the HTTP side's; the engine learns of an adapter only through `add_lora` /
`remove_lora` on its own thread (engine_client.py) and the `lora_request` of each request.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paged_server.errors import APIError, bad_request

if TYPE_CHECKING:
    from paged_server.app import OpenAIApp
    from paged_server.http import Handler

_RUNTIME_ENV = ("PAGED_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")
_MODULE_KEYS = frozenset({"name", "path", "base_model_name"})


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One `--lora-modules` entry."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """argparse type for `--lora-modules`: `name=path`, or the JSON object
    `{"name": ..., "path": ..., "base_model_name": ...}` (base_model_name optional)."""
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            value = json.loads(stripped)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError("expected a JSON object")
        unknown = sorted(set(value) - _MODULE_KEYS)
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown key {unknown[0]!r} (expected name, path, base_model_name)"
            )
        for key in ("name", "path"):
            if not isinstance(value.get(key), str) or not value[key]:
                raise argparse.ArgumentTypeError(f"{key!r} must be a non-empty string: {text}")
        base = value.get("base_model_name")
        if base is not None and (not isinstance(base, str) or not base):
            raise argparse.ArgumentTypeError("'base_model_name' must be a non-empty string")
        return LoRAModule(value["name"], value["path"], base)
    name, sep, path = stripped.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(
            f"expected name=path or a JSON object with name and path, got {text!r}"
        )
    return LoRAModule(name, path)


def runtime_updates_allowed(environ: Any = None) -> bool:
    """The load / unload routes exist only when one of the two variables is true."""
    env = os.environ if environ is None else environ
    return any(env.get(k, "").strip().lower() in ("1", "true") for k in _RUNTIME_ENV)


def _lora_request_class() -> type:
    # The engine's class, imported when the first adapter is registered (the server binds its
    # port before importing anything of the engine's beyond what it needs).
    from paged_engine.lora.request import LoRARequest

    return LoRARequest


class LoRARegistry:
    """Adapter name -> its `LoRARequest`, in load order. HTTP threads read it; loads and unloads
    run one at a time under `update_lock`, which covers the engine call too, so a name is never
    half-registered and ids follow the order of successful loads."""

    def __init__(self, served_model_names: list[str], *, enabled: bool) -> None:
        self.enabled = enabled  # --enable-lora
        self.served = list(served_model_names)
        self.update_lock = threading.Lock()
        self._adapters: dict[str, Any] = {}  # name -> LoRARequest; dict order = load order
        self._next_id = 1

    def get(self, name: str) -> Any | None:
        return self._adapters.get(name)

    def adapters(self) -> list[Any]:
        return list(self._adapters.values())

    def find_id(self, lora_int_id: int) -> Any | None:
        return next((a for a in self.adapters() if a.lora_int_id == lora_int_id), None)

    def name_error(self, name: str) -> str | None:
        """Why `name` cannot name a new adapter, or None."""
        if name in self.served:
            return f"'{name}' is a served model name"
        if name in self._adapters:
            return f"an adapter named '{name}' is already loaded"
        return None

    def new_request(self, name: str, path: str, base_model_name: str | None = None) -> Any:
        """The LoRARequest the next adapter gets (registered by `register` once the engine
        took it)."""
        return _lora_request_class()(
            lora_name=name,
            lora_int_id=self._next_id,
            lora_path=path,
            base_model_name=base_model_name,
        )

    def register(self, request: Any) -> None:
        why = self.name_error(request.lora_name)
        if why is not None:
            raise ValueError(why)
        if request.lora_int_id != self._next_id:
            raise ValueError(f"lora_int_id {request.lora_int_id} is not the next id")
        self._adapters[request.lora_name] = request
        self._next_id += 1

    def unregister(self, name: str) -> Any:
        return self._adapters.pop(name)

    def parent(self, request: Any) -> str:
        """The model an adapter card names as its parent: its base_model_name, else the
        first served name."""
        return request.base_model_name or self.served[0]


def lora_names_error(modules: list[LoRAModule], served: list[str]) -> str | None:
    """Why these adapter names cannot be served beside `served`, or None."""
    seen: set[str] = set()
    for m in modules:
        if m.name in served:
            return f"adapter name '{m.name}' is a served model name"
        if m.name in seen:
            return f"adapter name '{m.name}' is given twice"
        seen.add(m.name)
    return None


def load_lora_modules(
    engine: Any, modules: list[LoRAModule], served: list[str], *, enabled: bool
) -> LoRARegistry:
    """The registry with `modules` (--lora-modules) loaded into the engine, ids 1, 2, ... in
    flag order. Runs before the engine loop starts, on the thread that owns the engine; a
    ValueError naming the module when the engine refuses its adapter."""
    why = lora_names_error(modules, served)
    if why is not None:
        raise ValueError(f"--lora-modules: {why}")
    registry = LoRARegistry(served, enabled=enabled)
    for m in modules:
        request = registry.new_request(m.name, m.path, m.base_model_name)
        try:
            loaded = engine.add_lora(request)
        except ValueError as e:
            raise ValueError(f"--lora-modules: adapter '{m.name}' ({m.path}): {e}") from None
        if loaded is False:
            raise ValueError(f"--lora-modules: the engine did not load adapter '{m.name}'")
        registry.register(request)
    return registry


# ---- runtime updates: POST /v1/load_lora_adapter, /v1/unload_lora_adapter ------------------
def serve_load_adapter(app: OpenAIApp, h: Handler) -> None:
    """{"lora_name", "lora_path"} -> 200 (plain text) once the engine loaded the adapter."""
    body = _object(h.read_json(), {"lora_name", "lora_path"})
    name, path = _text(body, "lora_name"), _text(body, "lora_path")
    registry = app.lora
    if not registry.enabled:
        raise bad_request("LoRA is off: start the server with --enable-lora", "lora_name")
    with registry.update_lock:
        why = registry.name_error(name)
        if why is not None:
            raise bad_request(f"cannot load adapter '{name}': {why}", "lora_name")
        request = registry.new_request(name, path)
        try:
            loaded = app.client.add_lora(request)
        except ValueError as e:
            raise bad_request(f"cannot load adapter '{name}': {e}", "lora_path") from None
        if loaded is False:
            raise bad_request(f"the engine did not load adapter '{name}'", "lora_path")
        registry.register(request)
    h.log_extra = f" lora_name={name} lora_int_id={request.lora_int_id}"
    msg = f"Success: LoRA adapter '{name}' loaded (lora_int_id {request.lora_int_id})."
    h.send_bytes(200, msg.encode(), "text/plain; charset=utf-8")


def serve_unload_adapter(app: OpenAIApp, h: Handler) -> None:
    """{"lora_name"} or {"lora_int_id"} (vLLM sends both: they must agree) -> 200; 404 for an
    adapter not served. Requests for the name are 404s from here on; those running with it
    finish with it (engine_client.remove_lora)."""
    body = _object(h.read_json(), {"lora_name", "lora_int_id"})
    lora_id = body.get("lora_int_id")
    if lora_id is not None and (isinstance(lora_id, bool) or not isinstance(lora_id, int)):
        raise bad_request("'lora_int_id' must be an integer", "lora_int_id")
    by_id = "lora_name" not in body and lora_id is not None
    name = None if by_id else _text(body, "lora_name")
    registry = app.lora
    with registry.update_lock:
        lora = registry.find_id(lora_id) if by_id else registry.get(name)
        if lora is None:
            param = "lora_int_id" if by_id else "lora_name"
            what = lora_id if by_id else repr(name)
            raise APIError(404, f"no LoRA adapter with {param} {what}", param, "not_found")
        if lora_id is not None and lora.lora_int_id != lora_id:
            raise bad_request(
                f"adapter '{lora.lora_name}' has lora_int_id {lora.lora_int_id}, not {lora_id}",
                "lora_int_id",
            )
        registry.unregister(lora.lora_name)
        app.client.remove_lora(lora.lora_int_id)
    h.log_extra = f" lora_name={lora.lora_name} lora_int_id={lora.lora_int_id}"
    msg = f"Success: LoRA adapter '{lora.lora_name}' unloaded."
    h.send_bytes(200, msg.encode(), "text/plain; charset=utf-8")


def _object(body: Any, fields: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise bad_request(f"parameter '{unknown[0]}' is not supported here", unknown[0])
    return body


def _text(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{key}' (a non-empty string) is required", key)
    return value
