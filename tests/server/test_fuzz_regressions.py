"""What a schema-driven type-confusion fuzz of every route found, kept as regressions (over the
scripted fake engine in this process, so they stay fast):

- a JSON number past a double's range (`1e999`) parsed to infinity: echoed back (a Responses
  function tool's `parameters`) it made the answer invalid JSON (`Infinity`); now a 400 naming
  where it is;
- query numbers checked with `str.isdigit` then `int()`: `limit=²` (a digit to isdigit, not to
  int) and 5000-digit values (past int()'s digit limit) were 500s on input_items and Anthropic's
  model list, and an error event inside a 200 stream for `starting_after`;
- `logit_bias` keys `"²"` / 5000 digits: 400s that named no parameter;
- /tokenize of `messages` with `tools` on a server with a tool parser refused the tools as if it
  had none;
- a chat assistant's tool-call `arguments` text (or a Responses `function_call` item's) nested
  past Python's recursion limit: json.loads raised RecursionError, a 500.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fake_engine import ScriptedEngine
from server_proc import HEADERS, serve_in_process

from paged_engine import SamplingParams

ARGS = ["--max-model-len", "256", "--served-model-name", "tiny"]
ARGS += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
HUGE = "9" * 5000  # past int()'s 4300-digit limit


@pytest.fixture(scope="module")
def srv() -> Iterator[SimpleNamespace]:
    engine = ScriptedEngine(max_model_len=256, step_time=0.0005)
    engine.script = "ok"
    with serve_in_process(ARGS, engine) as (http, app):
        yield SimpleNamespace(http=http, engine=engine, app=app)


def _raw(srv: SimpleNamespace, path: str, text: str) -> tuple[int, dict]:
    conn = srv.http.conn()
    try:
        conn.request("POST", path, text.encode(), HEADERS)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


@pytest.mark.parametrize("number", ["1e999", "-1E400", "1.5e309"])
def test_a_number_past_a_doubles_range_is_a_400(srv: SimpleNamespace, number: str) -> None:
    body = '{"input": "hi", "max_output_tokens": 2, "tools": [{"type": "function", "name": "f", '
    body += f'"parameters": {{"type": "object", "maximum": {number}}}}}]}}'
    status, err = _raw(srv, "/v1/responses", body)
    assert status == 400 and err["error"]["param"] == "tools[0].parameters.maximum", err
    assert "past a double's range" in err["error"]["message"], err
    status, ok = _raw(srv, "/v1/responses", body.replace(number, "1e308"))
    assert status == 200 and ok["tools"][0]["parameters"]["maximum"] == 1e308, ok


@pytest.mark.parametrize("limit", ["%C2%B2", HUGE])
def test_input_items_limit_that_int_refuses_is_a_400(srv: SimpleNamespace, limit: str) -> None:
    body = {"input": "hi", "max_output_tokens": 2}
    status, _, r = srv.http.request("POST", "/v1/responses", body)
    assert status == 200, r
    status, _, err = srv.http.request("GET", f"/v1/responses/{r['id']}/input_items?limit={limit}")
    assert status == 400 and err["error"]["param"] == "limit", err
    assert len(err["error"]["message"]) < 200  # the value is cut, not echoed whole
    status, _, page = srv.http.request("GET", f"/v1/responses/{r['id']}/input_items?limit=0100")
    assert status == 200 and len(page["data"]) == 1, page


def test_a_starting_after_int_refuses_is_a_400_before_the_stream(srv: SimpleNamespace) -> None:
    conn = srv.http.conn()
    body = {"input": "hi", "max_output_tokens": 2, "background": True, "stream": True}
    conn.request("POST", "/v1/responses", json.dumps(body), HEADERS)
    first = conn.getresponse().read().decode().split("data: ", 1)[1].split("\n", 1)[0]
    conn.close()
    rid = json.loads(first)["response"]["id"]
    path = f"/v1/responses/{rid}?stream=true&starting_after={HUGE}"
    status, _, err = srv.http.request("GET", path)
    assert status == 400 and err["error"]["param"] == "starting_after", err


@pytest.mark.parametrize("limit", ["%C2%B2", HUGE])
def test_anthropic_model_list_limit_that_int_refuses_is_a_400(srv: SimpleNamespace, limit) -> None:
    version = {"anthropic-version": "2023-06-01"}
    status, _, err = srv.http.request("GET", f"/v1/models?limit={limit}", headers=version)
    assert status == 400 and err["type"] == "error", err
    assert err["error"]["type"] == "invalid_request_error", err


@pytest.mark.parametrize("key", ["\u00b2", HUGE, "--5"])
def test_a_logit_bias_key_int_refuses_names_logit_bias(srv: SimpleNamespace, key: str) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "logit_bias": {key: 1}}
    status, _, err = srv.http.request("POST", "/v1/completions", body)
    assert status == 400 and err["error"]["param"] == "logit_bias", err
    with pytest.raises(ValueError, match="logit_bias must be an integer"):
        SamplingParams(logit_bias={key: 1.0})
    assert SamplingParams(logit_bias={" 7 ": 1.0}).logit_bias == {7: 1.0}


def test_tokenize_renders_tools_on_a_server_with_a_tool_parser(srv: SimpleNamespace) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    status, _, r = srv.http.request("POST", "/tokenize", body)
    assert status == 200 and r["count"] > 0, r
    assert srv.app.tokenizer.template_vars["tools"] == tools  # the template was shown them
    status, _, err = srv.http.request("POST", "/tokenize", {**body, "tool_choice": {"x": 1}})
    assert status == 400 and err["error"]["param"] == "tool_choice", err


DEEP = "[" * 100_000 + "]" * 100_000


def test_tool_call_arguments_nested_too_deep_are_a_400(srv: SimpleNamespace) -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": DEEP}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}]
    body = {"messages": messages, "max_tokens": 2}
    status, _, err = srv.http.request("POST", "/v1/chat/completions", body)
    assert status == 400 and err["error"]["param"] == "messages[1].tool_calls[0]", err
    item = {"type": "function_call", "call_id": "c", "name": "f", "arguments": DEEP}
    body = {"input": [item], "max_output_tokens": 2}
    status, _, err = srv.http.request("POST", "/v1/responses", body)
    assert status == 400 and err["error"]["param"] == "input[0].arguments", err
