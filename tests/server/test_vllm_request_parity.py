"""Request handling checked against vLLM's OpenAI server, one behaviour per test:

- a named tool_choice forces the tool's `parameters` as sent (vLLM's get_json_schema_from_tools
  returns `function.parameters`): `{}` is any JSON value, an absent (or null) one no constraint
  at all, so a response_format schema still applies; "required" still maps a falsy one to an
  empty object (_get_tool_schema_from_name_and_params);
- a json_schema response_format without a schema is a 400 (vLLM: StructuredOutputsParams(json=
  None) refuses "none specified"), unless a forced call's schema replaces the format;
- /v1/messages answers the chat completion's id, "chatcmpl-" + X-Request-Id (vLLM's
  AnthropicServingMessages passes the ChatCompletionResponse id on), whole and streamed;
- /v1/audio/transcriptions and /translations name their stream chunks "<task>-" + X-Request-Id;
- ChatCompletionRequest / CompletionRequest validators: `stream_options: {}` without a stream,
  `top_logprobs: 0` without logprobs and `prompt_logprobs: 0` with a stream are served; an empty
  `logprob_token_ids` and a `cache_salt` over 128 characters or with '@', '/', '\\' or NUL are
  400s naming the field.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fake_engine import ScriptedEngine
from server_proc import COMMON_ARGS, HEADERS, ServerProc, serve_in_process

from paged_server.errors import APIError
from paged_server.openai_protocol import parse_chat, parse_completion
from paged_server.tools import parse_tools

CHAT = [{"role": "user", "content": "Hi"}]


def _tool(name: str = "f", **fn: object) -> dict:
    return {"type": "function", "function": {"name": name, **fn}}


def _named(name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name}}


def _refused(parse, body: dict) -> APIError:
    with pytest.raises(APIError) as e:
        parse(body)
    assert e.value.status == 400, e.value.message
    return e.value


# ---- tool_choice: a named function's parameters -------------------------------------------
@pytest.mark.parametrize(
    ("fn", "forced"),
    [
        ({"parameters": {}}, {"json": {}}),  # before: {"type": "object", "properties": {}}
        ({}, None),  # before: an empty object
        ({"parameters": None}, None),  # before: a 400 (vLLM's type: dict | None)
        ({"parameters": {"type": "string"}}, {"json": {"type": "string"}}),
    ],
    ids=["empty", "absent", "null", "schema"],
)
def test_a_named_tool_is_forced_to_its_parameters_as_sent(fn: dict, forced: dict | None) -> None:
    req = parse_tools({"tools": [_tool(**fn)], "tool_choice": _named()}, None)
    assert req is not None and req.constraint() == forced


@pytest.mark.parametrize("fn", [{"parameters": {}}, {}, {"parameters": None}])
def test_required_still_maps_a_falsy_parameters_to_an_object(fn: dict) -> None:
    req = parse_tools({"tools": [_tool(**fn)], "tool_choice": "required"}, None)
    assert req is not None
    (one,) = req.constraint()["json"]["items"]["anyOf"]
    assert one["properties"]["parameters"] == {"type": "object", "properties": {}}


def test_a_named_tool_without_parameters_leaves_the_response_format() -> None:
    """No tool schema replaces the format (vLLM's adjust_request only sets one it has)."""
    rf_schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": rf_schema}}
    body = {"messages": CHAT, "tools": [_tool()], "tool_choice": _named(), "response_format": rf}
    req = parse_chat(body)
    assert (req.structured, req.structured_param) == ({"json": rf_schema}, "response_format")
    body["tools"] = [_tool(parameters={})]
    req = parse_chat(body)
    assert (req.structured, req.structured_param) == ({"json": {}}, "tools")


def test_named_tools_without_parameters_over_http(real_server: ServerProc) -> None:
    """Served whole: the forced `{}` gives a JSON value; an absent schema, the model's text."""
    for tool in (_tool(parameters={}), _tool()):
        body = {"messages": CHAT, "max_tokens": 5, "temperature": 0, "tools": [tool],
                "tool_choice": _named()}  # fmt: skip
        status, _, payload = real_server.request("POST", "/v1/chat/completions", body)
        assert status == 200, payload
        (call,) = payload["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "f"


# ---- response_format json_schema without a schema ------------------------------------------
@pytest.mark.parametrize("parse", [parse_chat, parse_completion], ids=["chat", "completion"])
@pytest.mark.parametrize("js", [{"name": "x"}, {"name": "x", "schema": None}], ids=["no", "null"])
def test_a_json_schema_format_without_a_schema_is_a_400(parse, js: dict) -> None:
    body: dict = {"messages": CHAT} if parse is parse_chat else {"prompt": "a"}
    body["response_format"] = {"type": "json_schema", "json_schema": js}
    e = _refused(parse, body)
    assert e.param == "response_format" and "schema' is required" in e.message, e.message


def test_a_forced_call_replaces_a_schemaless_format() -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "x"}}
    tools = [_tool(parameters={"type": "object"})]
    req = parse_chat({"messages": CHAT, "tools": tools, "tool_choice": "required",
                      "response_format": rf})  # fmt: skip
    assert req.structured_param == "tools" and req.structured["json"]["type"] == "array"
    req = parse_chat({"messages": CHAT, "tools": tools, "tool_choice": _named(),
                      "response_format": rf})  # fmt: skip
    assert (req.structured, req.structured_param) == ({"json": {"type": "object"}}, "tools")
    _refused(
        parse_chat,
        {"messages": CHAT, "tools": [_tool()], "tool_choice": _named(), "response_format": rf},
    )  # fmt: skip (no tool schema: the format stays)


