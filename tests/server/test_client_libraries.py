"""Requests exactly as popular client libraries other than the official SDKs send them (LangChain's
`ChatOpenAI` / `OpenAI`, LiteLLM's `openai/` and `hosted_vllm/` providers), captured with a
logging proxy in front of paged-server and replayed here over raw HTTP, so the suite needs
neither library. Each body below is byte-for-byte what the library sent; the assertions are
what the library then reads from the answer. vLLM is the reference: a request it serves is
served here, and what the library parses is shaped as vLLM shapes it."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fake_engine import ScriptedEngine
from server_proc import serve_in_process, typed_events

ARGS = [
    "--max-model-len", "2048", "--served-model-name", "tiny", "--client-timeout", "3",
    "--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--reasoning-parser", "qwen3",
]  # fmt: skip
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "w",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def srv() -> Iterator[SimpleNamespace]:
    engine = ScriptedEngine(max_model_len=2048, step_time=0.0005)
    with serve_in_process(ARGS, engine) as (http, _):
        yield SimpleNamespace(engine=engine, http=http)


def _post(srv: SimpleNamespace, path: str, body: dict) -> tuple[int, dict]:
    status, _, payload = srv.http.request("POST", path, body)
    return status, payload


# ---- LangChain ChatOpenAI(use_responses_api=True, reasoning={...}) ---------------------------
# Its documented form (and the OpenAI Agents SDK's) is {"effort": ..., "summary": "auto"};
# vLLM takes `summary` and makes no summary. Before, this was a 400 on every call.
LC_REASONING = {
    "model": "tiny",
    "stream": False,
    "input": [{"content": "Hi", "role": "user", "type": "message"}],
    "reasoning": {"effort": "low", "summary": "auto"},
}


def test_langchain_reasoning_summary_auto_is_served(srv: SimpleNamespace) -> None:
    srv.engine.script = "<think>hmm</think>Answer"
    status, r = _post(srv, "/v1/responses", LC_REASONING)
    assert status == 200, r
    reasoning, message = r["output"]
    assert reasoning["type"] == "reasoning" and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert message["content"][0]["text"] == "Answer"
    assert r["reasoning"] == {"effort": "low", "summary": "auto"}  # echoed as sent
    events = typed_events(srv.http, "/v1/responses", {**LC_REASONING, "stream": True})
    done = events[-1]
    assert done["type"] == "response.completed", done
    assert [o["type"] for o in done["response"]["output"]] == ["reasoning", "message"]
    # the deprecated spelling, as older clients send it
    legacy = {**LC_REASONING, "reasoning": {"effort": None, "generate_summary": "auto"}}
    assert _post(srv, "/v1/responses", legacy)[0] == 200
    # OpenAI's other two values, which vLLM's Reasoning model takes too: no summary either
    for key, value in (("summary", "detailed"), ("generate_summary", "concise")):
        body = {**LC_REASONING, "stream": False, "reasoning": {"effort": "low", key: value}}
        status, r = _post(srv, "/v1/responses", body)
        assert status == 200, r
        assert r["reasoning"]["summary"] == (value if key == "summary" else None)


@pytest.mark.parametrize(
    ("reasoning", "param"),
    [
        ({"summary": "verbose"}, "reasoning.summary"),  # not one of OpenAI's values
        ({"generate_summary": "short"}, "reasoning.generate_summary"),
        ({"summary": ["auto"]}, "reasoning.summary"),
        ({"effort": "low", "bogus": 1}, "reasoning"),
    ],
)
def test_reasoning_options_that_ask_for_more_are_refused_by_name(
    srv: SimpleNamespace, reasoning: dict, param: str
) -> None:
    status, r = _post(srv, "/v1/responses", {**LC_REASONING, "reasoning": reasoning})
    assert status == 400 and r["error"]["param"] == param, r


# ---- what passed (kept so it stays so) ------------------------------------------------------
def test_litellm_tool_round_trip_without_assistant_content(srv: SimpleNamespace) -> None:
    """LiteLLM replays the assistant turn with no "content" key at all, and tool results may
    be a list of text parts (LangChain's ToolMessage with list content)."""
    srv.engine.script = "Sunny"
    body = {
        "model": "tiny",
        "messages": [
            {"role": "user", "content": "Hi"},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "function": {"arguments": '{"city": "Paris"}', "name": "get_weather"},
                        "id": "call_1",
                        "type": "function",
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "x"}]},
        ],
        "tools": [WEATHER],
    }
    status, r = _post(srv, "/v1/chat/completions", body)
    assert status == 200, r
    assert r["choices"][0]["message"]["content"] == "Sunny"


def test_langchain_stream_usage_comes_after_the_finish(srv: SimpleNamespace) -> None:
    """ChatOpenAI(stream_usage=True): usage in a last chunk with no choices, after the chunk
    with finish_reason (LangChain sums usage_metadata over chunks: it must come once)."""
    srv.engine.script = "Hello"
    body = {
        "model": "tiny",
        "messages": [{"content": "Hi", "role": "user"}],
        "stream_options": {"include_usage": True},
    }
    events = srv.http.stream(body, "/v1/chat/completions")
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6  # 5 + EOS
    assert [c["usage"] for c in chunks] == [None] * len(chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_langchain_completions_llm_sends_explicit_nulls(srv: SimpleNamespace) -> None:
    """langchain_openai.OpenAI: a list prompt and "logprobs": null, "seed": null."""
    srv.engine.script = "abc"
    body = {
        "model": "tiny", "prompt": ["Hello", "World"], "frequency_penalty": 0, "logprobs": None,
        "max_tokens": 4, "n": 1, "presence_penalty": 0, "seed": None, "temperature": 0.7,
        "top_p": 1,
    }  # fmt: skip
    status, r = _post(srv, "/v1/completions", body)
    assert status == 200, r
    assert [(c["index"], c["text"]) for c in r["choices"]] == [(0, "abc"), (1, "abc")]


# ---- LiteLLM completion(..., n=2, stream=True) ----------------------------------------------
@pytest.mark.parametrize(
    ("path", "body"),
    [  # as LiteLLM's hosted_vllm provider sends them (chat; text_completion with a prompt list)
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                                  "n": 2}),
        ("/v1/completions", {"model": "tiny", "prompt": ["Hello", "Yo"]}),
    ],
)  # fmt: skip
def test_streams_carry_one_choice_per_chunk(srv: SimpleNamespace, path: str, body: dict) -> None:
    """vLLM and OpenAI send each choice's delta in a chunk of its own; LiteLLM's stream wrapper
    reads `choices[0]` of every chunk, so choices packed into one chunk lost all but the first
    (stream_chunk_builder then rebuilt one choice of two). Before, they were packed."""
    srv.engine.script = "Hey"
    texts: dict[int, str] = {}
    events = srv.http.stream({**body, "stream_options": {"include_usage": True}}, path)
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8  # 2 x (3 + EOS)
    for event in chunks:
        (choice,) = event["choices"]  # what LiteLLM reads
        piece = choice["delta"].get("content") if "delta" in choice else choice["text"]
        texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
    assert texts == {0: "Hey", 1: "Hey"}
