"""Structured outputs, token rules and tool calling through paged-server, with the official
`openai` client (a real engine over a tiny llama, `--tool-call-parser hermes`; a second server
with `llama3_json` for its test). Both serve in this process: the engine as `paged-server ARGS`
builds it, behind the app and HTTP server it builds (a server process would add its start)."""

from __future__ import annotations

import contextlib
import json
import re
import urllib.request
from collections.abc import Iterator

import jsonschema
import pytest
from server_proc import REAL_ARGS, ServerProc, serve_in_process

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "forecast", "description": "weather", "parameters": CITY},
    },
    {
        "type": "function",
        "function": {
            "name": "clock",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"enum": ["utc", "cet"]}},
                "required": ["tz"],
                "additionalProperties": False,
            },
        },
    },
]


@contextlib.contextmanager
def _serving(tiny_model: str, tool_call_parser: str) -> Iterator[ServerProc]:
    from paged_server.cli import build_engine
    from paged_server.cli_args import parse_args

    args = ["--model", tiny_model, *REAL_ARGS, "--tool-call-parser", tool_call_parser]
    with serve_in_process(args, build_engine(parse_args(args))) as (server, _app):
        yield server


@pytest.fixture(scope="module")
def server(tiny_model: str) -> Iterator[ServerProc]:
    with _serving(tiny_model, "hermes") as server:
        yield server


@pytest.fixture(scope="module")
def client(server: ServerProc):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)


MSGS = [{"role": "user", "content": "weather?"}]


def test_response_format_json_schema(client) -> None:
    r = client.chat.completions.create(
        model="tiny",
        messages=MSGS,
        max_tokens=60,
        temperature=0.8,
        seed=2,
        n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}},
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), CITY)


def test_vllm_guided_fields_and_structured_outputs(client) -> None:
    kw = {"model": "tiny", "prompt": "x", "max_tokens": 40, "temperature": 0}
    r = client.completions.create(**kw, extra_body={"guided_regex": r"[a-z]{2}-[0-9]{3}"})
    assert re.fullmatch(r"[a-z]{2}-[0-9]{3}", r.choices[0].text)
    r = client.completions.create(**kw, extra_body={"guided_choice": ["left", "right"]})
    assert r.choices[0].text in ("left", "right")
    r = client.completions.create(**kw, extra_body={"guided_json": CITY})
    jsonschema.validate(json.loads(r.choices[0].text), CITY)
    r = client.completions.create(**kw, extra_body={"structured_outputs": {"choice": ["a", "b"]}})
    assert r.choices[0].text in ("a", "b")
    grammar = 'root ::= "go " ("up" | "down")'
    r = client.completions.create(**kw, extra_body={"guided_grammar": grammar})
    assert r.choices[0].text in ("go up", "go down")


def test_streamed_constrained_output_validates(client) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=MSGS,
        max_tokens=60,
        temperature=0,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), CITY)


def _call_tag(schema: dict) -> dict:
    content = {"type": "json_schema", "json_schema": schema}
    return {"type": "tag", "begin": "<call>", "content": content, "end": "</call>"}


