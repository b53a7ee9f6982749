"""The official `openai` client, unchanged, against `python -m paged_server` on a tiny llama."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from server_proc import MAX_MODEL_LEN, ServerProc

openai = pytest.importorskip("openai")

PROMPTS = ["Hello, my name is", "The capital of France is", "one two three"]


@pytest.fixture(scope="module")
def client(real_server: ServerProc):
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="EMPTY", max_retries=0)


def test_models(client) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]


def test_completions_prompt_forms(client) -> None:
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens == 5 or r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    r = client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=3)
    assert len(r.choices) == 2 and r.usage.prompt_tokens == 5


def test_completions_n_and_logprobs(client) -> None:
    r = client.completions.create(
        model="tiny", prompt=PROMPTS[:2], max_tokens=4, n=2, logprobs=3, seed=1
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.text for c in r.choices)  # forked sequences carry their own text
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) <= 4
        assert all(t <= 0 for t in lp.token_logprobs)
        assert all(len(top) >= 1 for top in lp.top_logprobs)
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)


def test_beam_search_with_logprobs(client) -> None:
    """vLLM's `use_beam_search` with `logprobs`: each beam's tokens with their logprobs (the
    top candidates its beam chose from), best beam first."""
    r = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=5, n=2, logprobs=1, temperature=0,
        extra_body={"use_beam_search": True, "ignore_eos": True},
    )  # fmt: skip
    assert len(r.choices) == 2
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
        assert all(x <= 0 for x in lp.token_logprobs)
        assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    sums = [sum(c.logprobs.token_logprobs) for c in r.choices]
    assert sums[0] >= sums[1] - 1e-6  # ranked by score (length penalty 1, equal lengths)


def test_completions_echo(client) -> None:
    r = client.completions.create(
        model="tiny", prompt=PROMPTS[2], max_tokens=2, echo=True, logprobs=1, temperature=0
    )
    c = r.choices[0]
    assert c.text.startswith(PROMPTS[2])
    assert c.logprobs.token_logprobs[0] is None  # the first prompt token has no logprob
    assert len(c.logprobs.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completions_streaming_matches_non_streaming(client) -> None:
    kw = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
    full = client.completions.create(**kw).choices[0].text
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")


def test_chat(client) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, n=2, logprobs=True, top_logprobs=2
    )
    assert r.object == "chat.completion" and len(r.choices) == 2
    for c in r.choices:
        assert c.message.role == "assistant"
        assert len(c.logprobs.content) <= 6
        assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    r = client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=3)
    assert r.usage.completion_tokens <= 3


def test_chat_streaming(client) -> None:
    msgs = [{"role": "user", "content": "Tell me a story"}]
    kw = {"model": "tiny", "messages": msgs, "max_tokens": 8, "temperature": 0}
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage.completion_tokens == chunks[-1].usage.total_tokens - (
        chunks[-1].usage.prompt_tokens
    )


def test_errors_come_back_as_openai_exceptions(client) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=MAX_MODEL_LEN * 2)
    assert str(MAX_MODEL_LEN) in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", temperature=-3)
    assert e.value.body["param"] == "temperature"


def test_greedy_http_equals_llm_generate(client, tiny_model: str) -> None:
    from paged_engine import LLM, SamplingParams

    # several requests in flight together: greedy output must not depend on the batch
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        http_texts = list(
            pool.map(
                lambda p: (
                    client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0)
                    .choices[0]
                    .text
                ),
                PROMPTS,
            )
        )
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    http_chat = (
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
        .choices[0]
        .message.content
    )
    llm = LLM(tiny_model, max_model_len=MAX_MODEL_LEN, dtype="float32", num_gpu_blocks_override=512)
    params = SamplingParams(temperature=0, max_tokens=8)
    assert [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)] == http_texts
    assert llm.chat(msgs, params, use_tqdm=False)[0].outputs[0].text == http_chat


def test_streaming_never_emits_text_a_stop_string_removes(client) -> None:
    kw = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 30, "temperature": 0}
    text = client.completions.create(**kw).choices[0].text
    # a stop string from the middle of the greedy output, free of replacement characters
    start = next(i for i in range(5, len(text) - 3) if "\ufffd" not in text[i : i + 3])
    stop = text[start : start + 3]
    want = text[: text.index(stop)]
    r = client.completions.create(**kw, stop=[stop, "zzzzzzzz"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**kw, stop=[stop, "zzzzzzzz"], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_latency_histograms_fill_in(client, real_server: ServerProc) -> None:
    client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4)
    m = real_server.metrics()
    for name in (
        "time_to_first_token",
        "inter_token_latency",
        "e2e_request_latency",
        "request_queue_time",
    ):
        count = m[f"paged:{name}_seconds_count"]
        assert count > 0, name
        assert 0 <= m[f"paged:{name}_seconds_sum"] / count < 10, name
    assert m["paged:generation_tokens_total"] >= 4 and m["paged:prompt_tokens_total"] > 0
