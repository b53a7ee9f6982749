"""Boolean schemas and a `multipleOf` not above 0 over HTTP, in each spelling of a JSON schema
constraint (the engine side: tests/engine/test_structured_schema_values.py).

- `multipleOf` <= 0 (JSON Schema wants > 0; llguidance served -2 as 2): a 400 naming the field
  the client used and the keyword, at once.
- A boolean schema (`true` / `false`) in any spelling: a 400 naming the field, as vLLM's request
  types (`dict` / `str | dict`) refuse it (offline, `true` is any JSON value and `false` refused:
  tests/engine/test_structured_schema_values.py).
- `response_format.json_schema.schema: {}`: any JSON value, as vLLM passes it on (before:
  changed to {"type": "object"}).
- A boolean schema where vLLM's request type is `dict[str, Any]`: a 400 naming the field (the
  older structural tag's `structures[i].schema` was served before); in a structural tag's
  `json_schema` format (xgrammar: bool or dict) `true` is served, `false` a 400 saying why.
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


@pytest.mark.parametrize("schema", [True, False])
@pytest.mark.parametrize("spelling", range(3))
def test_a_boolean_schema_is_a_400_in_every_spelling(
    fake_server: ServerProc, schema: bool, spelling: int
) -> None:
    extra, param = _spellings(schema)[spelling]
    body = {"messages": CHAT, "max_tokens": 2, **extra}
    status, _, payload = fake_server.request("POST", "/v1/chat/completions", body)
    assert status == 400, payload
    error = payload["error"]
    assert error["param"] == param and "must be an object" in error["message"], error


def test_an_empty_schema_is_any_value_as_vllm_passes_it_on() -> None:
    """`"schema": {}` is JSON Schema's any value; vLLM hands it to the engine as it is
    (structured_outputs_from_response_format: json=json_schema.json_schema). Before, it was
    changed to {"type": "object"}. An absent one is no constraint: vLLM's
    StructuredOutputsParams(json=None) refuses it, a 400 (before: {"type": "object"});
    tests/server/test_vllm_request_parity.py covers it through the routes."""
    from paged_server.errors import APIError
    from paged_server.structured_request import check_schema_given, parse_structured

    def rf(js: dict) -> dict:
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", **js}}}

    assert parse_structured(rf({"schema": {}})) == ({"json": {}}, "response_format")
    check_schema_given(*parse_structured(rf({"schema": {}})))
    spec, param = parse_structured(rf({}))
    assert (spec, param) == ({"json": None}, "response_format")
    with pytest.raises(APIError) as e:
        check_schema_given(spec, param)
    assert e.value.status == 400 and e.value.param == "response_format"


def test_an_empty_schema_is_served(real_server: ServerProc) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "response_format": rf}
    status, _, payload = real_server.request("POST", "/v1/chat/completions", body)
    assert status == 200, payload
    text = payload["choices"][0]["message"]["content"]
    assert text and text.lstrip()[0] in '{["-0123456789tfn', text


# Where vLLM's request type for a schema is `dict[str, Any]` (pydantic refuses a boolean: a 400),
# a boolean schema is a 400 naming the field: the Responses API's `text.format.schema`
# (openai's ResponseFormatTextJSONSchemaConfig.schema_: Dict[str, object]), tool `parameters`
# (FunctionDefinition.parameters; openai's FunctionTool.parameters), Anthropic's
# `output_config.format.schema` (AnthropicJsonOutputFormat.json_schema) and `input_schema`
# (AnthropicTool), and the older structural tag's `structures[i].schema`
# (LegacyStructuralTag.structural_tag_schema). xgrammar's `json_schema` format takes one
# (JSONSchemaFormat.json_schema: bool | dict): `true` is served, `false` refused by its compiler.
RESPONSES = {"input": "Hi", "max_output_tokens": 4}
MESSAGES = {"model": "m", "messages": CHAT, "max_tokens": 4}


def _chat_tool(schema: object) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": schema}}


def _openai_cases(schema: bool) -> list[tuple[str, dict, str, str]]:
    """(path, body, the param a 400 names, a fragment of its message)."""
    legacy = {"type": "structural_tag", "triggers": ["<a"],
              "structures": [{"begin": "<a>", "schema": schema, "end": "</a>"}]}  # fmt: skip
    return [
        (
            "/v1/responses",
            {**RESPONSES, "text": {"format": {"type": "json_schema", "name": "x",
                                              "schema": schema}}},
            "text.format.schema",
            "'text.format.schema' must be a JSON schema object",
        ),
        (
            "/v1/responses",
            {**RESPONSES, "tool_choice": "required",
             "tools": [{"type": "function", "name": "f", "parameters": schema}]},
            "tools[0].parameters",
            "tools[0].parameters must be a dict",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "max_tokens": 4, "tool_choice": "required",
             "tools": [_chat_tool(schema)]},
            "tools[0]",
            "tools[0].function.parameters must be a JSON schema object",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "max_tokens": 4, "response_format": legacy},
            "response_format",
            "'response_format.structures[0].schema' must be an object",
        ),
    ]  # fmt: skip


@pytest.mark.parametrize("schema", [True, False])
@pytest.mark.parametrize("case", range(4))
def test_a_boolean_schema_where_vllm_takes_an_object_is_a_400(
    fake_server: ServerProc, schema: bool, case: int
) -> None:
    path, body, param, fragment = _openai_cases(schema)[case]
    status, _, payload = fake_server.request("POST", path, body)
    assert status == 400, payload
    error = payload["error"]
    assert error["param"] == param and fragment in error["message"], error


@pytest.mark.parametrize("schema", [True, False])
@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (lambda s: {"output_config": {"format": {"type": "json_schema", "schema": s}}},
         "output_config.format.schema must be an object"),
        (lambda s: {"tools": [{"name": "f", "input_schema": s}], "tool_choice": {"type": "any"}},
         "tools[0].input_schema must be an object"),
    ],
)  # fmt: skip
def test_a_boolean_schema_in_anthropics_messages_is_a_400(
    fake_server: ServerProc, schema: bool, extra, fragment: str
) -> None:
    status, _, payload = fake_server.request("POST", "/v1/messages", {**MESSAGES, **extra(schema)})
    assert status == 400, payload
    assert payload["type"] == "error", payload
    assert payload["error"]["message"].startswith(fragment), payload


def _format_tag(schema: object) -> dict:
    return {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": schema}}


def test_a_structural_tags_json_schema_format_false_is_a_400_saying_why(
    fake_server: ServerProc,
) -> None:
    """Before: llguidance's "Unimplemented keys: ["not"]" (false was sent on as {"not": {}})."""
    for extra, param in (
        ({"response_format": _format_tag(False)}, "response_format"),
        ({"structured_outputs": {"structural_tag": json.dumps(_format_tag(False))}},
         "structured_outputs"),
    ):  # fmt: skip
        body = {"messages": CHAT, "max_tokens": 2, **extra}
        status, _, payload = fake_server.request("POST", "/v1/chat/completions", body)
        assert status == 400, payload
        error = payload["error"]
        assert error["param"] == param, error
        assert "structural_tag.format.json_schema is invalid: the schema `false` matches no JSON" \
            in error["message"], error  # fmt: skip


def test_a_structural_tags_json_schema_format_true_is_served(real_server: ServerProc) -> None:
    body = {"messages": CHAT, "max_tokens": 4, "temperature": 0,
            "response_format": _format_tag(True)}  # fmt: skip
    status, _, payload = real_server.request("POST", "/v1/chat/completions", body)
    assert status == 200, payload
