"""The official `openai` and `anthropic` SDKs on the paths test_real_clients.py leaves out: the
SDKs' typed parsing of streamed completions with several choices, the chat stream helper's
logprobs events, background responses (retrieve / cancel / delete / resumed streams), cursor
pagination of input items, model retrieval, raw responses, the exception class each error
status becomes, a 429's Retry-After that the SDK's retry obeys, and the Messages API's
system turns, Claude Code's roles and blocks and count_tokens' shape as vLLM answers them.
Everything runs over a ScriptedEngine in this process (the model's text set per test)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fake_engine import ScriptedEngine
from server_proc import serve_in_process

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

ARGS = ["--max-model-len", "2048", "--client-timeout", "3", "--tool-call-parser", "hermes"]
NAMES = ["--served-model-name", "org/tiny", "tiny"]  # a hub-style id (with "/") and an alias
HI = [{"role": "user", "content": "Hi"}]
BILLING = "x-anthropic-billing-header: cc_version=2.1.154; cch=4f2a"


@pytest.fixture(scope="module")
def srv() -> Iterator[SimpleNamespace]:
    engine = ScriptedEngine(max_model_len=2048, step_time=0.0005)
    with serve_in_process([*ARGS, *NAMES], engine) as (http, app):
        yield SimpleNamespace(
            engine=engine,
            app=app,
            http=http,
            oai=openai.OpenAI(base_url=http.url + "/v1", api_key="x", max_retries=0),
            ant=anthropic.Anthropic(base_url=http.url, api_key="x", max_retries=0),
        )


# ---- completions and chat through the SDK's typed streams ------------------------------------
def test_streamed_completions_with_two_choices_and_usage(srv: SimpleNamespace) -> None:
    srv.engine.script = "abc"
    chunks = list(
        srv.oai.completions.create(
            model="tiny", prompt=["x", "y"], n=2, max_tokens=8, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    *body, last = chunks
    text: dict[int, str] = {}
    finish: dict[int, str] = {}
    for c in body:
        (choice,) = c.choices  # one choice a chunk, as vLLM streams them
        text[choice.index] = text.get(choice.index, "") + choice.text
        finish[choice.index] = choice.finish_reason or finish.get(choice.index)
        assert c.usage is None
    assert text == dict.fromkeys(range(4), "abc") and set(finish.values()) == {"stop"}
    assert last.choices == [] and last.usage.completion_tokens == 4 * (len("abc") + 1)  # + EOS
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


def test_continuous_usage_counts_each_choice_apart(srv: SimpleNamespace) -> None:
    """vLLM's continuous_usage_stats: a chunk's usage is its own choice's prompt and the tokens
    that choice generated so far (not the whole request's)."""
    srv.engine.script = "abc"
    opts = {"include_usage": True, "continuous_usage_stats": True}
    kw = {"model": "tiny", "n": 2, "stream": True, "stream_options": opts}
    chunks = list(srv.oai.completions.create(prompt=["x", "yy"], max_tokens=8, **kw))
    seen: dict[int, list[int]] = {}
    prompt = {0: 2, 1: 2, 2: 3, 3: 3}  # BOS + the prompt's bytes (the fake tokenizer)
    for c in chunks[:-1]:
        (choice,) = c.choices
        assert c.usage.prompt_tokens == prompt[choice.index]
        seen.setdefault(choice.index, []).append(c.usage.completion_tokens)
    for counts in seen.values():  # (a reader that fell behind merges steps into one chunk)
        assert counts == sorted(set(counts)) and counts[-1] == len("abc") + 1, seen
    assert chunks[-1].usage.completion_tokens == 4 * (len("abc") + 1)
    chat = srv.oai.chat.completions.create(messages=HI, **kw)
    per_choice: dict[int, list[int]] = {}
    for c in chat:
        for choice in c.choices:  # the role chunks first: nothing generated yet
            per_choice.setdefault(choice.index, []).append(c.usage.completion_tokens)
    assert [v[0] for v in per_choice.values()] == [0, 0]
    assert all(v == sorted(v) and v[-1] == len("abc") + 1 for v in per_choice.values())


def test_chat_stream_helper_logprobs_events(srv: SimpleNamespace) -> None:
    srv.engine.script = "abc"
    kw = {"model": "tiny", "messages": HI, "logprobs": True, "top_logprobs": 2}
    with srv.oai.chat.completions.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    deltas = [e for e in events if e.type == "logprobs.content.delta"]
    (done,) = [e for e in events if e.type == "logprobs.content.done"]
    streamed = [t.token for e in deltas for t in e.content]
    assert (
        streamed
        == [t.token for t in done.content]
        == [t.token for t in final.choices[0].logprobs.content]
    )
    assert "".join(streamed) == "abc" and all(len(t.top_logprobs) == 2 for t in done.content)
    assert final.choices[0].message.content == "abc"


def test_raw_response_headers_and_the_request_id(srv: SimpleNamespace) -> None:
    srv.engine.script = "ok"
    raw = srv.oai.chat.completions.with_raw_response.create(
        model="tiny", messages=HI, extra_headers={"X-Request-Id": "trace-7"}
    )
    assert raw.status_code == 200 and raw.headers["content-type"] == "application/json"
    assert raw.parse().id == "chatcmpl-trace-7"  # vLLM's: the id carries X-Request-Id


# ---- models ----------------------------------------------------------------------------------
def test_models_list_and_retrieve_hub_style_names(srv: SimpleNamespace) -> None:
    assert [m.id for m in srv.oai.models.list()] == ["org/tiny", "tiny"]
    card = srv.oai.models.retrieve("org/tiny")  # GET /v1/models/org/tiny
    assert (card.id, card.object, card.owned_by) == ("org/tiny", "model", "paged")
    with pytest.raises(openai.NotFoundError) as e:
        srv.oai.models.retrieve("org/nope")
    assert e.value.body["param"] == "model" and e.value.body["type"] == "not_found_error"
    assert srv.ant.models.retrieve("org/tiny").id == "org/tiny"
    with pytest.raises(anthropic.NotFoundError) as err:
        srv.ant.models.retrieve("nope")
    assert err.value.body["type"] == "error"


# ---- the Responses API ---------------------------------------------------------------------
def _finished(oai, rid: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while (r := oai.responses.retrieve(rid)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, r.status
        time.sleep(0.01)
    return r


def test_background_responses_retrieve_cancel_and_delete(srv: SimpleNamespace) -> None:
    oai, engine = srv.oai, srv.engine
    engine.script = "abc"
    r = oai.responses.create(model="tiny", input="x", background=True)
    assert r.status == "queued" and r.background is True
    done = _finished(oai, r.id)
    assert (done.status, done.output_text) == ("completed", "abc")
    with pytest.raises(openai.BadRequestError):  # finished: nothing to cancel
        oai.responses.cancel(r.id)
    engine.script = "z" * 4000  # long enough to be cancelled in flight
    slow = oai.responses.create(model="tiny", input="x", background=True, max_output_tokens=1500)
    assert oai.responses.cancel(slow.id).status == "cancelled"
    assert oai.responses.cancel(slow.id).status == "cancelled"  # cancelling again: the same
    assert oai.responses.retrieve(slow.id).status == "cancelled"
    assert oai.responses.delete(slow.id) is None
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.retrieve(slow.id)
    assert e.value.body["param"] == "response_id"
    engine.script = "abc"
    sync = oai.responses.create(model="tiny", input="x")
    with pytest.raises(openai.BadRequestError):  # vLLM's: a synchronous response
        oai.responses.cancel(sync.id)


def test_a_background_stream_is_resumed_by_the_stream_helper(srv: SimpleNamespace) -> None:
    srv.engine.script = "abcdef"
    stream = srv.oai.responses.create(model="tiny", input="x", background=True, stream=True)
    first = next(iter(stream))
    stream.close()  # the client goes away; the response runs on
    assert first.type == "response.created"
    with srv.oai.responses.stream(response_id=first.response.id) as resumed:
        numbers = [e.sequence_number for e in resumed]
        final = resumed.get_final_response()
    assert numbers == list(range(len(numbers))) and numbers[0] == 0
    assert (final.id, final.status, final.output_text) == (first.response.id, "completed", "abcdef")
    tail = list(srv.oai.responses.retrieve(final.id, stream=True, starting_after=2))
    assert [e.sequence_number for e in tail] == numbers[3:]
    assert tail[-1].type == "response.completed"


def test_input_items_cursor_pagination(srv: SimpleNamespace) -> None:
    srv.engine.script = "ok"
    turns = [{"role": "user", "content": f"m{i}"} for i in range(5)]
    r = srv.oai.responses.create(model="tiny", input=turns)
    page = srv.oai.responses.input_items.list(r.id, limit=2)
    assert page.has_more and page.first_id == page.data[0].id and page.last_id == page.data[1].id
    # the SDK follows `after` = last_id until has_more is false (newest first by default)
    texts = [item.content[0].text for item in srv.oai.responses.input_items.list(r.id, limit=2)]
    assert texts == ["m4", "m3", "m2", "m1", "m0"]
    asc = srv.oai.responses.input_items.list(r.id, limit=3, order="asc")
    assert [item.content[0].text for item in asc] == ["m0", "m1", "m2", "m3", "m4"]


def test_null_unsupported_responses_fields_are_no_value(srv: SimpleNamespace) -> None:
    """vLLM accepts a null `prompt` (a template is refused only when one is given); the SDK
    sends null for a parameter set to None."""
    srv.engine.script = "ok"
    none = {"prompt": None, "conversation": None, "context_management": None}
    assert srv.oai.responses.create(model="tiny", input="x", **none).output_text == "ok"
    with pytest.raises(openai.BadRequestError) as e:
        srv.oai.responses.create(model="tiny", input="x", prompt={"id": "pmpt_1"})
    assert e.value.body["param"] == "prompt"


# ---- errors and retries ----------------------------------------------------------------------
def test_error_statuses_are_the_sdks_exception_classes(srv: SimpleNamespace) -> None:
    oai, ant = srv.oai, srv.ant
    cases = [
        (openai.BadRequestError, {"n": 0}, "n"),
        (openai.BadRequestError, {"max_tokens": 10**6}, "max_tokens"),
        (openai.BadRequestError, {"messages": [{"role": "bogus", "content": "x"}]}, "messages[0]"),
        (openai.NotFoundError, {"model": "nope"}, "model"),
    ]
    for cls, extra, param in cases:
        with pytest.raises(cls) as e:
            oai.chat.completions.create(**{"model": "tiny", "messages": HI, **extra})
        assert e.value.body["param"] == param and e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        oai.get("/nope", cast_to=object)
    with pytest.raises(anthropic.BadRequestError) as err:
        ant.messages.create(model="tiny", max_tokens=0, messages=HI)
    assert err.value.body["error"]["type"] == "invalid_request_error"


def test_a_full_queue_is_a_429_the_sdk_retries_after_its_retry_after() -> None:
    engine = ScriptedEngine(max_model_len=2048, step_time=0.01, max_num_seqs=1)
    engine.script = "x" * 50  # 0.5 s a request
    args = [*ARGS, *NAMES, "--max-queued-requests", "1"]
    with serve_in_process(args, engine) as (http, _):
        base = http.url + "/v1"
        patient = openai.OpenAI(base_url=base, api_key="x", max_retries=2)
        impatient = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
        kw = {"model": "tiny", "prompt": "x", "max_tokens": 60}
        busy = [threading.Thread(target=impatient.completions.create, kwargs=kw) for _ in range(2)]
        for t, metric in zip(busy, ("running", "waiting"), strict=True):  # then the queue is full
            t.start()
            deadline = time.monotonic() + 10
            while http.metrics()[f"paged:num_requests_{metric}"] < 1:
                assert time.monotonic() < deadline, metric
                time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as e:
            impatient.completions.create(**kw)
        assert e.value.response.headers["retry-after"] == "1"
        assert e.value.body["type"] == "rate_limit_error"
        started = time.monotonic()
        assert patient.completions.create(**kw).choices[0].text == "x" * 50
        assert time.monotonic() - started >= 0.9  # it waited as told before retrying
        for t in busy:
            t.join()


# ---- Anthropic's Messages API: what vLLM reads besides Anthropic's spec ----------------------
def test_system_turns_and_claude_code_roles_and_blocks(srv: SimpleNamespace) -> None:
    """vLLM joins `system` turns found in `messages` into the system prompt, reads Claude
    Code's "ctx" / "msg" roles as user turns, drops its per-request billing header block and
    accepts `tool_reference` blocks."""
    srv.engine.script = "ok"
    system = [{"type": "text", "text": BILLING}, {"type": "text", "text": "Be brief."}]
    call = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [{"type": "tool_reference", "tool_name": "f"}, {"type": "text", "text": "2"}],
    }
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
        {"role": "ctx", "content": "Context."},
        {"role": "msg", "content": [{"type": "text", "text": "Add."}]},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result, {"type": "tool_reference", "tool_name": "f"}]},
    ]
    tools = [{"name": "f", "input_schema": {"type": "object"}, "defer_loading": True}]
    kw = {"model": "tiny", "messages": messages, "system": system, "tools": tools}
    m = srv.ant.messages.create(max_tokens=10, **kw)
    assert m.content[0].text == "ok"
    got = srv.app.tokenizer.messages
    assert [x["role"] for x in got] == ["system", "user", "user", "assistant", "tool"]
    assert got[0]["content"] == "Be brief.\nBe kind." and got[1]["content"] == "Context."
    assert got[4] == {"role": "tool", "tool_call_id": "toolu_1", "content": "2"}
    count = srv.ant.beta.messages.count_tokens(**kw)  # vLLM's shape, context_management too
    assert count.input_tokens == m.usage.input_tokens
    assert count.context_management.original_input_tokens == count.input_tokens
    # another billing hash is the same prompt (the prefix cache serves it)
    other = [{"type": "text", "text": BILLING.replace("4f2a", "9c1d")}, system[1]]
    assert (
        srv.ant.messages.count_tokens(**{**kw, "system": other}).input_tokens == count.input_tokens
    )


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "system", "content": 5}], "messages[0].content"),
        ([{"role": "system", "content": [{"type": "image"}]}, *HI], "messages[0].content[0]"),
        ([{"role": "system", "content": [{"type": "text", "text": BILLING}]}], "messages"),
        ([{"role": ["user"], "content": "x"}], "messages[0]"),
        ([{"role": "tool", "content": "x"}], "messages[0]"),
    ],
)
def test_bad_system_turns_and_roles_are_anthropic_400s(
    srv: SimpleNamespace, messages: list, param: str
) -> None:
    body = {"model": "tiny", "max_tokens": 5, "messages": messages}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        status, _, payload = srv.http.request("POST", path, body)
        assert status == 400 and payload["type"] == "error", payload
        assert param in payload["error"]["message"], payload


