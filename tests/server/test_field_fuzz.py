"""Valid requests with one to three fields replaced by hostile values (wrong types, huge and
negative numbers, unhashable lists where names go, broken schemas and grammars, ...), on every
generation and counting route: each answer is a 2xx or a 4xx carrying an error object, never a
5xx, and the server serves on. Seeded, so a failure replays. (Found: `model` as a list on
/tokenize and /detokenize, `include: [[]]` on the Responses routes: 500s before.)"""

from __future__ import annotations

import random
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fake_engine import ScriptedEngine
from server_proc import serve_in_process

M = [{"role": "user", "content": "hi"}]
BASE = {
    "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 4},
    "/v1/chat/completions": {"model": "tiny", "messages": M, "max_tokens": 4},
    "/v1/responses": {"model": "tiny", "input": "hi", "max_output_tokens": 4},
    "/v1/messages": {"model": "tiny", "messages": M, "max_tokens": 4},
    "/tokenize": {"model": "tiny", "prompt": "hi"},
    "/detokenize": {"model": "tiny", "tokens": [1, 2]},
    "/v1/responses/input_tokens": {"model": "tiny", "input": "hi"},
    "/v1/messages/count_tokens": {"model": "tiny", "messages": M},
}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
VALUES = [
    None, True, False, 0, -1, 1, 3, 2**31, 2**63, -(2**63), 1e308, -1e308, 0.5, 1e-300,
    "", "x", "\u0000", "\U0001f642", "\ufffd", [], [1], [-1], [2**40], [[1, 2]], [[]], {},
    {"a": 1}, {"type": "text"}, {"type": "json_object"}, SCHEMA,
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"pattern": "(("}}},
    {"type": "json_schema", "name": "x", "schema": {"type": "array", "minItems": 5, "maxItems": 2}},
    M,
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
    [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                           "function": {"name": "f", "arguments": "{bad"}}]}],
    [{"role": "tool", "content": "x"}], [{"role": "user"}], [{"role": "user", "content": 5}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    [{"type": "function", "name": "f", "parameters": {"type": "nope"}}],
    [{"name": "f", "input_schema": {"type": "object"}}],
    "auto", "required", "none", {"type": "function", "function": {"name": "f"}},
    {"type": "tool", "name": "f"}, {"type": "any"}, {"include_usage": True},
    {"include_usage": "yes"}, ["stop", ""], ["a"] * 50, {"1": 100}, {"99999999": 1}, {"x": 1},
    {"regex": "a+"}, {"json": {"type": "object"}}, {"choice": []}, {"grammar": "root ::= ("},
    {"structural_tag": "{"}, {"effort": "high"}, {"effort": "max"},
    {"type": "enabled", "budget_tokens": 10}, {"type": "enabled", "budget_tokens": -5},
    "a" * 3000, [1] * 300,
]  # fmt: skip
FIELDS = [
    "model", "prompt", "messages", "input", "max_tokens", "max_completion_tokens",
    "max_output_tokens", "temperature", "top_p", "top_k", "min_p", "n", "best_of", "stream",
    "stream_options", "logprobs", "top_logprobs", "echo", "stop", "stop_token_ids", "seed",
    "tools", "tool_choice", "response_format", "text", "background", "store", "include",
    "system", "tokens", "logit_bias", "min_tokens", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "use_beam_search", "length_penalty", "structured_outputs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "reasoning",
    "reasoning_effort", "instructions", "metadata", "priority", "prompt_logprobs",
    "truncate_prompt_tokens", "thinking", "parallel_tool_calls", "chat_template_kwargs",
    "add_generation_prompt", "continue_final_message", "bad_words", "allowed_token_ids",
    "return_token_ids", "skip_special_tokens", "vllm_xargs", "ignore_eos",
    "include_stop_str_in_output", "prompt_embeds", "stop_sequences", "thinking_token_budget",
    "add_special_tokens", "return_tokens_as_token_ids", "user", "cache_salt", "chat_template",
    "mm_processor_kwargs", "logprob_token_ids", "request_id", "max_tool_calls",
    "previous_response_id",
]  # fmt: skip


@pytest.fixture(scope="module")
def srv() -> Iterator[SimpleNamespace]:
    engine = ScriptedEngine(max_model_len=256, step_time=0.0002)
    engine.script = 'ok <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    args = ["--max-model-len", "256", "--served-model-name", "tiny", "--tool-call-parser"]
    args += ["hermes", "--reasoning-parser", "qwen3", "--max-logprobs", "5"]
    with serve_in_process(args, engine) as (http, _):
        yield SimpleNamespace(http=http)


@pytest.mark.parametrize("seed", range(3))
def test_mutated_requests_never_get_a_5xx(srv: SimpleNamespace, seed: int) -> None:
    rng = random.Random(seed)
    seen = set()
    for _ in range(800):
        route = rng.choice(list(BASE))
        body = dict(BASE[route])
        for field in rng.sample(FIELDS, rng.randint(1, 3)):
            body[field] = rng.choice(VALUES)
        status, _, payload = srv.http.request("POST", route, body)
        assert status < 500, (route, body, payload)
        if status >= 400:
            assert isinstance(payload, dict) and "error" in payload, (route, body, payload)
        seen.add(status // 100)
    assert seen == {2, 4}  # both kinds of answer were exercised
    assert srv.http.request("GET", "/health")[0] == 200


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/tokenize", {"model": ["tiny"], "prompt": "hi"}, "model"),
        ("/detokenize", {"model": {"a": 1}, "tokens": [1]}, "model"),
        ("/v1/responses", {"input": "hi", "include": [[]]}, "include"),
        ("/v1/responses/input_tokens", {"input": "hi", "include": [{"a": 1}]}, "include"),
    ],
)
def test_the_cases_it_found(srv: SimpleNamespace, route: str, body: dict, param: str) -> None:
    status, _, payload = srv.http.request("POST", route, body)
    assert status == 400 and payload["error"]["param"] == param, payload