# ---- the request validators --------------------------------------------------------------
@pytest.mark.parametrize("parse", [parse_chat, parse_completion], ids=["chat", "completion"])
def test_empty_stream_options_without_a_stream_are_served(parse) -> None:
    body = {"messages": CHAT} if parse is parse_chat else {"prompt": "a"}
    req = parse({**body, "stream_options": {}})  # before: a 400
    assert not req.stream and not req.include_usage
    e = _refused(parse, {**body, "stream_options": {"include_usage": True}})
    assert e.param == "stream_options"


def test_top_logprobs_zero_without_logprobs_is_served() -> None:
    assert parse_chat({"messages": CHAT, "top_logprobs": 0}).logprobs is None  # before: a 400
    assert parse_chat({"messages": CHAT, "top_logprobs": 0, "logprobs": True}).logprobs == 0
    e = _refused(parse_chat, {"messages": CHAT, "top_logprobs": 1})
    assert e.param == "top_logprobs"


@pytest.mark.parametrize("parse", [parse_chat, parse_completion], ids=["chat", "completion"])
def test_prompt_logprobs_zero_streams(parse) -> None:
    body = {"messages": CHAT} if parse is parse_chat else {"prompt": "a"}
    req = parse({**body, "stream": True, "prompt_logprobs": 0})  # before: a 400
    assert req.stream and req.prompt_logprobs == 0
    for n in (1, -1):
        e = _refused(parse, {**body, "stream": True, "prompt_logprobs": n})
        assert e.param == "prompt_logprobs"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_logprobs_zero_streams_over_http(real_server: ServerProc, path: str) -> None:
    body = {"prompt": "a"} if path == "/v1/completions" else {"messages": CHAT}
    data = json.dumps({**body, "max_tokens": 3, "stream": True, "prompt_logprobs": 0})
    chunks = _sse(real_server, path, data.encode(), HEADERS)  # before: a 400
    assert chunks and chunks[-1]["choices"][0]["finish_reason"] is not None


@pytest.mark.parametrize("parse", [parse_chat, parse_completion], ids=["chat", "completion"])
def test_an_empty_logprob_token_ids_is_a_400(parse) -> None:
    chat = {"messages": CHAT, "logprobs": True}
    body = chat if parse is parse_chat else {"prompt": "a", "logprobs": 1}
    e = _refused(parse, {**body, "logprob_token_ids": []})  # before: top-k logprobs served
    assert e.param == "logprob_token_ids" and "empty" in e.message


