"""The rest of the OpenAI / vLLM request fields: add_special_tokens, truncate_prompt_tokens,
request_id, echo for chat, continue_final_message, documents, and the fields deliberately
left out (400 naming them). Over the in-process fake engine, whose tokenizer is one byte per
token plus a BOS (id 1), and the chat template rendering with a real HF tokenizer."""

from __future__ import annotations

import re
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fake_engine import FakeEngine
from server_proc import COMMON_ARGS, MAX_MODEL_LEN, ServerProc, serve_in_process

from paged_server.openai_protocol import parse_chat


@pytest.fixture(scope="module")
def fake() -> Iterator[ServerProc]:
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, step_time=0.001)
    with serve_in_process(COMMON_ARGS, engine) as (http, _app):
        yield http


def post(server: ServerProc, path: str, body: dict, status: int = 200) -> dict:
    got, _, payload = server.request("POST", path, body)
    assert got == status, payload
    return payload


def test_add_special_tokens(fake) -> None:
    body = {"prompt": "abc", "max_tokens": 1}
    assert post(fake, "/v1/completions", body)["usage"]["prompt_tokens"] == 4  # BOS + 3
    body["add_special_tokens"] = False
    assert post(fake, "/v1/completions", body)["usage"]["prompt_tokens"] == 3
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    n_chat = post(fake, "/v1/chat/completions", chat)["usage"]["prompt_tokens"]
    chat["add_special_tokens"] = True  # off by default for chat: the template holds BOS
    assert post(fake, "/v1/chat/completions", chat)["usage"]["prompt_tokens"] == n_chat + 1


def test_truncate_prompt_tokens_keeps_the_end(fake) -> None:
    body = {"prompt": "abcdef", "max_tokens": 1, "truncate_prompt_tokens": 2, "echo": True}
    r = post(fake, "/v1/completions", body)
    assert r["usage"]["prompt_tokens"] == 2 and r["choices"][0]["text"].startswith("ef")
    body = {"prompt": [[10, 11, 12, 13]], "max_tokens": 1, "truncate_prompt_tokens": -1}
    assert post(fake, "/v1/completions", body)["usage"]["prompt_tokens"] == 4  # -1: no cut
    chat = {"messages": [{"role": "user", "content": "x" * 50}], "truncate_prompt_tokens": 5}
    assert (
        post(fake, "/v1/chat/completions", {**chat, "max_tokens": 1})["usage"]["prompt_tokens"] == 5
    )
    r = post(fake, "/v1/completions", {"prompt": "a", "truncate_prompt_tokens": 0}, 400)
    assert r["error"]["param"] == "truncate_prompt_tokens"
    # more than max_model_len: refused whatever the prompt's length, as vLLM refuses it
    over = {"prompt": "a", "max_tokens": 1, "truncate_prompt_tokens": MAX_MODEL_LEN + 1}
    r = post(fake, "/v1/completions", over, 400)
    assert r["error"]["param"] == "truncate_prompt_tokens", r
    assert "greater than max_model_len" in r["error"]["message"], r
    chat_over = {**chat, "truncate_prompt_tokens": MAX_MODEL_LEN + 1}
    r = post(fake, "/v1/chat/completions", chat_over, 400)
    assert r["error"]["param"] == "truncate_prompt_tokens", r


def test_request_id_names_the_response(fake) -> None:
    r = post(fake, "/v1/completions", {"prompt": "a", "max_tokens": 1, "request_id": "job-7"})
    assert r["id"] == "cmpl-job-7"
    body = {"messages": [{"role": "user", "content": "a"}], "request_id": "job-8"}
    assert post(fake, "/v1/chat/completions", {**body, "max_tokens": 1})["id"] == "chatcmpl-job-8"