def test_count_tokens_matches_the_prompt_the_answer_used(srv: SimpleNamespace) -> None:
    srv.engine.script = "fine"
    kw = {"model": "org/tiny", "messages": [*HI, {"role": "system", "content": "Late rule."}]}
    m = srv.ant.messages.create(max_tokens=10, **kw)
    assert srv.app.tokenizer.messages[0] == {"role": "system", "content": "Late rule."}
    status, _, body = srv.http.request("POST", "/v1/messages/count_tokens", kw)
    assert status == 200 and body == {
        "input_tokens": m.usage.input_tokens,
        "context_management": {"original_input_tokens": m.usage.input_tokens},
    }


def test_vllm_extras_chat_template_kwargs_and_kv_transfer_params(srv: SimpleNamespace) -> None:
    """vLLM's Messages requests take `chat_template_kwargs` (count_tokens too) and a null
    `kv_transfer_params`; here the client's variables win over what `thinking` sets."""
    srv.engine.script = "ok"
    kw = {"model": "tiny", "messages": HI, "thinking": {"type": "enabled", "budget_tokens": 64}}
    extra = {"chat_template_kwargs": {"enable_thinking": False, "house_style": "terse"}}
    srv.ant.messages.create(max_tokens=5, **kw, extra_body={**extra, "kv_transfer_params": None})
    variables = srv.app.tokenizer.template_vars
    assert (variables["enable_thinking"], variables["house_style"]) == (False, "terse")
    srv.app.tokenizer.template_vars = {}
    assert srv.ant.messages.count_tokens(**kw, extra_body=extra).input_tokens > 0
    assert srv.app.tokenizer.template_vars["house_style"] == "terse"
    for body, param in [
        ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ]:
        with pytest.raises(anthropic.BadRequestError) as e:
            srv.ant.messages.create(max_tokens=5, **kw, extra_body=body)
        assert param in e.value.body["error"]["message"], e.value.body
