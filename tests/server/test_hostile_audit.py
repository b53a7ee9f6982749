"""Hostile input from a real client's side, over the fake engine in this process: what an outside
audit of the routes found, kept as regressions.

- A huge prompt (15 MB of text encodes for ~20 s) must not hold up every other request's
  tokenization: texts past `_LONG_TEXT` characters are encoded by a tokenizer copy of their own.
- A `guided_choice` list past `MAX_CHOICES` is a 400 naming the field the client sent (100k
  choices compiled for ~27 s, then llguidance refused the grammar and the request came back as a
  200 with `finish_reason: "abort"` and no text); past 2000 choices, llguidance's parser lost
  track after the first token (a 200 answering "ch"): the choices are one lexeme now. For the
  same reason `tool_choice: "required"` takes at most `MAX_REQUIRED_TOOLS` tools (past 2000, a
  200 with no call).
- Malformed bodies at every level (nesting past the parser's depth, numbers past what JSON
  types hold, wrong types deep inside lists) are 400s naming the parameter, and the server goes on
  serving.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fake_engine import FakeEngine, FakeTokenizer
from server_proc import COMMON_ARGS, MAX_MODEL_LEN, serve_in_process

from paged_engine.structured_output.params import MAX_CHOICES
from paged_server.app import _LONG_TEXT
from paged_server.tools import MAX_REQUIRED_TOOLS

CHAT = [{"role": "user", "content": "Hi"}]
SLOW_ENCODE_S = 1.5


class SlowLongTokenizer(FakeTokenizer):
    """Takes SLOW_ENCODE_S to encode a text past _LONG_TEXT characters, as a real tokenizer
    takes seconds over megabytes."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _LONG_TEXT:
            time.sleep(SLOW_ENCODE_S)
        return super().encode(text, add_special_tokens)


@pytest.fixture(scope="module")
def inproc() -> Iterator[SimpleNamespace]:
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, step_time=0.001)
    engine.tokenizer = SlowLongTokenizer()
    with serve_in_process(COMMON_ARGS, engine) as (http, app):
        # a first chat render imports transformers (under the shared lock): not what is timed
        http.request("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1})
        yield SimpleNamespace(http=http, engine=engine, app=app)


@pytest.mark.parametrize(
    ("path", "long_body", "param"),
    [
        ("/v1/completions", lambda t: {"prompt": t, "max_tokens": 2}, "prompt"),
        (
            "/v1/chat/completions",
            lambda t: {"messages": [{"role": "user", "content": t}]},
            "messages",
        ),
        ("/v1/embeddings", lambda t: {"input": t}, "input"),
    ],
)
def test_a_huge_prompt_does_not_hold_up_other_requests(inproc, path, long_body, param) -> None:
    http = inproc.http
    answers: list = []
    long_text = "a " * (_LONG_TEXT // 2 + 10)
    worker = threading.Thread(
        target=lambda: answers.append(http.request("POST", path, long_body(long_text)))
    )
    worker.start()
    time.sleep(0.3)  # the long text is being encoded
    t0 = time.monotonic()
    status, _, body = http.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    waited = time.monotonic() - t0
    worker.join()
    assert status == 200, body
    assert waited < SLOW_ENCODE_S / 2, f"a short request waited {waited:.1f} s behind a long one"
    ((status, _, body),) = answers
    assert status == 400 and "maximum context length" in body["error"]["message"], body
    assert body["error"]["param"] == param


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_choice": ["c"] * (MAX_CHOICES + 1)}, "guided_choice"),
        ({"structured_outputs": {"choice": ["c"] * (MAX_CHOICES + 1)}}, "structured_outputs"),
        ({"guided_choice": [1]}, "guided_choice"),  # the shape's other errors name it too
        ({"guided_choice": ["c"] * 10_000 + [5]}, "guided_choice"),  # naming the bad item alone
    ],
)
def test_a_choice_list_past_the_bound_is_a_400_naming_the_field(inproc, extra, param) -> None:
    body = {"messages": CHAT, "max_tokens": 2, **extra}
    status, _, payload = inproc.http.request("POST", "/v1/chat/completions", body)
    assert status == 400, payload
    assert payload["error"]["param"] == param
    assert len(payload["error"]["message"]) < 300  # the list is not echoed back
    choices = extra.get("guided_choice") or extra["structured_outputs"]["choice"]
    assert (f"at most {MAX_CHOICES}" in payload["error"]["message"]) == (len(choices) > MAX_CHOICES)


