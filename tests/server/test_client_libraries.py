"""Requests exactly as popular client libraries other than the official SDKs send them (LangChain's
`ChatOpenAI` / `OpenAI`, LiteLLM's `openai/` and `hosted_vllm/` providers, the OpenAI Agents
SDK, pydantic-ai, instructor, smolagents, AutoGen, LlamaIndex, Haystack), captured with a
logging proxy in front of paged-server and replayed here over raw HTTP, so the suite needs none
of these libraries. Each body below is byte-for-byte what the library sent (ids aside; long
system prompts cut short); the assertions are what the library then reads
from the answer. vLLM is the reference: a request it serves is served here, and what the
library parses is shaped as vLLM shapes it."""

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
    with serve_in_process(ARGS, engine) as (http, app):
        yield SimpleNamespace(engine=engine, http=http, app=app)


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


# ---- OpenAI Agents SDK 0.24 / pydantic-ai 2.38 / instructor 1.17 ----------------------------
# Captured the same way (openai 3.3 underneath). The Agents SDK's default model speaks the
# Responses API, `OpenAIChatCompletionsModel` chat completions; pydantic-ai's `OpenAIChatModel`
# / `OpenAIResponsesModel` with its `VLLMProvider`; instructor's `from_openai` modes.
CITY = {"properties": {"city": {"title": "City", "type": "string"}}, "required": ["city"],
        "title": "get_weather_args", "type": "object", "additionalProperties": False}  # fmt: skip
OUT = {"properties": {"city": {"title": "City", "type": "string"},
                      "temp": {"title": "Temp", "type": "integer"}},
       "required": ["city", "temp"], "title": "Weather", "type": "object",
       "additionalProperties": False}  # fmt: skip
AGENTS_TOOL = {"name": "get_weather", "parameters": CITY, "strict": True, "type": "function",
               "description": "Get the weather for a city."}  # fmt: skip
AGENTS_CHAT_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city.", "parameters": CITY,
    "strict": True}}  # fmt: skip
# Agent(output_type=Weather, tools=[get_weather], model_settings=ModelSettings(tool_choice=...)):
# the first turn forces the call and already names the final output's schema.
AGENTS_CHAT_FORCED = {
    "messages": [{"role": "user", "content": "Weather in Oslo?"}], "model": "tiny",
    "response_format": {"type": "json_schema", "json_schema": {
        "name": "final_output", "strict": True, "schema": OUT}},
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "tools": [AGENTS_CHAT_TOOL],
}  # fmt: skip
AGENTS_RESPONSES_FORCED = {
    "include": [], "input": [{"content": "Weather in Oslo?", "role": "user"}], "model": "tiny",
    "text": {"format": {"type": "json_schema", "name": "final_output", "schema": OUT,
                        "strict": True}},
    "tool_choice": "required", "tools": [AGENTS_TOOL],
}  # fmt: skip
# instructor.from_openai(client, mode=Mode.RESPONSES_TOOLS).responses.create(response_model=...)
INSTRUCTOR_RESPONSES = {
    "input": [{"role": "user", "content": "Weather in Paris?"}], "model": "tiny",
    "text": {"format": {"type": "json_schema", "name": "Weather", "strict": True,
                        "schema": OUT}},
    "tool_choice": {"type": "function", "name": "Weather"},
    "tools": [{"type": "function", "name": "Weather", "parameters": OUT, "description":
               "Correctly extracted `Weather` with all the required parameters with correct "
               "types"}],
}  # fmt: skip


HI_CHAT = {"messages": [{"role": "user", "content": "Hi"}], "model": "tiny"}


def _forced_schema(srv: SimpleNamespace, response_id: str) -> dict:
    return srv.engine.params[response_id + "-0"].structured_outputs.json