def test_structural_tags(client) -> None:
    """vLLM's response_format {"type": "structural_tag", "format": ...}, its older
    "structures" / "triggers" form, structured_outputs.structural_tag and the top-level
    field: the outputs are what the format describes."""
    one_call = {
        "type": "structural_tag",
        "format": {
            "type": "tags_with_separator",
            "tags": [_call_tag(CITY)],
            "separator": ",",
            "at_least_one": True,
            "stop_after_first": True,
        },
    }
    kw = {"model": "tiny", "messages": MSGS, "max_tokens": 60, "temperature": 0.8, "seed": 1}
    for extra in (
        {"response_format": one_call},
        {"extra_body": {"structured_outputs": {"structural_tag": json.dumps(one_call)}}},
        {"extra_body": {"structural_tag": json.dumps(one_call)}},
    ):
        r = client.chat.completions.create(**kw, n=2, **extra)
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice.message.content
            m = re.fullmatch(r"<call>(.*)</call>", choice.message.content)
            assert m is not None, choice.message.content
            jsonschema.validate(json.loads(m.group(1)), CITY)
    legacy = {
        "type": "structural_tag",
        "structures": [{"begin": "<call=f>", "schema": CITY, "end": "</call>"}],
        "triggers": ["<call="],
    }
    r = client.chat.completions.create(**{**kw, "max_tokens": 20}, response_format=legacy)
    text = r.choices[0].message.content
    for part in text.split("<call=")[1:]:  # any call the free text made is whole
        assert part.startswith("f>{"), text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"response_format": {"type": "structural_tag", "format": {"type": "nope"}}},
            "response_format",
        ),
        ({"extra_body": {"structural_tag": "{not json"}}, "structural_tag"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        ({"extra_body": {"guided_regex": "a[b"}}, "guided_regex"),
        ({"extra_body": {"guided_grammar": "root ::= ("}}, "guided_grammar"),
        ({"extra_body": {"guided_grammar": 'start: ("a"'}}, "guided_grammar"),  # Lark syntax
        # refused by the engine's tokenizer check (on add), named as the client's field
        ({"extra_body": {"guided_grammar": 'start: <|nonexistent|> "a"'}}, "guided_grammar"),
        (
            {"extra_body": {"structured_outputs": {"grammar": "start: <[99999]>"}}},
            "structured_outputs",
        ),
        (
            {"extra_body": {"structured_outputs": {"regex": "x", "choice": ["y"]}}},
            "structured_outputs",
        ),
        ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "guided_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"logit_bias": {"99999999": 5}}, "logit_bias"),
        ({"extra_body": {"allowed_token_ids": [-1]}}, "allowed_token_ids"),
        ({"extra_body": {"bad_words": [""]}}, "bad_words"),
    ],
)
def test_invalid_constraints_are_400_naming_the_field(client, extra, param) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=5, **extra)
    assert e.value.body["param"] == param, e.value.body
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")  # still serving


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "c", "schema": CITY},
                }
            },
            "response_format",
        ),
        ("/v1/completions", {"guided_json": CITY}, "guided_json"),
        ("/v1/completions", {"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
        ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_beam_search_with_a_constraint_is_400(server, path, extra, param) -> None:
    """Beam search keeps no grammar state per beam: refused, naming the field the client sent."""
    prompt = {"messages": MSGS} if "chat" in path else {"prompt": "x"}
    body = {"model": "tiny", **prompt, "max_tokens": 4, "n": 2, "use_beam_search": True}
    status, _, r = server.request("POST", path, {**body, **extra})
    assert status == 400, r
    err = r["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    assert err["param"] == param and "use_beam_search" in err["message"], err
    status, _, r = server.request("POST", path, body)  # still serving, beams included
    assert status == 200 and len(r["choices"]) == 2, r


def _post(server: ServerProc, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_logit_bias_allowed_ids_bad_words(client, server) -> None:
    kw = {"model": "tiny", "prompt": "x", "max_tokens": 6, "temperature": 0}
    r = client.completions.create(**kw, logit_bias={"77": 100}, extra_body={"ignore_eos": True})
    ids = _post(server, "/tokenize", {"prompt": r.choices[0].text, "add_special_tokens": False})
    assert set(ids["tokens"]) == {77} or r.choices[0].text == ""
    r = client.completions.create(**kw, extra_body={"allowed_token_ids": [40, 41]})
    ids = _post(server, "/tokenize", {"prompt": r.choices[0].text, "add_special_tokens": False})
    assert set(ids["tokens"]) <= {40, 41}
    free = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    word = free.split()[0]
    r = client.completions.create(**kw, extra_body={"ignore_eos": True, "bad_words": [word]})
    assert word not in r.choices[0].text.split()


def test_tool_choice_required(client) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=100, temperature=0, tools=TOOLS,
        tool_choice="required", parallel_tool_calls=False,
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])


def test_tool_choice_named_streaming(client) -> None:
    """The arguments stream as they are generated (the name in the first piece only), joined:
    the non-streamed answer's arguments, the text as the model wrote it (as vLLM sends it)."""
    kw = {"model": "tiny", "messages": MSGS, "max_tokens": 60, "temperature": 0, "tools": TOOLS,
          "tool_choice": {"type": "function", "function": {"name": "forecast"}}}  # fmt: skip
    args, names, pieces, finish = "", [], 0, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                names += [tc.function.name] if tc.function.name else []
                args += tc.function.arguments or ""
                pieces += bool(tc.function.arguments) and c.finish_reason is None
            finish = c.finish_reason or finish
    assert names == ["forecast"] and finish == "stop" and pieces > 1
    jsonschema.validate(json.loads(args), CITY)
    (call,) = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert call.function.arguments == args


@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_cut_short_by_max_tokens_never_come_back_as_text(client, stream) -> None:
    """As OpenAI and vLLM answer: a named call keeps its partial arguments; "required" keeps
    the calls whose names were complete (here none); the forced JSON is never `content`."""
    named = {"type": "function", "function": {"name": "forecast"}}
    for choice in ("required", named):
        kw = {"model": "tiny", "messages": MSGS, "max_tokens": 4, "temperature": 0}
        r = client.chat.completions.create(**kw, tools=TOOLS, tool_choice=choice, stream=stream)
        content, calls, finish = "", {}, None
        for c in [ch for chunk in r for ch in chunk.choices] if stream else r.choices:
            delta = c.delta if stream else c.message
            content += delta.content or ""
            for k, tc in enumerate(delta.tool_calls or []):
                name, args = calls.get(tc.index if stream else k, ("", ""))
                calls[tc.index if stream else k] = (
                    name + (tc.function.name or ""),
                    args + (tc.function.arguments or ""),
                )
            finish = c.finish_reason or finish
        assert finish == "length" and content == "", (choice, content)
        if choice == "required":
            assert calls == {}
        else:
            ((name, args),) = calls.values()
            assert name == "forecast" and args and not args.rstrip().endswith("}"), args


HERMES = r'<tool_call>\n\{"name": "clock", "arguments": \{"tz": "(utc|cet)"\}\}\n</tool_call>'


def test_tool_choice_auto_parses_hermes_calls(client) -> None:
    """The model's text is forced into Hermes' format; "auto" parses it, whole and streamed."""
    kw = {"model": "tiny", "messages": MSGS, "max_tokens": 110, "temperature": 0, "tools": TOOLS}
    extra = {"structured_outputs": {"regex": "ok " + HERMES}}
    r = client.chat.completions.create(**kw, tool_choice="auto", extra_body=extra)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "ok "  # as written
    assert msg.tool_calls[0].function.name == "clock"
    whole = json.loads(msg.tool_calls[0].function.arguments)
    from openai.lib.streaming.chat import ChatCompletionStreamState

    stream = client.chat.completions.create(**kw, stream=True, extra_body=extra)
    state, pieces = ChatCompletionStreamState(), []
    for chunk in stream:  # the client's own accumulation of delta.tool_calls
        state.handle_chunk(chunk)
        pieces += [tc for c in chunk.choices for tc in c.delta.tool_calls or []]
    final = state.get_final_completion().choices[0]
    assert final.message.content == msg.content  # the stream's content is the whole answer's
    assert final.finish_reason == "tool_calls"
    (call,) = final.message.tool_calls
    assert call.function.name == "clock" and json.loads(call.function.arguments) == whole
    # OpenAI's shape: id, type and name once, first; then the arguments in several pieces
    assert pieces[0].id and pieces[0].function.name == "clock"
    assert all(p.id is None and p.function.name is None for p in pieces[1:])
    assert len(pieces) > 2 and all(p.index == 0 for p in pieces)


LLAMA3 = r'\{"name": "clock", "parameters": \{"tz": "(utc|cet)"\}\}'


@pytest.fixture(scope="module")
def llama3_client(tiny_model: str) -> Iterator:
    with _serving(tiny_model, "llama3_json") as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)


def test_tool_choice_auto_parses_llama3_json_calls(llama3_client) -> None:
    """As the Hermes test, with Llama 3's bare `{"name", "parameters"}` output: the openai
    client's own accumulation of the streamed call equals the non-streamed call."""
    kw = {"model": "tiny", "messages": MSGS, "max_tokens": 60, "temperature": 0, "tools": TOOLS}
    extra = {"structured_outputs": {"regex": LLAMA3}}
    r = llama3_client.chat.completions.create(**kw, tool_choice="auto", extra_body=extra)
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    (whole,) = r.choices[0].message.tool_calls
    assert whole.function.name == "clock"
    from openai.lib.streaming.chat import ChatCompletionStreamState

    stream = llama3_client.chat.completions.create(**kw, stream=True, extra_body=extra)
    state, pieces = ChatCompletionStreamState(), []
    for chunk in stream:
        state.handle_chunk(chunk)
        pieces += [tc for c in chunk.choices for tc in c.delta.tool_calls or []]
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and not final.message.content
    (call,) = final.message.tool_calls
    assert call.function.name == "clock"
    assert json.loads(call.function.arguments) == json.loads(whole.function.arguments)
    assert pieces[0].id and pieces[0].function.name == "clock"
    assert all(p.id is None and p.function.name is None for p in pieces[1:])
    assert len(pieces) > 2 and all(p.index == 0 for p in pieces)


def test_tool_messages_round_trip(client) -> None:
    msgs = [
        {"role": "user", "content": "weather in oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "forecast", "arguments": '{"city": "oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, tools=TOOLS,
                                       tool_choice="none")  # fmt: skip
    assert r.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
        (
            [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"type": "function", "function": {"name": "f", "arguments": "{"}}
                    ],
                }
            ],
            "messages[0].tool_calls[0]",
        ),
        ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0]"),
    ],
)
def test_malformed_messages_name_the_field(client, messages, param) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert e.value.body["param"] == param, e.value.body


def test_tool_choice_errors(client) -> None:
    bad = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0]"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
    ]  # fmt: skip
    for kw, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, **kw)
        assert e.value.body["param"] == param, (kw, e.value.body)