@pytest.mark.parametrize("salt", ["x" * 129, "a@b", "a/b", "a\\b", "a\x00b"])
@pytest.mark.parametrize("parse", [parse_chat, parse_completion], ids=["chat", "completion"])
def test_a_cache_salt_backends_cannot_key_is_a_400(parse, salt: str) -> None:
    body = {"messages": CHAT} if parse is parse_chat else {"prompt": "a"}
    e = _refused(parse, {**body, "cache_salt": salt})  # before: served
    assert e.param == "cache_salt"
    assert parse({**body, "cache_salt": "s" * 128}).cache_salt == "s" * 128


# ---- ids: the Messages API and speech routes ----------------------------------------------
@pytest.fixture(scope="module")
def scripted() -> Iterator[SimpleNamespace]:
    engine = ScriptedEngine(max_model_len=512, step_time=0.0005)
    args = ["--max-model-len", "512", "--served-model-name", "tiny"]
    with serve_in_process(args, engine) as (http_, app):
        yield SimpleNamespace(http=http_, engine=engine, app=app)


def _sse(server: ServerProc, path: str, body: bytes, headers: dict) -> list[dict]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        conn.request("POST", path, body, headers)
        r = conn.getresponse()
        assert r.status == 200, r.read()
        return [
            json.loads(line[6:])
            for line in r
            if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]"
        ]
    finally:
        conn.close()


def test_messages_answer_the_chat_completion_id(scripted: SimpleNamespace) -> None:
    scripted.engine.script = "Hello."
    body = {"model": "tiny", "max_tokens": 20, "messages": CHAT}
    status, _, got = scripted.http.request(
        "POST", "/v1/messages", body, headers={"X-Request-Id": "trace-m"}
    )
    assert status == 200 and got["id"] == "chatcmpl-trace-m", got  # before: msg_<random>
    status, _, got = scripted.http.request("POST", "/v1/messages", body)
    assert status == 200 and got["id"].startswith("chatcmpl-"), got
    assert len(got["id"]) == len("chatcmpl-") + 32
    data = json.dumps({**body, "stream": True})
    events = _sse(scripted.http, "/v1/messages", data, {**HEADERS, "X-Request-Id": "trace-s"})
    assert events[0]["type"] == "message_start"
    assert events[0]["message"]["id"] == "chatcmpl-trace-s"
    status, _, err = scripted.http.request(
        "POST", "/v1/messages", body, headers={"X-Request-Id": "x" * 129}
    )
    assert status == 400 and err["type"] == "error", err  # Anthropic's error shape


def test_speech_stream_chunks_carry_the_header_id(tmp_path) -> None:
    pytest.importorskip("numpy")
    pytest.importorskip("transformers.models.whisper")
    import test_transcriptions as stt  # tests/server: the tiny Whisper and form helpers
    import test_whisper

    from paged_engine import LLM

    path = test_whisper.write_tiny_whisper(tmp_path / "whisper")
    llm = LLM(str(path), dtype="float32", block_size=16, num_gpu_blocks_override=64)
    clip = stt.wav_bytes(stt.tone(1.0, 440))
    ctype = f"multipart/form-data; boundary={stt.BOUNDARY}"
    with serve_in_process(COMMON_ARGS, llm.llm_engine) as (server, _app):
        for route, task in (("transcriptions", "transcribe"), ("translations", "translate")):
            fields = {"model": "tiny", "max_completion_tokens": 3, "stream": "true"}
            if route == "translations":
                fields["language"] = "fr"
            body = stt.form(fields, clip)
            headers = {"Content-Type": ctype, "X-Request-Id": f"sp-{task}"}
            chunks = _sse(server, f"/v1/audio/{route}", body, headers)
            assert chunks and {c["id"] for c in chunks} == {f"{task}-sp-{task}"}  # before: uuid