def test_agents_output_type_with_a_forced_tool_choice(srv: SimpleNamespace) -> None:
    """A forced call beside response_format / text.format json_schema: the call's schema
    constrains this turn, as vLLM lets the tool's schema win; the format shapes the free answer
    of a later turn. Before, a 400 ("cannot be combined with a forced 'tool_choice'") on both
    APIs, so such an agent never ran."""
    srv.engine.script = '{"city": "Oslo"}'
    status, r = _post(srv, "/v1/chat/completions", AGENTS_CHAT_FORCED)
    assert status == 200, r
    (call,) = r["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert _forced_schema(srv, r["id"]) == CITY

    srv.engine.script = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    status, r = _post(srv, "/v1/responses", AGENTS_RESPONSES_FORCED)
    assert status == 200, r
    (call,) = r["output"]
    assert call["type"] == "function_call" and call["arguments"] == '{"city": "Oslo"}'
    assert _forced_schema(srv, r["id"])["type"] == "array"  # the "required" call list
    assert r["text"]["format"]["name"] == "final_output"  # echoed as sent

    srv.engine.script = '{"city": "Paris", "temp": 20}'
    status, r = _post(srv, "/v1/responses", INSTRUCTOR_RESPONSES)
    assert status == 200, r
    assert [(o["type"], o["name"]) for o in r["output"]] == [("function_call", "Weather")]
    events = typed_events(srv.http, "/v1/responses", INSTRUCTOR_RESPONSES)  # create_partial
    args = "".join(e["delta"] for e in events if e["type"].endswith("arguments.delta"))
    assert args == '{"city": "Paris", "temp": 20}' and events[-1]["type"] == "response.completed"


@pytest.mark.parametrize(
    ("body", "param"),
    [  # what stays refused beside a forced call (vLLM refuses these too)
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"structured_outputs": {"json": OUT}}, "structured_outputs"),
        ({"guided_json": OUT}, "guided_json"),
    ],
)
def test_other_constraints_beside_a_forced_call_are_refused(
    srv: SimpleNamespace, body: dict, param: str
) -> None:
    plain = {k: v for k, v in AGENTS_CHAT_FORCED.items() if k != "response_format"}
    status, r = _post(srv, "/v1/chat/completions", {**plain, **body})
    assert status == 400 and r["error"]["param"] == param, r


def test_vllm_sampling_extras_on_responses(srv: SimpleNamespace) -> None:
    """pydantic-ai's model_settings={"extra_body": {"top_k": 5, "repetition_penalty": 1.05}}
    (the Agents SDK's ModelSettings(extra_body=...) alike): vLLM's ResponsesRequest takes its
    sampling extras. Before, "Unrecognized request argument supplied: top_k"."""
    srv.engine.script = "Hi"
    body = {
        "include": ["message.output_text.logprobs"], "input": [{"role": "user", "content": "Hi"}],
        "max_output_tokens": 50, "model": "tiny", "stream": False, "temperature": 0.3,
        "top_logprobs": 2, "top_p": 0.9, "user": "u", "top_k": 5, "repetition_penalty": 1.05,
    }  # fmt: skip
    status, r = _post(srv, "/v1/responses", body)
    assert status == 200, r
    params = srv.engine.params[r["id"] + "-0"]
    assert (params.top_k, params.repetition_penalty, params.temperature) == (5, 1.05, 0.3)
    more = {"stop": ["zz"], "ignore_eos": True, "include_stop_str_in_output": True}
    status, r = _post(srv, "/v1/responses", {**body, **more, "max_output_tokens": 4})
    assert status == 200, r
    params = srv.engine.params[r["id"] + "-0"]
    got = (params.stop, params.ignore_eos, params.include_stop_str_in_output)
    assert got == (["zz"], True, True)
    status, r = _post(srv, "/v1/responses", {**body, "top_k": "x"})  # checked as chat checks it
    assert status == 400 and r["error"]["param"] == "top_k", r


