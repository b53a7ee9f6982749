"""SageMaker's `POST /invocations` (app.py): the body's fields choose the API, whose answer comes
back as that route gives it."""

from __future__ import annotations

import pytest
from server_proc import API_KEY, ServerProc

CASES = [
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, "/v1/chat/completions"),
    ({"prompt": "hello", "max_tokens": 3}, "/v1/completions"),
    ({"input": ["hello", "world"]}, "/v1/embeddings"),
    ({"queries": "a b", "documents": ["c", "d"]}, "/score"),
    ({"text_1": "a b", "text_2": "c"}, "/score"),
    ({"query": "a b", "documents": ["c", "d"], "top_n": 1}, "/rerank"),
]


@pytest.mark.parametrize(("body", "route"), CASES)
def test_invocations_answers_as_the_route_its_body_names(real_server: ServerProc, body, route):
    body = {**body, "temperature": 0.0} if "max_tokens" in body else body
    status, _, got = real_server.request("POST", "/invocations", body)
    assert status == 200, got
    status, _, want = real_server.request("POST", route, body)
    assert status == 200, want
    for key in ("id", "created", "system_fingerprint"):
        got.pop(key, None), want.pop(key, None)
    assert got == want


def test_invocations_streams_and_refuses_an_unknown_body(real_server: ServerProc) -> None:
    body = {"prompt": "hello", "max_tokens": 2, "stream": True}
    status, _, text = real_server.request("POST", "/invocations", body)
    assert status == 200 and text.rstrip().endswith("data: [DONE]"), text
    for bad in ({"nothing": 1}, [1, 2], {"documents": ["x"]}):
        status, _, r = real_server.request("POST", "/invocations", bad)
        assert status == 400 and r["error"]["type"] == "invalid_request_error", r
    # a bad body of the chosen API is that API's 400, naming its parameter
    status, _, r = real_server.request("POST", "/invocations", {"prompt": "x", "max_tokens": -1})
    assert status == 400 and r["error"]["param"] == "max_tokens", r


def test_the_api_key_guards_invocations(guarded_server: ServerProc) -> None:
    status, _, r = guarded_server.request("POST", "/invocations", {"prompt": "x"})
    assert status == 401, r
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": "x", "max_tokens": 1}
    status, _, r = guarded_server.request("POST", "/invocations", body, headers=headers)
    assert status == 200, r
