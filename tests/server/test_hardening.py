"""What a hostile or careless client sends: lone surrogates, negative token ids, its own chat
template; what the metrics count; prompt scoring with `echo` and `max_tokens: 0`."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fake_engine import FakeEngine
from server_proc import COMMON_ARGS, MAX_MODEL_LEN, ServerProc, serve_in_process

CHAT = [{"role": "user", "content": "Hi there"}]
BAD = "a\ud800c"


@pytest.fixture(scope="module")
def trusting(tiny_model: str) -> Iterator[SimpleNamespace]:
    """In process: the fake engine behind a real HF tokenizer, request templates trusted."""
    from transformers import AutoTokenizer

    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, step_time=0.001)
    engine.tokenizer = tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    args = [*COMMON_ARGS, "--trust-request-chat-template"]
    with serve_in_process(args, engine) as (http, app):
        yield SimpleNamespace(http=http, app=app, tokenizer=tokenizer)


def _error(server: ServerProc, path: str, body: dict) -> dict:
    status, _, payload = server.request("POST", path, body)
    assert status == 400, payload
    return payload["error"]


# ---- lone surrogates ------------------------------------------------------------------------
SURROGATE_CASES = [
    ("/v1/completions", {"prompt": BAD}, "prompt"),
    ("/v1/completions", {"prompt": BAD, "stream": True}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", BAD]}, "prompt[1]"),
    ("/v1/completions", {"prompt": "x", "stop": ["ok", BAD]}, "stop[1]"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": BAD}]},
        "messages[0].content",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": BAD}]}]},
        "messages[0].content[0].text",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": BAD}], "stream": True},
        "messages[0].content",
    ),
    ("/tokenize", {"prompt": BAD}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": BAD}]}, "messages[0].content"),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_CASES)
def test_a_lone_surrogate_is_a_400_naming_the_field(
    server: ServerProc, path: str, body: dict, param: str
) -> None:
    err = _error(server, path, {"max_tokens": 2, **body} if "tokenize" not in path else body)
    assert err["param"] == param
    assert "lone UTF-16 surrogate" in err["message"] and "U+D800" in err["message"]
    status, _, _ = server.request("POST", "/v1/completions", {"prompt": "ok", "max_tokens": 1})
    assert status == 200  # and the server goes on serving


def test_a_surrogate_pair_is_one_character(real_server: ServerProc) -> None:
    status, _, r = real_server.request(
        "POST", "/v1/completions", {"prompt": "a\ud83d\ude00", "max_tokens": 1, "echo": True}
    )
    assert status == 200 and r["choices"][0]["text"].startswith("a\U0001f600")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stop_list_past_the_bound_is_a_400_naming_stop(server: ServerProc, path: str) -> None:
    """Each stop string is searched for after every token on the engine's one stepping thread:
    a million of them (a 16 MiB body holds that many) slowed every request by seconds a token."""
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": CHAT}
    err = _error(server, path, {**body, "max_tokens": 2, "stop": ["s"] * 100_000})
    assert err["param"] == "stop" and "at most 1024" in err["message"]


# ---- token ids ------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", [[5, -1], [[3], [4, -7]]])
def test_a_negative_token_id_is_named_with_the_valid_range(
    server: ServerProc, prompt: list
) -> None:
    err = _error(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    bad = -1 if prompt == [5, -1] else -7
    assert err["param"] == "prompt"
    assert f"token id {bad} " in err["message"] and "[0, " in err["message"], err["message"]


# ---- request chat templates -----------------------------------------------------------------
def test_a_request_chat_template_is_refused_by_default(real_server: ServerProc) -> None:
    template = "{{ 7*7 }}"
    for path in ("/v1/chat/completions", "/tokenize"):
        err = _error(real_server, path, {"messages": CHAT, "chat_template": template})
        assert err["param"] == "chat_template"
        assert "--trust-request-chat-template" in err["message"]
        body = {"messages": CHAT, "chat_template_kwargs": {"chat_template": template}}
        assert _error(real_server, path, body)["param"] == "chat_template_kwargs"


def test_template_variables_are_data_and_cannot_replace_the_render_arguments(
    real_server: ServerProc,
) -> None:
    body = {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    status, _, r = real_server.request("POST", "/tokenize", body)
    assert status == 200 and r["count"] > 0
    for key in ("messages", "add_generation_prompt", "tokenize"):
        body = {"messages": CHAT, "chat_template_kwargs": {key: 1}}
        err = _error(real_server, "/tokenize", body)
        assert err["param"] == "chat_template_kwargs" and key in err["message"]
    assert _error(real_server, "/tokenize", {"messages": CHAT, "chat_template_kwargs": [1]})


def test_a_trusting_server_renders_request_templates_in_the_sandbox(
    trusting: SimpleNamespace,
) -> None:
    def rendered(body: dict) -> str:
        status, _, r = trusting.http.request("POST", "/tokenize", {"messages": CHAT, **body})
        assert status == 200, r
        return trusting.tokenizer.decode(r["tokens"])

    assert rendered({"chat_template": "{{ 7*7 }}"}) == "49"
    kwargs = {"chat_template": "{{ greeting }} {{ 6*7 }}", "greeting": "hey"}
    assert rendered({"chat_template_kwargs": kwargs}) == "hey 42"
    escape = "{{ messages.__class__.__mro__[-1].__subclasses__() }}"
    err = _error(trusting.http, "/tokenize", {"messages": CHAT, "chat_template": escape})
    assert err["param"] == "messages" and "unsafe" in err["message"], err


# ---- metrics --------------------------------------------------------------------------------
def _successes(server: ServerProc) -> dict[str, float]:
    _, _, text = server.request("GET", "/metrics")
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("paged:request_success_total{"):
            reason = line.split('finished_reason="')[1].split('"')[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def test_request_success_counts_requests_not_choices(server: ServerProc) -> None:
    before = _successes(server)
    body = {"prompt": "ab", "max_tokens": 2, "ignore_eos": True}
    for n in (1, 2, 2):
        status, _, _ = server.request("POST", "/v1/completions", {**body, "n": n})
        assert status == 200
    server.stream({**body, "n": 2})
    status, _, _ = server.request("POST", "/v1/completions", {**body, "prompt": ["a", "b"], "n": 3})
    assert status == 200
    server.wait_idle()
    after = _successes(server)
    assert after.get("length", 0) - before.get("length", 0) == 6  # 4 requests + 2 prompts
    assert sum(after.values()) - sum(before.values()) == 6


# ---- prompt scoring -------------------------------------------------------------------------
def test_echo_with_max_tokens_zero_returns_the_prompt_and_its_logprobs(
    real_server: ServerProc,
) -> None:
    prompt = "The quick brown fox"
    status, _, r = real_server.request(
        "POST",
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1},
    )
    assert status == 200, r
    (choice,) = r["choices"]
    n_prompt = r["usage"]["prompt_tokens"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == n_prompt and "".join(lp["tokens"]).endswith(prompt)
    assert lp["token_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    # the same prompt logprobs as a request that also generates tokens
    _, _, one = real_server.request(
        "POST",
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 1, "ignore_eos": True},
    )
    assert one["choices"][0]["logprobs"]["token_logprobs"][:n_prompt] == lp["token_logprobs"]
    ids = [[5, 6, 7]]
    status, _, r = real_server.request(
        "POST", "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True}
    )
    assert status == 200 and r["choices"][0]["logprobs"] is None

    # streamed (as vLLM allows): one event with the same choice, the usage event, [DONE]
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    events = real_server.stream({**body, "stream_options": {"include_usage": True}})
    assert [len(e["choices"]) for e in events] == [1, 0]
    assert events[0]["object"] == "text_completion" and events[0]["usage"] is None
    assert events[0]["choices"][0] == choice
    assert events[1]["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize("extra", [{}, {"stream": True}])
def test_max_tokens_zero_needs_echo(server: ServerProc, extra: dict) -> None:
    err = _error(server, "/v1/completions", {"prompt": "x", "max_tokens": 0, **extra})
    assert err["param"] == "max_tokens"