@pytest.mark.parametrize(
    ("path", "body"),
    [  # Agent(model_settings={"thinking": False}) with pydantic-ai's VLLMProvider; the Agents SDK's
        # ModelSettings(reasoning=Reasoning(effort="minimal")) over the Responses API
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                  "model": "tiny", "reasoning_effort": "none", "stream": False}),
        ("/v1/responses", {"include": [], "input": [{"content": "Hi", "role": "user"}],
                           "model": "tiny", "reasoning": {"effort": "minimal"}, "tools": []}),
    ],
)  # fmt: skip
def test_openai_reasoning_efforts_are_served(srv: SimpleNamespace, path: str, body: dict) -> None:
    """OpenAI's efforts beyond low / medium / high, which vLLM takes: "none" is how pydantic-ai
    turns thinking off. As in vLLM, an effort also sets the template's `enable_thinking`
    ("none": false), unless chat_template_kwargs set it. Before, a 400 naming the effort."""
    srv.engine.script = "Hi"
    effort = body.get("reasoning_effort") or body["reasoning"]["effort"]
    status, r = _post(srv, path, body)
    assert status == 200, r
    rendered = srv.app.tokenizer.template_vars
    assert rendered["reasoning_effort"] == effort
    assert rendered["enable_thinking"] is (effort != "none")
    kwargs = {"chat_template_kwargs": {"enable_thinking": True}}
    if path == "/v1/chat/completions":  # the request's own switch wins
        assert _post(srv, path, {**body, **kwargs})[0] == 200
        assert srv.app.tokenizer.template_vars["enable_thinking"] is True
    status, r = _post(srv, "/v1/chat/completions", {**HI_CHAT, "reasoning_effort": "max"})
    assert status == 400 and r["error"]["param"] == "reasoning_effort", r


# ---- what passed (kept so it stays so) ------------------------------------------------------
def test_agents_responses_tool_round_trip_with_reasoning(srv: SimpleNamespace) -> None:
    """Runner.run_streamed over the Responses API: a streamed call (item added, argument
    deltas, done events in order), then the next turn sending back the reasoning item, the
    call (with its `id` and `status`) and its output, as the SDK stores them."""
    body = {"include": [], "input": [{"content": "Weather in Rome?", "role": "user"}],
            "instructions": "x", "model": "tiny", "tools": [AGENTS_TOOL]}  # fmt: skip
    srv.engine.script = '<think>plan</think><tool_call>\n{"name": "get_weather", "arguments": ' \
        '{"city": "Rome"}}\n</tool_call>'  # fmt: skip
    events = typed_events(srv.http, "/v1/responses", body)
    kinds = [e["type"] for e in events if not e["type"].endswith(".delta")]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-4:] == [
        "response.output_item.added", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    done = events[-1]["response"]
    reasoning, call = done["output"]
    assert call["arguments"] == '{"city": "Rome"}' and call["status"] == "completed"
    assert done["usage"]["output_tokens_details"]["reasoning_tokens"] == len("plan")
    srv.engine.script = "Sunny in Rome"
    follow = {**body, "input": [
        *body["input"],
        {"id": reasoning["id"], "summary": [], "type": "reasoning", "status": "completed",
         "content": [{"text": "plan", "type": "reasoning_text"}]},
        {"arguments": call["arguments"], "call_id": call["call_id"], "name": "get_weather",
         "type": "function_call", "id": call["id"], "status": "completed"},
        {"call_id": call["call_id"], "output": "Sunny in Rome", "type": "function_call_output"},
    ]}  # fmt: skip
    status, r = _post(srv, "/v1/responses", follow)
    assert status == 200, r
    assert r["output"][-1]["content"][0]["text"] == "Sunny in Rome"


def test_pydantic_ai_chat_history_with_reasoning_and_required_output_tool(
    srv: SimpleNamespace,
) -> None:
    """pydantic-ai sends an earlier answer's thinking back as the assistant's `reasoning`
    (the template sees it), and a structured output_type as a `final_result` tool with
    tool_choice "required"."""
    srv.engine.script = "Bye"
    body = {"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "reasoning": "plan", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny in Oslo"},
    ], "model": "tiny", "stream": True, "stream_options": {"include_usage": True},
        "tool_choice": "auto", "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "Get the weather for a city.",
            "parameters": {"additionalProperties": False, "properties": {"city": {"type":
                "string"}}, "required": ["city"], "type": "object"}, "strict": True}}],
    }  # fmt: skip
    *chunks, last = srv.http.stream(body, "/v1/chat/completions")
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Bye"
    assert last["usage"]["completion_tokens"] == 4
    assert srv.app.tokenizer.messages[1]["reasoning_content"] == "plan"  # what the template reads
    final = {"type": "function", "function": {
        "name": "final_result", "description": "The final response which ends this conversation",
        "parameters": {"properties": {"city": {"type": "string"}, "temp": {"type": "integer"}},
                       "required": ["city", "temp"], "type": "object",
                       "additionalProperties": False}, "strict": True}}  # fmt: skip
    srv.engine.script = '[{"name": "final_result", "parameters": {"city": "Rome", "temp": 3}}]'
    body = {"messages": [{"role": "user", "content": "Weather?"}], "model": "tiny",
            "stream": False, "tool_choice": "required", "tools": [final]}  # fmt: skip
    status, r = _post(srv, "/v1/chat/completions", body)
    assert status == 200, r
    (call,) = r["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "final_result"
    assert r["choices"][0]["finish_reason"] == "tool_calls"


def test_instructor_parallel_tools_and_json_schema(srv: SimpleNamespace) -> None:
    """Mode.PARALLEL_TOOLS: tool_choice "auto", every call read from `tool_calls`;
    Mode.JSON_SCHEMA: response_format json_schema, the object read from `content`."""
    schema = {"properties": {"city": {"title": "City", "type": "string"},
                             "temp": {"title": "Temp", "type": "integer"}},
              "required": ["city", "temp"], "type": "object"}  # fmt: skip
    tool = {"type": "function", "function": {
        "name": "Weather", "description": "Correctly extracted `Weather` with all the required "
        "parameters with correct types", "parameters": schema}}  # fmt: skip
    srv.engine.script = "\n".join(
        f'<tool_call>\n{{"name": "Weather", "arguments": {{"city": "{c}", "temp": 1}}}}\n'
        "</tool_call>"
        for c in "AB"
    )
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "model": "tiny",
            "tool_choice": "auto", "tools": [tool]}  # fmt: skip
    status, r = _post(srv, "/v1/chat/completions", body)
    assert status == 200, r
    calls = r["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == [
        '{"city": "A", "temp": 1}', '{"city": "B", "temp": 1}'
    ]  # fmt: skip
    srv.engine.script = '{"city": "Paris", "temp": 20}'
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "model": "tiny",
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "Weather", "schema": {**schema, "title": "Weather"}}}}  # fmt: skip
    status, r = _post(srv, "/v1/chat/completions", body)
    assert status == 200 and r["choices"][0]["message"]["content"] == srv.engine.script, r
    assert _forced_schema(srv, r["id"]) == {**schema, "title": "Weather"}


