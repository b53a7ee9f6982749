"""The routes over the fake engine, in this process: what the engine is asked for (output kinds,
token ids), who uses which tokenizer, and streams that carry exactly what the JSON answers do."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fake_engine import FakeEngine
from server_proc import COMMON_ARGS, MAX_MODEL_LEN, ServerProc, serve_in_process

from paged_engine.sampling_params import RequestOutputKind

CHAT = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def inproc() -> Iterator[SimpleNamespace]:
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, step_time=0.001)
    with serve_in_process(COMMON_ARGS, engine) as (http, app):
        yield SimpleNamespace(http=http, engine=engine, app=app)


@pytest.fixture(params=["inproc", "real"])
def any_server(request: pytest.FixtureRequest) -> ServerProc:
    """The in-process fake, and a real server: what the HTTP side shows must match."""
    if request.param == "inproc":
        return request.getfixturevalue("inproc").http
    return request.getfixturevalue("real_server")


def _post(server: ServerProc, path: str, body: dict) -> dict:
    status, _, payload = server.request("POST", path, body)
    assert status == 200, payload
    return payload


def test_each_prompt_is_tokenized_once(inproc: SimpleNamespace) -> None:
    tokenizers = (inproc.app.tokenizer, inproc.engine.tokenizer)
    before = sum(t.num_encodes for t in tokenizers)
    body = {"prompt": ["one", "two", [40, 41]], "max_tokens": 2}
    _post(inproc.http, "/v1/completions", body)
    inproc.http.stream(body)
    _post(inproc.http, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})
    assert sum(t.num_encodes for t in tokenizers) - before == 2 + 2 + 1
    assert inproc.engine.tokenizer.num_encodes == 0  # it got the ids, with the text


def test_the_engine_tokenizer_is_the_engine_sides_alone(inproc: SimpleNamespace) -> None:
    assert inproc.app.tokenizer is not inproc.engine.tokenizer
    http = inproc.http
    _post(http, "/v1/completions", {"prompt": [40, 41], "max_tokens": 2, "echo": True})
    _post(http, "/v1/completions", {"prompt": "x", "max_tokens": 2, "logprobs": 1})
    _post(http, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "logprobs": True})
    _post(http, "/tokenize", {"messages": CHAT})
    _post(http, "/detokenize", {"tokens": [40, 41]})
    engine_side = {"engine-loop", "engine-output"}
    assert inproc.engine.tokenizer.threads == {"engine-output"}  # detokenizing: the output stage
    assert inproc.app.tokenizer.threads and not inproc.app.tokenizer.threads & engine_side


def test_streams_ask_for_deltas_the_rest_for_the_final_output(inproc: SimpleNamespace) -> None:
    body = {"prompt": "x", "max_tokens": 3}
    rid = _post(inproc.http, "/v1/completions", body)["id"]
    assert inproc.engine.params[f"{rid}-0"].output_kind == RequestOutputKind.FINAL_ONLY
    rid = inproc.http.stream(body)[0]["id"]
    assert inproc.engine.params[f"{rid}-0"].output_kind == RequestOutputKind.DELTA


def _joined(events: list[dict], chat: bool) -> dict[int, dict]:
    """Per choice index: the streamed text, logprob tokens and finish reason."""
    out: dict[int, dict] = {}
    for e in events:
        for c in e["choices"]:
            o = out.setdefault(c["index"], {"text": "", "tokens": [], "finish": None})
            o["text"] += (c["delta"].get("content") or "") if chat else c["text"]
            lp = c["logprobs"]
            if lp is not None:
                o["tokens"] += [t["token"] for t in lp["content"]] if chat else lp["tokens"]
            if c["finish_reason"] is not None:
                assert o["finish"] is None, "a choice finished twice"
                o["finish"] = c["finish_reason"]
    return out


STREAMED = [
    ("/v1/completions", {"prompt": ["ab", [40, 41]], "n": 2, "max_tokens": 9, "logprobs": 1}),
    ("/v1/completions", {"prompt": "ab", "max_tokens": 12, "stop": ["dk", "zz", "e"]}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "echo": True, "logprobs": 0}),
    ("/v1/chat/completions", {"messages": CHAT, "n": 3, "max_tokens": 5, "logprobs": True}),
]


@pytest.mark.parametrize(("path", "body"), STREAMED)
def test_a_stream_carries_what_the_json_answer_does(
    any_server: ServerProc, path: str, body: dict
) -> None:
    chat = "chat" in path
    body = {**body, "temperature": 0}
    whole = _post(any_server, path, body)
    events = any_server.stream({**body, "stream_options": {"include_usage": True}}, path)
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    streamed = _joined(events[:-1], chat)
    assert sorted(streamed) == [c["index"] for c in whole["choices"]]
    for c in whole["choices"]:
        s = streamed[c["index"]]
        assert s["text"] == (c["message"]["content"] if chat else c["text"])
        assert s["finish"] == c["finish_reason"]
        if chat:
            assert s["tokens"] == [t["token"] for t in c["logprobs"]["content"]]
        elif not body.get("echo") and c["logprobs"] is not None:
            assert s["tokens"] == c["logprobs"]["tokens"]


def test_a_stop_string_is_never_streamed_then_cut(inproc: SimpleNamespace) -> None:
    body = {"prompt": "ab", "max_tokens": 12}
    text = _post(inproc.http, "/v1/completions", body)["choices"][0]["text"]
    stop = text[4:7]  # its first characters are generated (and held back) before the match
    events = inproc.http.stream({**body, "stop": [stop]})
    assert "".join(e["choices"][0]["text"] for e in events) == text[: text.index(stop)]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["choices"][0]["stop_reason"] == stop


def test_best_of_and_beam_search_answer_n_choices(any_server: ServerProc) -> None:
    body = {"prompt": "ab", "n": 2, "max_tokens": 3, "ignore_eos": True}
    for extra in ({"best_of": 3}, {"use_beam_search": True, "best_of": 3, "temperature": 0}):
        r = _post(any_server, "/v1/completions", {**body, **extra})
        assert [c["index"] for c in r["choices"]] == [0, 1]
        assert r["usage"]["completion_tokens"] == 6
