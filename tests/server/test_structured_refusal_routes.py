"""An engine's refusal of a request's structured-output constraint on add (the ValueError
naming `structured_outputs` that the engine raises, e.g., for a grammar whose special tokens
its tokenizer lacks) is a 400 naming the field the client used, on every route built on the
chat path: chat completions (`response_format`), Anthropic's Messages API
(`output_config.format`, also for the older `output_format`; a forced `tool_choice` is the
`tools`' constraint) and the Responses API (`text.format`, streamed or in the background).
The refusal comes from a ScriptedEngine whose add_request raises it (the routes' constraints
are JSON schemas, which the real engine's tokenizer check never refuses)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fake_engine import ScriptedEngine
from server_proc import serve_in_process

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
TOOL = {"type": "object", "properties": {"city": {"type": "string"}}}
HI = [{"role": "user", "content": "Hi"}]
REFUSAL = "structured_outputs.json is invalid for this model's tokenizer: refused"


@pytest.fixture(scope="module")
def srv() -> Iterator[SimpleNamespace]:
    engine = ScriptedEngine(max_model_len=512, step_time=0.0005)
    args = ["--max-model-len", "512", "--served-model-name", "tiny"]
    with serve_in_process([*args, "--tool-call-parser", "hermes"], engine) as (http, app):
        yield SimpleNamespace(http=http, engine=engine, app=app)


@pytest.fixture
def refusing(srv: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """The engine refuses every constrained request on add, as the real one does."""
    add = srv.engine.add_request

    def add_request(request_id, prompt, params, *args, **kwargs) -> None:
        if params.structured_outputs is not None:
            raise ValueError(REFUSAL)
        add(request_id, prompt, params, *args, **kwargs)

    monkeypatch.setattr(srv.engine, "add_request", add_request)
    return srv


JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "o", "schema": SCHEMA}}
ANTHROPIC_FORMAT = {"type": "json_schema", "schema": SCHEMA}
ANTHROPIC_TOOL = {"name": "weather", "input_schema": TOOL}
RESPONSES_FORMAT = {"format": {"type": "json_schema", "name": "o", "schema": SCHEMA}}
RESPONSES_TOOL = {"type": "function", "name": "weather", "parameters": TOOL}
CHAT = {"model": "tiny", "messages": HI, "max_tokens": 5}
MESSAGES = {"model": "tiny", "messages": HI, "max_tokens": 5}
RESPONSES = {"model": "tiny", "input": "Hi", "max_output_tokens": 5}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {**CHAT, "response_format": JSON_SCHEMA}, "response_format"),
        (
            "/v1/chat/completions",
            {**CHAT, "stream": True, "response_format": JSON_SCHEMA},
            "response_format",
        ),
        ("/v1/messages", {**MESSAGES, "output_config": {"format": ANTHROPIC_FORMAT}}, None),
        ("/v1/messages", {**MESSAGES, "output_format": ANTHROPIC_FORMAT}, None),
        (
            "/v1/messages",
            {**MESSAGES, "stream": True, "output_config": {"format": ANTHROPIC_FORMAT}},
            None,
        ),
        (
            "/v1/messages",
            {**MESSAGES, "tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "any"}},
            None,
        ),
        ("/v1/responses", {**RESPONSES, "text": RESPONSES_FORMAT}, "text.format"),
        ("/v1/responses", {**RESPONSES, "stream": True, "text": RESPONSES_FORMAT}, "text.format"),
        (
            "/v1/responses",
            {**RESPONSES, "background": True, "text": RESPONSES_FORMAT},
            "text.format",
        ),
        (
            "/v1/responses",
            {**RESPONSES, "tools": [RESPONSES_TOOL], "tool_choice": "required"},
            "tools",
        ),
    ],
)
def test_a_refused_constraint_names_the_clients_field(
    refusing: SimpleNamespace, path: str, body: dict, param: str | None
) -> None:
    """OpenAI-shaped errors name it in `param` (and the message); Anthropic's have only the
    message, which names it ("tools" for a forced tool_choice)."""
    status, _, err = refusing.http.request("POST", path, body)
    assert status == 400, err
    if param is None:  # Anthropic's shape
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        want = "'tools'" if "tools" in body else "'output_config.format'"
        assert err["error"]["message"].startswith(want), err
        assert REFUSAL in err["error"]["message"], err
    else:
        assert err["error"]["param"] == param, err
        assert err["error"]["message"] == f"'{param}': {REFUSAL}", err
    # nothing is left running; an unconstrained request is still served
    assert not refusing.engine.has_unfinished_requests()
    plain = {k: v for k, v in body.items() if k in ("model", "messages", "input", "max_tokens")}
    status, _, ok = refusing.http.request("POST", path, plain)
    assert status == 200, ok
