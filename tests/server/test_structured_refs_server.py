"""Over HTTP: a JSON schema whose `$ref`s loop without reaching a value is a 400 naming the
field the client used; a grammar check that finds no thread to run on (`can't start new
thread`) is a 503 asking the client to retry, and the server serves on (the same request then
passes). A ScriptedEngine behind the real app: both answers come from the HTTP thread's check."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fake_engine import ScriptedEngine
from server_proc import serve_in_process

from paged_engine.structured_output import grammar

pytest.importorskip("llguidance")

LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
HI = [{"role": "user", "content": "Hi"}]
CHAT = {"model": "tiny", "messages": HI, "max_tokens": 5}
COMPLETION = {"model": "tiny", "prompt": "Hi", "max_tokens": 5}


@pytest.fixture(scope="module")
def srv() -> Iterator[SimpleNamespace]:
    engine = ScriptedEngine(max_model_len=512, step_time=0.0005)
    args = ["--max-model-len", "512", "--served-model-name", "tiny"]
    with serve_in_process(args, engine) as (http, _):
        yield SimpleNamespace(http=http, engine=engine)


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}


RF = {"response_format": _json_schema(LOOP)}
SO = {"structured_outputs": {"json": LOOP}}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {**CHAT, **RF}, "response_format"),
        ("/v1/completions", {**COMPLETION, "guided_json": LOOP}, "guided_json"),
        ("/v1/completions", {**COMPLETION, **SO}, "structured_outputs"),
    ],
)
def test_a_ref_loop_is_a_400_naming_the_field(srv, path, body, param) -> None:
    status, _, r = srv.http.request("POST", path, body)
    assert status == 400, r
    err = r["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    want = f"'{param}': structured_outputs.json is invalid: unresolvable $ref cycle "
    assert err["message"].startswith(want + "#/$defs/a -> #/$defs/b -> #/$defs/a"), err
    assert not srv.engine.has_unfinished_requests()
    status, _, r = srv.http.request("POST", "/v1/chat/completions", CHAT)
    assert status == 200, r


def test_no_thread_for_the_grammar_check_is_a_503_and_the_server_serves_on(srv, monkeypatch):
    def cannot_start(fn, args):
        raise RuntimeError("can't start new thread")

    schema = {"type": "object", "properties": {"retry": {"type": "integer"}}}
    body = {**CHAT, "response_format": _json_schema(schema)}
    monkeypatch.setattr(grammar, "_thread", SimpleNamespace(start_new_thread=cannot_start))
    status, headers, r = srv.http.request("POST", "/v1/chat/completions", body)
    assert status == 503, r
    assert r["error"]["type"] == "service_unavailable_error", r
    message = r["error"]["message"]
    assert "can't start new thread" in message and "try again" in message, message
    assert {k.lower(): v for k, v in headers.items()}.get("retry-after") == "1", headers
    assert not srv.engine.has_unfinished_requests()
    monkeypatch.undo()  # threads start again: the same request passes (nothing was cached)
    status, _, r = srv.http.request("POST", "/v1/chat/completions", body)
    assert status == 200, r


def test_no_thread_when_the_engine_adds_it_is_a_503_too(srv, monkeypatch):
    """The engine thread's own grammar work (the tokenizer check, the compile pool's first
    thread) can find no thread either: GrammarBusyError there is the same 503, not a 500."""
    add = srv.engine.add_request

    def busy_once(*args, **kwargs):
        monkeypatch.setattr(srv.engine, "add_request", add)
        raise grammar.GrammarBusyError("no thread could start to check the grammar")

    monkeypatch.setattr(srv.engine, "add_request", busy_once)
    status, headers, r = srv.http.request("POST", "/v1/chat/completions", CHAT)
    assert status == 503 and r["error"]["type"] == "service_unavailable_error", r
    assert {k.lower(): v for k, v in headers.items()}.get("retry-after") == "1", headers
    status, _, r = srv.http.request("POST", "/v1/chat/completions", CHAT)
    assert status == 200, r


@pytest.mark.parametrize(
    ("body", "param", "rule"),
    [
        ({**CHAT, "guided_grammar": 'start: "a" x | "b"\nx: "c" x'}, "guided_grammar", "x"),
        (
            {**COMPLETION, "structured_outputs": {"grammar": 'root ::= "a" r\nr ::= "b" r'}},
            "structured_outputs",
            "root",
        ),
    ],
)
def test_a_grammar_rule_that_cannot_end_is_a_400_naming_it(srv, body, param, rule) -> None:
    """Before grammar_rules.py: a 200 whose text stopped mid-grammar ("ac", finish "stop")."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, _, r = srv.http.request("POST", path, body)
    assert status == 400, r
    err = r["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    want = f"'{param}': structured_outputs.grammar is invalid: rule '{rule}' can never end"
    assert err["message"].startswith(want), err
    assert not srv.engine.has_unfinished_requests()
    status, _, r = srv.http.request("POST", "/v1/chat/completions", CHAT)
    assert status == 200, r