def test_chat_echo_repeats_the_final_assistant_message(fake) -> None:
    messages = [
        {"role": "user", "content": "tell me a story"},
        {"role": "assistant", "content": "Once upon"},
    ]
    body = {
        "messages": messages,
        "echo": True,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "max_tokens": 3,
    }
    r = post(fake, "/v1/chat/completions", body)
    content = r["choices"][0]["message"]["content"]
    plain = post(fake, "/v1/chat/completions", {**body, "echo": False})
    assert content == "Once upon" + plain["choices"][0]["message"]["content"]
    events = fake.stream({**body, "stream": True}, "/v1/chat/completions")
    streamed = "".join(
        c["delta"].get("content") or "" for e in events for c in e["choices"] if "delta" in c
    )
    assert streamed == content
    user_last = {**body, "messages": messages[:1], "continue_final_message": False}
    r = post(fake, "/v1/chat/completions", user_last)  # echo of a user turn: nothing
    assert (
        r["choices"][0]["message"]["content"]
        == post(fake, "/v1/chat/completions", {**user_last, "echo": False})["choices"][0][
            "message"
        ]["content"]
    )


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"continue_final_message": True}, "continue_final_message"),  # + add_generation_prompt
        (
            {"continue_final_message": True, "add_generation_prompt": False},
            "continue_final_message",  # the last message is the user's
        ),
        ({"documents": "not a list"}, "documents"),
        ({"documents": [{"title": 3}]}, "documents"),
        ({"return_tokens_as_token_ids": "yes"}, "return_tokens_as_token_ids"),
        ({"cache_salt": ""}, "cache_salt"),  # a salt must be a non-empty string
        ({"verbosity": "low"}, "verbosity"),
        ({"logits_processors": ["x"]}, "logits_processors"),
        ({"request_id": ""}, "request_id"),
        ({"include_reasoning": "yes"}, "include_reasoning"),
        ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
        ({"structural_tag": "{}"}, "structural_tag"),
        # values repetition_detection refuses, in its older top-level spelling
        ({"max_repetition_pattern_size": 8}, "repetition_detection"),  # min_count 0
        (
            {
                "max_repetition_pattern_size": 2,
                "min_repetition_pattern_size": 3,
                "repetition_min_count": 3,
            },
            "repetition_detection",
        ),
    ],
)
def test_refused_fields_are_named(fake, extra, param) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
    r = post(fake, "/v1/chat/completions", body, 400)
    assert r["error"]["param"] == param
    assert "Unrecognized" not in r["error"]["message"]  # known, refused on purpose


def test_off_values_and_obfuscation_are_accepted(fake) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "return_tokens_as_token_ids": False,
        "logits_processors": [],
        "include_reasoning": False,  # no reasoning parser: no effect
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {"ttl": "30m"},
        "min_repetition_pattern_size": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
    }
    events = fake.stream(body, "/v1/chat/completions")
    assert events[-1]["usage"]["completion_tokens"] == 1


def real_app(tokenizer, template: str):
    from paged_server.app import OpenAIApp

    return OpenAIApp(
        SimpleNamespace(),
        tokenizer,
        served_model_names=["t"],
        model_path="t",
        max_model_len=MAX_MODEL_LEN,
        chat_template=template,
    )


def test_documents_and_continue_final_message_reach_the_template(tiny_model) -> None:
    from transformers import AutoTokenizer

    template = (
        "{% for d in documents or [] %}[doc {{ d.title }}: {{ d.text }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    app = real_app(AutoTokenizer.from_pretrained(tiny_model), template)
    docs = [{"title": "A", "text": "cats purr"}, {"title": "B", "text": "dogs bark"}]
    body = {"messages": [{"role": "user", "content": "who purrs?"}], "documents": docs}
    text = app._render_chat(parse_chat(body))
    assert text == "[doc A: cats purr][doc B: dogs bark]<user>who purrs?</user><assistant>"
    body = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "The answer is"},
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    assert app._render_chat(parse_chat(body)) == "<user>q</user><assistant>The answer is"
    body["continue_final_message"] = False
    assert app._render_chat(parse_chat(body)).endswith("The answer is</assistant>")


