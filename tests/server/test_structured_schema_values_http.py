"""Boolean schemas and a `multipleOf` not above 0 over HTTP, in each spelling of a JSON schema
constraint (the engine side: tests/engine/test_structured_schema_values.py).

- `multipleOf` <= 0 (JSON Schema wants > 0; llguidance served -2 as 2): a 400 naming the field
  the client used and the keyword, at once.
- The schema `false` (no JSON value matches): a 400 saying so (before: llguidance's
  "Expecting object schema to apply options" for guided_json / structured_outputs, and
  "'response_format.json_schema.schema' must be an object" for response_format).
- The schema `true`: any JSON value, served (before: the same two 400s).
"""

from __future__ import annotations

import json

import pytest
from server_proc import ServerProc

pytest.importorskip("llguidance")

CHAT = [{"role": "user", "content": "Hi"}]


def _spellings(schema: object) -> list[tuple[dict, str]]:
    """(the request's extra fields, the field a 400 names) for each way to send `schema`."""
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return [
        ({"response_format": rf}, "response_format"),
        ({"guided_json": schema}, "guided_json"),
        ({"structured_outputs": {"json": schema}}, "structured_outputs"),
    ]


@pytest.mark.parametrize(
    ("extra", "param", "fragment"),
    [
        *[(e, p, "multipleOf must be a number greater than 0, got -2") for e, p in
          _spellings({"type": "object", "properties": {"n": {"type": "integer",
                                                              "multipleOf": -2}}})],
        *[(e, p, "multipleOf must be a number greater than 0, got 0") for e, p in
          _spellings({"type": "number", "multipleOf": 0})],
        *[(e, p, "the schema `false` matches no JSON value") for e, p in _spellings(False)],
    ],
)  # fmt: skip
def test_refused_with_a_400_naming_the_field(
    fake_server: ServerProc, extra: dict, param: str, fragment: str
) -> None:
    body = {"messages": CHAT, "max_tokens": 2, **extra}
    status, _, payload = fake_server.request("POST", "/v1/chat/completions", body)
    assert status == 400, payload
    error = payload["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400, error
    assert error["param"] == param and fragment in error["message"], error
    assert "structured_outputs.json" in error["message"], error


@pytest.mark.parametrize(("extra", "param"), _spellings(True))
def test_the_schema_true_is_served(real_server: ServerProc, extra: dict, param: str) -> None:
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0, **extra}
    status, _, payload = real_server.request("POST", "/v1/chat/completions", body)
    assert status == 200, (param, payload)
    choice = payload["choices"][0]
    text = choice["message"]["content"]
    assert text and text.lstrip()[0] in '{["-0123456789tfn', text  # a JSON value starts
    if choice["finish_reason"] == "stop":
        json.loads(text)