# ---- smolagents 1.26 / autogen-agentchat + autogen-ext 0.7.5 / llama-index-llms-openai-like 0.8
# ---- / haystack-ai 3.4 (openai 2.54 underneath): captured the same way; all of them passed -----
# (smolagents' system prompts, thousands of tokens, are cut to their first sentence here)
SMOL_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the weather.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string",
     "description": "the city"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "final_answer", "description":
     "Provides a final answer to the given problem.", "parameters": {"type": "object",
     "properties": {"answer": {"type": "string", "description": "The final answer to the "
     "problem"}}, "required": ["answer"]}}},
]  # fmt: skip
SMOL_TASK = [
    {"role": "system", "content": [{"type": "text", "text": "You are an expert assistant who "
     "can solve any task using tool calls."}]},
    {"role": "user", "content": [{"type": "text", "text": "New task:\nWeather in Oslo?"}]},
]  # fmt: skip


def _streamed_calls(chunks: list[dict]) -> dict[int, dict]:
    """Tool-call deltas merged by index, as the openai SDK's stream helpers merge them."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            for d in choice["delta"].get("tool_calls") or []:
                call = calls.setdefault(d["index"], {"id": d.get("id"), "name": "", "args": ""})
                fn = d.get("function") or {}
                call["name"] += fn.get("name") or ""
                call["args"] += fn.get("arguments") or ""
    return calls


def test_smolagents_tool_calling_agent(srv: SimpleNamespace) -> None:
    """ToolCallingAgent (OpenAIServerModel): tool_choice "required" beside stop strings,
    content as text parts; the next turn replays the call as assistant text and the
    observation as a user turn. Streamed (stream_outputs=True), every call's id and name come
    in its first delta and the arguments concatenate to the JSON the agent parses."""
    body = {"messages": SMOL_TASK, "model": "tiny", "stop": ["Observation:", "Calling tools:"],
            "tool_choice": "required", "tools": SMOL_TOOLS}  # fmt: skip
    srv.engine.script = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    status, r = _post(srv, "/v1/chat/completions", body)
    assert status == 200, r
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    follow = {**body, "messages": [
        *SMOL_TASK,
        {"role": "assistant", "content": [{"type": "text", "text": "Calling tools:\n[{'id': '"
         + call["id"] + "', 'type': 'function', 'function': {'name': 'get_weather', "
         "'arguments': {'city': 'Oslo'}}}]"}]},
        {"role": "user", "content": [{"type": "text", "text": "Observation:\nSunny in Oslo"}]},
    ], "stream_options": {"include_usage": True}}  # fmt: skip
    srv.engine.script = '[{"name": "final_answer", "parameters": {"answer": "Sunny"}}]'
    *chunks, last = srv.http.stream(follow, "/v1/chat/completions")
    assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    (streamed,) = _streamed_calls(chunks).values()
    assert streamed["id"] and streamed["name"] == "final_answer"
    assert streamed["args"] == '{"answer": "Sunny"}'


def test_smolagents_code_agent_stop_sequences(srv: SimpleNamespace) -> None:
    """CodeAgent: the code block ends at the "</code>" stop string, which the answer leaves
    out (stop_reason names it), streamed without a partial "</co" ever leaking; with
    use_structured_outputs_internally, a strict json_schema beside the stop strings."""
    body = {"messages": SMOL_TASK, "model": "tiny",
            "stop": ["Observation:", "Calling tools:", "</code>"]}  # fmt: skip
    srv.engine.script = "Thought: go\n<code>\nprint(get_weather('Oslo'))\n</code>\nObservation:"
    want = "Thought: go\n<code>\nprint(get_weather('Oslo'))\n"
    status, r = _post(srv, "/v1/chat/completions", body)
    assert status == 200, r
    choice = r["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (want, "stop")
    assert choice["stop_reason"] == "</code>"
    *chunks, last = srv.http.stream(
        {**body, "stream_options": {"include_usage": True}}, "/v1/chat/completions"
    )
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and last["usage"]
    schema = {"additionalProperties": False, "properties": {
        "thought": {"description": "A free form text description of the thought process.",
                    "title": "Thought", "type": "string"},
        "code": {"description": "Valid Python code snippet implementing the thought.",
                 "title": "Code", "type": "string"}},
        "required": ["thought", "code"], "title": "ThoughtAndCodeAnswer",
        "type": "object"}  # fmt: skip
    structured = {**body, "response_format": {"type": "json_schema", "json_schema": {
        "schema": schema, "name": "ThoughtAndCodeAnswer", "strict": True}}}  # fmt: skip
    srv.engine.script = '{"thought": "t", "code": "final_answer(1)"}'
    status, r = _post(srv, "/v1/chat/completions", structured)
    assert status == 200 and r["choices"][0]["message"]["content"] == srv.engine.script, r
    assert _forced_schema(srv, r["id"]) == schema


AG_SYSTEM = {"content": "You are a helpful AI assistant. Solve tasks using your tools. Reply "
             "with TERMINATE when the task has been completed.", "role": "system"}  # fmt: skip
AG_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "w",
    "parameters": {"type": "object", "properties": {"city": {"description": "city",
    "title": "City", "type": "string"}}, "required": ["city"], "additionalProperties": False},
    "strict": True}}  # fmt: skip
AG_FORMAT = {"type": "json_schema", "json_schema": {"schema": {**OUT, "title": "Weather"},
             "name": "Weather", "strict": True}}  # fmt: skip


def test_autogen_assistant_agent_tools_with_structured_output(srv: SimpleNamespace) -> None:
    """AssistantAgent(tools=..., output_content_type=Weather, reflect_on_tool_use=True) over
    OpenAIChatCompletionClient(model_info=...): the first turn sends the tools (tool_choice
    "auto") beside the json_schema response_format, and user turns carry a `name`; the
    reflection turn sends the tool result back with the format alone."""
    first = {"messages": [AG_SYSTEM, {"role": "user", "name": "user", "content": "Weather in "
             "Oslo?"}], "model": "tiny", "response_format": AG_FORMAT, "stream": False,
             "tool_choice": "auto", "tools": [AG_TOOL]}  # fmt: skip
    srv.engine.script = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' \
        "\n</tool_call>"  # fmt: skip
    status, r = _post(srv, "/v1/chat/completions", first)
    assert status == 200, r
    assert r["choices"][0]["finish_reason"] == "tool_calls"
    (call,) = r["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    reflect = {"messages": [*first["messages"], {"role": "assistant", "tool_calls": [
        {"id": call["id"], "function": call["function"], "type": "function"}], "content": None},
        {"content": "Sunny in Oslo", "role": "tool", "tool_call_id": call["id"]}],
        "model": "tiny", "response_format": AG_FORMAT, "stream": False}  # fmt: skip
    srv.engine.script = '{"city": "Oslo", "temp": 3}'
    status, r = _post(srv, "/v1/chat/completions", reflect)
    assert status == 200 and r["choices"][0]["message"]["content"] == srv.engine.script, r
    assert _forced_schema(srv, r["id"]) == {**OUT, "title": "Weather"}


def test_autogen_named_tool_choice_and_streamed_thoughts(srv: SimpleNamespace) -> None:
    """create(tools=[tool], tool_choice=tool) names the function: the call comes back with
    finish_reason "stop", as vLLM and OpenAI answer a named choice (autogen only warns).
    create_stream reads a thought only from the deltas' `reasoning_content` (vLLM's older
    name, sent beside `reasoning`), and usage only when stream_options asks for it."""
    body = {"messages": [{"role": "user", "name": "user", "content": "Weather?"}],
            "model": "tiny", "stream": False, "tools": [AG_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}  # fmt: skip
    srv.engine.script = '{"city": "Oslo"}'
    status, r = _post(srv, "/v1/chat/completions", body)
    assert status == 200, r
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    srv.engine.script = "<think>hmm</think>Hello"
    body = {"messages": [{"role": "user", "name": "user", "content": "Hi"}], "model": "tiny",
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    *chunks, last = srv.http.stream(body, "/v1/chat/completions")
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "hmm"
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "Hello"
    assert last["usage"]["prompt_tokens"] > 0 and last["choices"] == []


LI_WEATHER = {"type": "function", "function": {"name": "get_weather", "description":
    "get_weather(city: str) -> str\nGet the weather for a city.", "parameters": {"properties":
    {"city": {"title": "City", "type": "string"}}, "required": ["city"], "type": "object",
    "additionalProperties": False}, "strict": False}}  # fmt: skip


def test_llama_index_openai_like(srv: SimpleNamespace) -> None:
    """OpenAILike(is_chat_model=True, is_function_calling_model=True): structured_predict /
    as_structured_llm send the output class as the one tool with tool_choice "required" and
    parallel_tool_calls false; FunctionAgent streams with parallel_tool_calls true and merges
    the call deltas by index; OpenAILike(is_chat_model=False, logprobs=True, top_logprobs=2)
    sends /v1/completions with `logprobs` as a count and reads `top_logprobs` dicts."""
    out_tool = {"type": "function", "function": {"name": "Weather", "description": "Weather.",
                "parameters": OUT, "strict": False}}  # fmt: skip
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "model": "tiny",
            "parallel_tool_calls": False, "stream": False, "temperature": 0.1,
            "tool_choice": "required", "tools": [out_tool]}  # fmt: skip
    srv.engine.script = '[{"name": "Weather", "parameters": {"city": "Oslo", "temp": 3}}]'
    status, r = _post(srv, "/v1/chat/completions", body)
    assert status == 200, r
    (call,) = r["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "Weather", "arguments": '{"city": "Oslo", "temp": 3}'}
    agent = {**body, "parallel_tool_calls": True, "stream": True, "tool_choice": "auto",
             "tools": [LI_WEATHER]}  # fmt: skip
    srv.engine.script = "<think>x</think>" + "\n".join(
        f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{c}"}}}}\n</tool_call>'
        for c in ("Oslo", "Rome")
    )
    chunks = srv.http.stream(agent, "/v1/chat/completions")
    calls = _streamed_calls(chunks)
    assert [(c["name"], c["args"]) for c in calls.values()] == [
        ("get_weather", '{"city": "Oslo"}'), ("get_weather", '{"city": "Rome"}')
    ]  # fmt: skip
    assert len({c["id"] for c in calls.values()}) == 2
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    srv.engine.script = "Hello"
    body = {"model": "tiny", "prompt": "Hi", "logprobs": 2, "max_tokens": 10, "stream": False,
            "temperature": 0.1}  # fmt: skip
    status, r = _post(srv, "/v1/completions", body)
    assert status == 200, r
    logprobs = r["choices"][0]["logprobs"]
    assert "".join(logprobs["tokens"]) == "Hello"
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])


HS_TOOL = {"type": "function", "name": "get_weather", "description": "Get the weather for a "
           "city.", "parameters": {"properties": {"city": {"type": "string"}}, "required":
           ["city"], "type": "object", "additionalProperties": False}, "strict": False}  # fmt: skip


def test_haystack_chat_generators(srv: SimpleNamespace) -> None:
    """OpenAIChatGenerator(api_base_url=...): `n` 1 always, tools without a tool_choice and
    generation_kwargs passed through as given; OpenAIResponsesChatGenerator sends the call
    back without a `status` and its output as a list of input_text parts, after the
    reasoning item it got (content as reasoning_text parts)."""
    srv.engine.script = "Hello"
    body = {"messages": [{"role": "user", "content": "Hi"}], "model": "tiny",
            "frequency_penalty": 0, "logit_bias": {}, "max_completion_tokens": 10, "n": 1,
            "presence_penalty": 0, "seed": 1, "stop": ["x"], "stream": False,
            "temperature": 0.2, "top_p": 0.9}  # fmt: skip
    status, r = _post(srv, "/v1/chat/completions", body)
    assert status == 200 and r["choices"][0]["message"]["content"] == "Hello", r
    params = srv.engine.params[r["id"] + "-0"]
    assert (params.max_tokens, params.seed, params.stop) == (10, 1, ["x"])
    first = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]}],
             "model": "tiny", "stream": False, "tools": [HS_TOOL]}  # fmt: skip
    srv.engine.script = '<think>hmm</think><tool_call>\n{"name": "get_weather", "arguments": ' \
        '{"city": "Oslo"}}\n</tool_call>'  # fmt: skip
    status, r = _post(srv, "/v1/responses", first)
    assert status == 200, r
    reasoning, call = r["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    follow = {**first, "input": [
        *first["input"],
        {"summary": [], "id": reasoning["id"], "type": "reasoning",
         "content": reasoning["content"], "status": "completed"},
        {"type": "function_call", "name": "get_weather", "arguments": call["arguments"],
         "id": call["id"], "call_id": call["call_id"]},
        {"type": "function_call_output", "call_id": call["call_id"],
         "output": [{"type": "input_text", "text": "Sunny in Oslo"}]},
    ]}  # fmt: skip
    srv.engine.script = "It is sunny."
    status, r = _post(srv, "/v1/responses", follow)
    assert status == 200, r
    assert r["output"][-1]["content"][0]["text"] == "It is sunny."
    tool_turn = srv.app.tokenizer.messages[-1]
    assert tool_turn == {"role": "tool", "content": "Sunny in Oslo",
                         "tool_call_id": call["call_id"]}  # fmt: skip