def test_prompt_logprobs_match_hf(real_server: ServerProc, tiny_model) -> None:
    """vLLM's prompt_logprobs: per prompt token {id: {logprob, rank, decoded_token}}, the token
    itself plus the top k; completions per choice, chat at the top level."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = [5, 6, 7, 8, 9, 10]
    body = {"prompt": [ids], "max_tokens": 1, "prompt_logprobs": 2}
    r = post(real_server, "/v1/completions", body)
    plp = r["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    for j in range(1, len(ids)):
        entry = plp[j]
        assert str(ids[j]) in entry and 2 <= len(entry) <= 3
        assert abs(entry[str(ids[j])]["logprob"] - ref[j - 1, ids[j]].item()) < 1e-3
        top = sorted(entry.values(), key=lambda e: e["rank"])[0]
        assert top["rank"] == 1 and abs(top["logprob"] - ref[j - 1].max().item()) < 1e-3
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = post(real_server, "/v1/chat/completions", {**chat, "prompt_logprobs": 0})
    assert r["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in r["prompt_logprobs"][1:])  # the prompt token alone
    assert len(r["prompt_logprobs"]) == r["usage"]["prompt_tokens"]
    bad = post(real_server, "/v1/completions", {**body, "stream": True}, 400)
    assert bad["error"]["param"] == "prompt_logprobs"


def test_continuous_usage_stats(fake) -> None:
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": "abc", "max_tokens": 4, "stream": True, "stream_options": opts}
    events = fake.stream(body)
    # Every chunk carries usage (None would raise here); how many tokens the first chunk holds
    # depends on how the stream coalesces, so only the order and the total are fixed.
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert all(e["usage"]["prompt_tokens"] == 4 for e in events)
    assert len(events) >= 2 and counts == sorted(counts) and counts[-1] == 4
    plain = fake.stream({**body, "stream_options": {"include_usage": True}})
    assert all(e["usage"] is None for e in plain[:-1]) and plain[-1]["usage"]
    bad = {**body, "stream_options": {"continuous_usage_stats": "yes"}}
    assert post(fake, "/v1/completions", bad, 400)["error"]["param"] == "stream_options"


def test_return_token_ids(fake) -> None:
    """vLLM's return_token_ids: the prompt's ids and each choice's generated ids; streamed, the
    prompt's ids come first and each chunk carries its new ids."""
    body = {"prompt": "abc", "max_tokens": 4, "return_token_ids": True, "temperature": 0}
    r = post(fake, "/v1/completions", body)
    c = r["choices"][0]
    assert c["prompt_token_ids"] == [1, 100, 101, 102]  # BOS + one id per byte (+3)
    assert len(c["token_ids"]) == r["usage"]["completion_tokens"] == 4
    events = fake.stream({**body, "stream": True})
    entries = [e for ev in events for e in ev["choices"]]
    assert entries[0]["prompt_token_ids"] == c["prompt_token_ids"]
    assert all("prompt_token_ids" not in e for e in entries[1:])
    assert [t for e in entries for t in e["token_ids"]] == c["token_ids"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = post(fake, "/v1/chat/completions", {**chat, "return_token_ids": True})
    assert len(r["prompt_token_ids"]) == r["usage"]["prompt_tokens"]
    assert len(r["choices"][0]["token_ids"]) == r["usage"]["completion_tokens"]
    plain = post(fake, "/v1/completions", {**body, "return_token_ids": False})
    assert "token_ids" not in plain["choices"][0]


def test_priority_needs_the_priority_policy(fake) -> None:
    body = {"prompt": "a", "max_tokens": 1}
    post(fake, "/v1/completions", {**body, "priority": 0})
    r = post(fake, "/v1/completions", {**body, "priority": 3}, 400)
    assert r["error"]["param"] == "priority" and "priority scheduling" in r["error"]["message"]
    for bad in ("high", 1.5, 1 << 64):
        r = post(fake, "/v1/completions", {**body, "priority": bad}, 400)
        assert r["error"]["param"] == "priority"


@pytest.fixture(scope="module")
def tuned() -> Iterator[tuple[ServerProc, FakeEngine]]:
    """A fake engine whose model recommends sampling defaults, under the priority policy."""
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, step_time=0.001)
    engine.generation_defaults = {"temperature": 0.5, "top_k": 5, "max_tokens": 3}
    engine.config.scheduling_policy = "priority"
    with serve_in_process(COMMON_ARGS, engine) as (http, _app):
        yield http, engine


def _last_params(engine: FakeEngine) -> tuple[Any, int]:
    rid = next(reversed(engine.params))
    return engine.params[rid], engine.priorities[rid]


def test_generation_config_defaults_fill_unset_fields(tuned) -> None:
    http, engine = tuned
    r = post(http, "/v1/completions", {"prompt": "abc", "max_tokens": 16})
    params, _ = _last_params(engine)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.5, 5, 3)
    assert r["usage"]["completion_tokens"] <= 3  # the model's max_new_tokens caps requests
    body = {"prompt": "abc", "max_tokens": 2, "temperature": 0.9, "top_k": None}
    post(http, "/v1/completions", body)  # a request's own values win; null means unset
    params, _ = _last_params(engine)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.9, 5, 2)
    chat = {"messages": [{"role": "user", "content": "hi"}], "priority": -2}
    post(http, "/v1/chat/completions", chat)  # no max_tokens: the rest of the context, capped
    params, priority = _last_params(engine)
    assert (params.max_tokens, params.temperature, priority) == (3, 0.5, -2)
    beams = {"prompt": "abc", "use_beam_search": True, "n": 2, "max_tokens": 8}
    post(http, "/v1/completions", beams)  # beams sample nothing: only the length cap applies
    params, _ = _last_params(engine)
    assert (params.top_k, params.max_tokens) == (0, 3)


