"""Review of the session's commits (64b9b89..85f328a), server side.

8b1feee made `parallel_tool_calls: false` keep only the first parsed call, and Anthropic's
`tool_choice.disable_parallel_tool_use` reaches the same flag; a non-boolean there (the string
"false") was read by its truth value and silently dropped every call after the first. It is
refused by name, as the chat route refuses a non-boolean `parallel_tool_calls`.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fake_engine import ScriptedEngine
from server_proc import serve_in_process

ARGS = ["--max-model-len", "512", "--served-model-name", "tiny", "--tool-call-parser", "hermes"]
WEATHER = {
    "name": "get_weather",
    "description": "the weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
TWO_CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def srv() -> Iterator[SimpleNamespace]:
    engine = ScriptedEngine(max_model_len=512, step_time=0.0005)
    with serve_in_process(ARGS, engine) as (http, app):
        yield SimpleNamespace(http=http, engine=engine, app=app)


def _messages(srv: SimpleNamespace, choice: dict) -> tuple[int, dict]:
    srv.engine.script = TWO_CALLS
    body = {
        "model": "tiny",
        "max_tokens": 400,
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [WEATHER],
        "tool_choice": choice,
    }
    status, _, payload = srv.http.request("POST", "/v1/messages", body)
    return status, payload


def _cities(payload: dict) -> list[str]:
    return [b["input"]["city"] for b in payload["content"] if b["type"] == "tool_use"]


def test_disable_parallel_tool_use_must_be_a_boolean(srv: SimpleNamespace) -> None:
    status, payload = _messages(srv, {"type": "auto"})
    assert status == 200 and _cities(payload) == ["Oslo", "Rome"], payload
    status, payload = _messages(srv, {"type": "auto", "disable_parallel_tool_use": False})
    assert status == 200 and _cities(payload) == ["Oslo", "Rome"], payload
    status, payload = _messages(srv, {"type": "auto", "disable_parallel_tool_use": True})
    assert status == 200 and _cities(payload) == ["Oslo"], payload
    for bad in ("false", 0, "yes"):
        status, payload = _messages(srv, {"type": "auto", "disable_parallel_tool_use": bad})
        assert status == 400, payload
        assert "disable_parallel_tool_use" in payload["error"]["message"], payload


def test_chat_parallel_tool_calls_null_is_the_default(srv: SimpleNamespace) -> None:
    """vLLM types chat's parallel_tool_calls `bool | None`: null means the default (every
    call), as the Responses route already read it; a non-boolean is still a 400."""
    srv.engine.script = TWO_CALLS
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [tool],
        "parallel_tool_calls": None,
    }
    status, _, payload = srv.http.request("POST", "/v1/chat/completions", body)
    assert status == 200, payload
    assert len(payload["choices"][0]["message"]["tool_calls"]) == 2, payload
    status, _, payload = srv.http.request(
        "POST", "/v1/chat/completions", {**body, "parallel_tool_calls": "no"}
    )
    assert status == 400 and payload["error"]["param"] == "parallel_tool_calls", payload
