"""Forced tool calls (tool_choice "required" or a named function) streamed as they are generated:
the re-serializing reader (forced_calls.py) on random JSON at random splits, then the chat,
Responses and Messages streams of a ScriptedEngine (one token per character) against the
non-streamed answer for the same text."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fake_engine import ScriptedEngine
from server_proc import serve_in_process, typed_events

from paged_server.forced_calls import ForcedCalls, JsonRewriter, forced_calls
from paged_server.tools import ToolOutput, ToolRequest

ARGS = ["--max-model-len", "4096", "--served-model-name", "tiny", "--client-timeout", "3"]
HI = [{"role": "user", "content": "Hi"}]
NOTE = {"type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "integer"}}}
TOOLS = [
    {"type": "function", "function": {"name": "note", "parameters": NOTE}},
    {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}},
]
NAMED = {"type": "function", "function": {"name": "note"}}
LONG = "a long note, " * 40  # 520 characters: many engine steps
# compact, as a grammar may write it: the whole answer re-serializes "required" arguments
REQUIRED = json.dumps(
    [
        {"name": "note", "parameters": {"text": LONG, "n": 1}},
        {"name": "clock", "parameters": {"tz": "utc\u00e9\n", "x": [1.50, None]}},
    ],
    separators=(",", ":"),
    ensure_ascii=True,
)


# ---- the reader ----------------------------------------------------------------------------
_KEY_TAILS = ["", "é", '\\"', "\\ud83d"]


def _value(rng: random.Random, depth: int = 0) -> Any:
    k = rng.random()
    if depth > 3 or k < 0.35:
        return rng.choice(
            [0, -7, 2.5, 1.50, 1e300, -0.0, True, False, None, "", 'q"b\\s/\n\t\x01é\U0001f600']
        )
    if k < 0.7:
        return {f"k{i}{rng.choice(_KEY_TAILS)}": _value(rng, depth + 1) for i in range(4)}
    return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]


def _dump(rng: random.Random, value: Any) -> str:
    """`value` as some model may write it: compact, indented, \\u-escaped or not."""
    return json.dumps(
        value,
        ensure_ascii=rng.random() < 0.5,
        indent=rng.choice([None, 2]),
        separators=rng.choice([(",", ":"), (", ", ": "), (" ,", " :  ")]),
    )


def _split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_rewriter_pieces_join_to_json_dumps_at_any_split() -> None:
    rng = random.Random(0)
    for _ in range(1500):
        text = _dump(rng, _value(rng))
        pieces = list(text) if rng.random() < 0.2 else _split(rng, text)
        r = JsonRewriter()
        for p in pieces:
            r.feed(p)
        r.finish()
        assert r.text() == json.dumps(json.loads(text), ensure_ascii=False), (text, pieces)
    for text in ("1E400", "-0", "1.50", "[1e5,-0.0]", '"\\ud83d\\ude00\\/"', '{"a":{}, "b":[ ]}'):
        r = JsonRewriter()
        for c in text:
            r.feed(c)
        r.finish()
        assert r.text() == json.dumps(json.loads(text), ensure_ascii=False), text


def _joined(entries: list[dict]) -> list[tuple[str, str]]:
    """(name, arguments) per call of a stream's tool_calls entries; an id only in the first."""
    calls: dict[int, list[str]] = {}
    for e in entries:
        fn = e["function"]
        if e["index"] not in calls:
            assert e["type"] == "function" and "id" in e and fn["name"], e
            calls[e["index"]] = [fn["name"], fn["arguments"]]
        else:
            assert set(e) == {"index", "function"} and set(fn) == {"arguments"}, e
            calls[e["index"]][1] += fn["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return [(name, args) for name, args in (calls[k] for k in sorted(calls))]


def test_required_streams_each_call_as_the_whole_answer_writes_it() -> None:
    """Every prefix (a cut-off output too) at random splits: the streamed calls are the whole
    answer's, whose arguments are json.dumps of each call's parameters when complete."""
    rng = random.Random(1)
    for _ in range(300):
        names = ["a", "b\u00e9", 'q"x']
        calls = [
            {"name": rng.choice(names), "parameters": _value(rng, 1)}
            for _ in range(rng.randint(1, 3))
        ]
        text = _dump(rng, calls)
        whole = [(c.name, c.arguments) for c in forced_calls(text, None)]
        assert whole == [
            (c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls
        ]
        for prefix in (text, text[: rng.randint(0, len(text))]):
            reader = ForcedCalls(None)
            entries = [e for p in _split(rng, prefix) for e in reader.feed(p)]
            rest, got = reader.finish()
            streamed = _joined(entries + rest)
            assert streamed == [(c.name, c.arguments) for c in got]
            assert streamed == [(c.name, c.arguments) for c in forced_calls(prefix, None)]


def _rewrite(out: ToolOutput, pieces: list[str], reason: str) -> list[dict]:
    chunks = []
    for k, p in enumerate(pieces):
        last = k == len(pieces) - 1
        entry = {"index": 0, "delta": {"content": p}, "finish_reason": reason if last else None}
        chunks.append(out.rewrite(entry))
    return chunks


def test_a_named_call_streams_its_text_as_written() -> None:
    """vLLM sends a named call's text unchanged, whole and streamed: pieces of it as they come,
    the id and name in the first only; "stop" (vLLM's finish for a named call)."""
    named = ToolRequest(tools=[], choice="named", named="f")
    text = '{ "text" : "x\\u00e9",\n "n": 10 }'
    msg, reason = ToolOutput(named, None).message(text, "stop")
    assert msg["tool_calls"][0]["function"] == {"name": "f", "arguments": text}
    chunks = _rewrite(ToolOutput(named, None), [text[:5], text[5:9], text[9:]], "stop")
    entries = [e for c in chunks for e in c["delta"]["tool_calls"]]
    assert len(entries) == 3 and _joined(entries) == [("f", text)]
    assert [c["finish_reason"] for c in chunks] == [None, None, reason] == [None, None, "stop"]
    assert all("content" not in c["delta"] for c in chunks)


def test_forced_outputs_cut_short_carry_the_calls_announced() -> None:
    """max_tokens ended a forced output: a named call carries its partial text; "required" the
    calls whose names were complete, the last with the re-serialized start of its arguments;
    the stream sends exactly that, and the JSON is never content."""
    required = ToolRequest(tools=[], choice="required")
    text = '[{"name":"a","parameters":{"x":1}},{"name":"b","parameters":{"y":[2,"tw'
    msg, reason = ToolOutput(required, None).message(text, "length")
    assert msg["content"] is None and reason == "length"
    want = [("a", '{"x": 1}'), ("b", '{"y": [2, "tw')]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == want
    chunks = _rewrite(ToolOutput(required, None), [text[:20], text[20:50], text[50:]], "length")
    assert _joined([e for c in chunks if c for e in c["delta"].get("tool_calls", [])]) == want
    assert chunks[-1]["finish_reason"] == "length"
    assert ToolOutput(required, None).message('[{"name": "a', "length")[0] == {
        "role": "assistant",
        "content": None,
    }


# ---- over HTTP -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv() -> Iterator[SimpleNamespace]:
    engine = ScriptedEngine(max_model_len=4096, step_time=0.0005)
    with serve_in_process(ARGS, engine) as (http, _):
        yield SimpleNamespace(http=http, engine=engine)


def _chat(srv: SimpleNamespace, script: str, **body: Any) -> tuple[dict, list[dict]]:
    """The non-streamed answer and the stream's chunks for the same text."""
    srv.engine.script = script
    body = {"model": "tiny", "messages": HI, "tools": TOOLS, **body}
    status, _, whole = srv.http.request("POST", "/v1/chat/completions", body)
    assert status == 200, whole
    return whole, srv.http.stream(body, "/v1/chat/completions")


def _streamed(chunks: list[dict], index: int) -> tuple[list[dict], list[dict]]:
    """Choice `index`'s chunks: (those carrying tool_calls, the rest after the role chunk)."""
    mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
    assert mine[0]["delta"] == {"role": "assistant", "content": ""}
    calls = [c for c in mine[1:] if c["delta"].get("tool_calls")]
    assert all("content" not in c["delta"] for c in mine[1:])
    return calls, mine[1:]


def _whole_calls(choice: dict) -> list[tuple[str, str]]:
    return [
        (c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]
    ]


@pytest.mark.parametrize("n", [1, 2])
def test_named_call_arguments_stream_as_generated(srv: SimpleNamespace, n: int) -> None:
    """Several argument pieces before the end, joined: the whole answer's arguments (the text as
    written); the finish ("stop", as vLLM's) in a chunk of its own; each of n choices the same."""
    script = json.dumps({"text": LONG, "n": 3})
    whole, chunks = _chat(srv, script, tool_choice=NAMED, n=n)
    for i in range(n):
        assert _whole_calls(whole["choices"][i]) == [("note", script)]
        calls, rest = _streamed(chunks, i)
        assert len(calls) > 2 and all(c["finish_reason"] is None for c in calls)
        assert _joined([e for c in calls for e in c["delta"]["tool_calls"]]) == [("note", script)]
        assert rest[-1] == {"index": i, "delta": {}, "logprobs": None, "finish_reason": "stop",
                            "stop_reason": None}  # fmt: skip


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_stream_each_its_arguments(srv: SimpleNamespace, parallel: bool) -> None:
    """Two calls: each announced once (index, id, name), then its own argument pieces, joined
    to the whole answer's re-serialized arguments; parallel_tool_calls false: the first call."""
    whole, chunks = _chat(srv, REQUIRED, tool_choice="required", parallel_tool_calls=parallel)
    want = _whole_calls(whole["choices"][0])
    both = [
        ("note", json.dumps({"text": LONG, "n": 1})),
        ("clock", '{"tz": "utc\u00e9\\n", "x": [1.5, null]}'),
    ]
    assert want == both[: 2 if parallel else 1]
    calls, rest = _streamed(chunks, 0)
    entries = [e for c in calls for e in c["delta"]["tool_calls"]]
    assert _joined(entries) == want
    assert sum(e["index"] == 0 and "id" not in e for e in entries) > 2  # call 0 in pieces
    assert rest[-1]["delta"] == {} and rest[-1]["finish_reason"] == "tool_calls"
    assert whole["choices"][0]["finish_reason"] == "tool_calls"


def test_a_cut_call_streams_what_the_whole_answer_holds(srv: SimpleNamespace) -> None:
    for choice, script in (("required", REQUIRED), (NAMED, json.dumps({"text": LONG}))):
        whole, chunks = _chat(srv, script, tool_choice=choice, max_tokens=300)
        (w,) = whole["choices"]
        assert w["finish_reason"] == "length" and w["message"]["content"] is None
        calls, rest = _streamed(chunks, 0)
        assert _joined([e for c in calls for e in c["delta"]["tool_calls"]]) == _whole_calls(w)
        assert len(_whole_calls(w)) == 1 and len(calls) > 1
        assert rest[-1]["finish_reason"] == "length"


def test_responses_function_call_arguments_stream(srv: SimpleNamespace) -> None:
    """`response.function_call_arguments.delta` events as the arguments are generated, per
    call; joined: the `.done` arguments, the non-streamed response's."""
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    for choice, script in (("required", REQUIRED), ({"type": "function", "name": "note"},
                                                   json.dumps({"text": LONG})),):  # fmt: skip
        srv.engine.script = script
        body = {"model": "tiny", "input": "x", "tools": tools, "tool_choice": choice}
        _, _, whole = srv.http.request("POST", "/v1/responses", body)
        want = [(o["name"], o["arguments"]) for o in whole["output"]]
        events = typed_events(srv.http, "/v1/responses", body)
        done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
        assert [e["arguments"] for e in done] == [a for _, a in want]
        for e in done:
            pieces = [
                d["delta"]
                for d in events
                if d["type"] == "response.function_call_arguments.delta"
                and d["item_id"] == e["item_id"]
            ]
            assert len(pieces) > 2 and "".join(pieces) == e["arguments"]


def test_messages_input_json_delta_streams(srv: SimpleNamespace) -> None:
    tool = {"name": "note", "input_schema": NOTE}
    script = json.dumps({"text": LONG, "n": 2})
    srv.engine.script = script
    body = {"model": "tiny", "max_tokens": 1000, "messages": HI, "tools": [tool],
            "tool_choice": {"type": "tool", "name": "note"}}  # fmt: skip
    _, _, whole = srv.http.request("POST", "/v1/messages", body)
    (block,) = whole["content"]
    events = typed_events(srv.http, "/v1/messages", body)
    pieces = [
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    ]
    assert len(pieces) > 2 and json.loads("".join(pieces)) == block["input"]
    assert "".join(pieces) == script