def test_responses_echo_the_defaults_that_ran(tuned) -> None:
    http, engine = tuned
    r = post(http, "/v1/responses", {"input": "hi", "priority": 4, "store": False})
    assert (r["temperature"], r["top_p"]) == (0.5, 1.0)
    assert _last_params(engine)[1] == 4
    r = post(http, "/v1/responses", {"input": "hi", "temperature": 0.1, "store": False})
    assert r["temperature"] == 0.1


def test_cache_salt_reaches_the_engine(tuned) -> None:
    http, engine = tuned
    body = {"prompt": "abc", "max_tokens": 1, "cache_salt": "tenant-1"}
    post(http, "/v1/completions", body)
    assert engine.prompts[next(reversed(engine.params))]["cache_salt"] == "tenant-1"
    r = post(http, "/v1/completions", {**body, "cache_salt": 7}, 400)
    assert r["error"]["param"] == "cache_salt"


def test_return_tokens_as_token_ids(fake) -> None:
    as_id = re.compile(r"token_id:\d+")
    body = {"prompt": "ab", "max_tokens": 3, "logprobs": 2, "return_tokens_as_token_ids": True}
    lp = post(fake, "/v1/completions", body)["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3 and all(as_id.fullmatch(t) for t in lp["tokens"])
    assert all(as_id.fullmatch(t) for top in lp["top_logprobs"] for t in top)
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 1,
        "return_tokens_as_token_ids": True,
    }
    content = post(fake, "/v1/chat/completions", chat)["choices"][0]["logprobs"]["content"]
    for entry in content:
        assert as_id.fullmatch(entry["token"]) and bytes(entry["bytes"]).decode() == entry["token"]
        assert all(as_id.fullmatch(t["token"]) for t in entry["top_logprobs"])
    events = fake.stream(body)
    streamed = [
        t for e in events if e.get("choices") for t in e["choices"][0]["logprobs"]["tokens"]
    ]
    assert len(streamed) == 3 and all(as_id.fullmatch(t) for t in streamed)


def test_default_template_kwargs_and_tools_left_out_under_tool_choice_none(
    tiny_model, capsys
) -> None:
    """--default-chat-template-kwargs: every render's variables, the request's own winning (and
    seen by the reasoning split afterwards); --exclude-tools-when-tool-choice-none."""
    from transformers import AutoTokenizer

    from paged_server.cli_args import parse_args

    template = (
        "[think={{ enable_thinking }} mood={{ mood }}]{% for t in tools or [] %}"
        "[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    )
    app = real_app(AutoTokenizer.from_pretrained(tiny_model), template)
    args = parse_args(["--default-chat-template-kwargs", '{"enable_thinking": false, "mood": 1}'])
    app.default_template_kwargs = args.default_chat_template_kwargs
    hi = [{"role": "user", "content": "hi"}]
    req = parse_chat({"messages": hi})
    assert app._render_chat(req) == "[think=False mood=1]<user>hi"
    assert req.chat_template_kwargs == {"enable_thinking": False, "mood": 1}
    own = parse_chat({"messages": hi, "chat_template_kwargs": {"enable_thinking": True}})
    assert app._render_chat(own) == "[think=True mood=1]<user>hi"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"messages": hi, "tools": [tool], "tool_choice": "none"}
    assert "[tool f]" in app._render_chat(parse_chat(body))  # vLLM's default: shown
    app.exclude_tools_when_none = True
    assert "[tool f]" not in app._render_chat(parse_chat(body))
    assert "[tool f]" in app._render_chat(parse_chat({**body, "tool_choice": "required"}))
    for bad, why in (
        ("[1]", "expected a JSON object"),
        ('{"tools": []}', "may not set 'tools'"),
        ('{"chat_template": "x"}', "use --chat-template"),
    ):
        with pytest.raises(SystemExit):
            parse_args(["--default-chat-template-kwargs", bad])
        assert why in capsys.readouterr().err
