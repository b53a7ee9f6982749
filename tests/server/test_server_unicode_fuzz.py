"""Arbitrary Unicode through every route where client text meets the tokenizer, the chat
template or the detokenizer, on the real engine: valid text round-trips; text that is not
valid Unicode (a lone surrogate) is a 400 naming the field; nothing is ever a 500."""

from __future__ import annotations

from fuzz_text import has_lone_surrogate, hostile_text, through_json
from hypothesis import HealthCheck, given, settings
from server_proc import ServerProc

FUZZ = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _expect(status: int, payload: object, text: str, param: str) -> bool:
    """True when the request was served; a refusal must be the surrogate's, naming `param`."""
    if has_lone_surrogate(through_json(text)):
        assert status == 400, payload
        assert payload["error"]["param"] == param, payload
        return False
    assert status == 200, payload
    return True


@FUZZ
@given(text=hostile_text())
def test_completions_echo_any_text(real_server: ServerProc, text: str) -> None:
    body = {"prompt": ["x", "x" + text], "max_tokens": 2, "echo": True, "logprobs": 1}
    status, _, r = real_server.request("POST", "/v1/completions", body)
    if _expect(status, r, text, "prompt[1]"):
        assert r["choices"][1]["text"].startswith("x" + through_json(text))
        r["choices"][1]["text"].encode()  # generated text is valid Unicode too
    status, _, r = real_server.request(
        "POST", "/v1/completions", {"prompt": "x" + text, "max_tokens": 2, "stream": True}
    )
    if status == 200:
        assert r.rstrip().endswith("data: [DONE]")
    _expect(status, r, text, "prompt")


@FUZZ
@given(text=hostile_text(), name=hostile_text(3))
def test_chat_any_text(real_server: ServerProc, text: str, name: str) -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": text}]
    body = {"messages": messages, "max_tokens": 2, "logprobs": True, "top_logprobs": 1}
    status, _, r = real_server.request("POST", "/v1/chat/completions", body)
    if _expect(status, r, text, "messages[1].content"):
        r["choices"][0]["message"]["content"].encode()
    body = {"messages": [{"role": "user", "content": "hi", "name": name}], "max_tokens": 1}
    status, _, r = real_server.request("POST", "/v1/chat/completions", body)
    _expect(status, r, name, "messages[0].name")


@FUZZ
@given(text=hostile_text())
def test_tokenize_detokenize_round_trip(real_server: ServerProc, text: str) -> None:
    body = {"prompt": text or "x", "add_special_tokens": False}
    status, _, r = real_server.request("POST", "/tokenize", body)
    if _expect(status, r, text, "prompt"):
        status, _, back = real_server.request("POST", "/detokenize", {"tokens": r["tokens"]})
        assert status == 200 and back["prompt"] == through_json(text or "x")
    body = {"messages": [{"role": "user", "content": text}]}
    status, _, r = real_server.request("POST", "/tokenize", body)
    _expect(status, r, text, "messages[0].content")


def test_tokenize_returns_the_token_strings_when_asked(
    real_server: ServerProc, tiny_model: str
) -> None:
    """vLLM's `return_token_strs`: each id's vocabulary entry (`token_strs`, else null)."""
    from transformers import AutoTokenizer

    status, _, r = real_server.request("POST", "/tokenize", {"prompt": "Hello wide world"})
    assert status == 200 and r["token_strs"] is None, r
    tok = AutoTokenizer.from_pretrained(tiny_model)
    for body in (
        {"prompt": "Hello wide world", "return_token_strs": True},
        {"messages": [{"role": "user", "content": "hi there"}], "return_token_strs": True},
    ):
        status, _, r = real_server.request("POST", "/tokenize", body)
        assert status == 200, r
        assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"]), r
        assert len(r["token_strs"]) == r["count"] > 1
    status, _, r = real_server.request("POST", "/tokenize", {"prompt": "x", "return_token_strs": 1})
    assert status == 400 and r["error"]["param"] == "return_token_strs", r