def test_a_choice_list_at_the_bound_is_served(inproc) -> None:
    choices = [f"c{i}" for i in range(MAX_CHOICES)]
    body = {"messages": CHAT, "max_tokens": 2, "guided_choice": choices}
    status, _, payload = inproc.http.request("POST", "/v1/chat/completions", body)
    assert status == 200, payload


def test_more_choices_than_the_parser_follows_still_constrain(tiny_model: str) -> None:
    """llguidance's parser follows at most 2000 alternatives at once: a choice list written as
    parser alternatives went wrong at its first token (the answer "ch" to 2100 choices, finish
    "stop"). The list is one lexeme, so any of them matches to its end."""
    from transformers import AutoTokenizer

    from paged_engine.structured_output.grammar import grammar_text
    from paged_engine.structured_output.llguidance_backend import LLGuidanceBackend
    from paged_engine.structured_output.params import StructuredOutputsParams

    tok = AutoTokenizer.from_pretrained(tiny_model)
    backend = LLGuidanceBackend(tok, len(tok), [tok.eos_token_id])
    choices = [f"choice number {i}" for i in range(2100)]
    grammar = grammar_text(StructuredOutputsParams(choice=choices))
    for text, fits in ((choices[1234], True), ("choice number 99999", False)):
        matcher = backend.compile(grammar)
        ids = tok.encode(text, add_special_tokens=False)
        taken = all(matcher.accept(t) for t in ids)
        assert (taken and matcher.m.is_accepting()) == fits, (text, matcher.m.get_error())


def _tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}"}} for i in range(n)]


@pytest.mark.parametrize(
    ("n", "status"), [(MAX_REQUIRED_TOOLS, 200), (MAX_REQUIRED_TOOLS + 1, 400)]
)
def test_a_required_call_among_too_many_tools_is_a_400(inproc, n: int, status: int) -> None:
    """Past 2000 tools a forced call list failed after "[" (finish "stop", no call)."""
    body = {"messages": CHAT, "max_tokens": 2, "tool_choice": "required", "tools": _tools(n)}
    got, _, payload = inproc.http.request("POST", "/v1/chat/completions", body)
    assert got == status, payload
    if status == 400:
        assert payload["error"]["param"] == "tools"


C, CH, R = "/v1/completions", "/v1/chat/completions", "/v1/responses"
DEEP = 100_000


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        (C, b'{"prompt":' + b"[" * DEEP + b"]" * DEEP + b"}", None),  # parser depth, no crash
        (C, b'{"prompt":' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"}", None),
        (C, b'{"prompt":"a","max_tokens":1' + b"0" * 5000 + b"}", None),  # past int digits
        (C, b'{"prompt":"a","temperature":NaN}', None),
        (C, b'{"prompt":"a","max_tokens":1e400}', "max_tokens"),
        (C, b'{"prompt":"a","seed":18446744073709551616}', "seed"),
        (C, b'{"prompt":"a","n":18446744073709551616}', "n"),
        (C, b'{"prompt":"a","temperature":"NaN"}', "temperature"),
        (C, b'{"prompt":[18446744073709551616]}', "prompt"),
        (C, b'{"prompt":[[1],[true]]}', "prompt"),
        (C, b'{"prompt":"a","logit_bias":{"1":[[1]]}}', "logit_bias"),
        (C, b'{"prompt":"a","max_tokens":1,"max_tokens":"x"}', "max_tokens"),  # the last wins
        (CH, b'{"messages":[{"role":"user","content":[[[]]]}]}', "messages[0].content"),
        (CH, b'{"messages":[{"role":"user","content":"x"}],"n":1e308}', "n"),
        (CH, b'{"messages":[{"role":"assistant","tool_calls":[5]}]}', "messages[0].tool_calls[0]"),
        (R, b'{"input":[{"role":"user","content":[5]}]}', "input[0].content[0]"),
        (R, b'{"input":"x","max_output_tokens":18446744073709551616}', "max_output_tokens"),
        ("/detokenize", b'{"tokens":[[5]]}', "tokens"),
        ("/tokenize", b'{"prompt":["a"]}', "prompt"),
    ],
)
def test_malformed_bodies_are_400s_naming_the_parameter(inproc, path, raw, param) -> None:
    status, _, payload = inproc.http.request("POST", path, raw)
    assert status == 400, payload
    assert payload["error"]["param"] == param, payload
    status, _, _ = inproc.http.request("POST", C, {"prompt": "hi", "max_tokens": 2})
    assert status == 200
