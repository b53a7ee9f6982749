"""Hostile structured-output constraints over HTTP: each is a 400 naming the request field, at
once (the server checks the grammar on its HTTP thread, structured_request.check_structured),
and the server serves on. Costly ones llguidance does not bound (structured_output/
work_bounds.py): a counted repetition like `a{1000000}` (before: a 200 holding one character
of output, after 2-5 s of compiling) and a `const` of 20k keys (before: ~17 s of the HTTP
thread's check, then ~25 s compiling until llguidance panicked), also as a tool's parameters with a
forced tool_choice; an `anyOf` of 2100 objects (before: a 200 whose output stopped after
its `{`). The engine-side table: tests/engine/test_structured_hostile.py."""

from __future__ import annotations

import time

import pytest
from server_proc import ServerProc

pytest.importorskip("llguidance")

CHAT = [{"role": "user", "content": "Hi"}]
_COUNTED = {"type": "object", "properties": {"id": {"type": "string", "pattern": "^a{1000000}$"}}}
_CONST = {"const": {f"k{i}": list(range(10)) for i in range(20_000)}}
_OBJECTS = [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}} for i in range(2100)]


def _schema(schema: object) -> dict:
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return {"response_format": rf}


def _tool(parameters: dict, choice: object) -> dict:
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    return {"tools": [tool], "tool_choice": choice}


_NAMED = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(
    ("extra", "param", "fragment"),
    [
        ({"guided_regex": "a{1000000}"}, "guided_regex", "repeats"),
        ({"structured_outputs": {"regex": "((a{10}){1000}){1000}"}}, "structured_outputs", "rep"),
        (_schema(_COUNTED), "response_format", "repeats"),
        (_schema(_CONST), "response_format", "const / enum values"),
        (_tool(_COUNTED, "required"), "tools", "repeats"),
        (_tool(_CONST, _NAMED), "tools", "const / enum values"),
        (_tool({"anyOf": _OBJECTS}, _NAMED), "tools", "2100 object alternatives"),
        ({"structured_outputs": {"grammar": 'start: "a"{1000000}'}}, "structured_outputs", "rep"),
        # failing fast before this audit too
        (_schema({"$ref": "http://127.0.0.1:9/s.json"}), "response_format", "does not fetch"),
        (_schema({"not": {"type": "string"}}), "response_format", "Unimplemented keys"),
        (_schema({"$ref": "#"}), "response_format", "$ref cycle"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_regex": "(?=a)a"}, "guided_regex", "look-around"),
    ],
    ids=["regex", "nested-counts", "pattern", "const", "tool-required", "tool-named",
         "tool-alternatives", "lark-repeat", "remote-ref", "not", "self-ref", "empty-choice",
         "lookahead"],
)  # fmt: skip
def test_hostile_constraints_are_a_400_at_once(
    fake_server: ServerProc, extra: dict, param: str, fragment: str
) -> None:
    t0 = time.monotonic()
    body = {"messages": CHAT, "max_tokens": 2, **extra}
    status, _, payload = fake_server.request("POST", "/v1/chat/completions", body)
    took = time.monotonic() - t0
    assert status == 400, payload
    error = payload["error"]
    assert error["param"] == param and fragment in error["message"], error
    assert took < 10.0, took  # wall time, loose for a loaded machine (before: 2-40 s of CPU)
    ok = fake_server.request("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})
    assert ok[0] == 200
