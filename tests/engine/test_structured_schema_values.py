"""JSON schemas that are valid JSON but not what JSON Schema allows, or boolean schemas.

- `multipleOf` must be a number greater than 0. llguidance refused 0 ("invalid multiple of")
  but served a negative one as its absolute value (`-2`: "4" and "-4" accepted, "3" not); now
  both are a ValueError naming the field and the keyword, before llguidance runs
  (work_bounds.check_multiple_of, in the schema walk of check_spec).
- The schema `true` allows any JSON value (it is the schema `{}`); before it failed with
  llguidance's "Expecting object schema to apply options" (the spacing options need an
  object). The schema `false` matches no value: a ValueError saying so, not that message.
vLLM's HTTP layer takes only an object there (pydantic `dict[str, Any]`); offline its guidance
backend fails on both booleans with the options message (backend_guidance.py
serialize_guidance_grammar / validate_guidance_grammar), and its xgrammar check skips `false`
(`if so_params.json:`).

Only subschemas are checked: `default` / `examples` holding {"pattern": "a{1000000}"} or
{"multipleOf": -1} are data (before: refused); in a real subschema (or a `$ref` target,
wherever it sits) they are refused. A structural tag's schemas are checked by their path, its
older form's JSON-text schemas too (before: not checked), and `false` there is refused saying
why (before: llguidance's "Unimplemented keys: ["not"]"; xgrammar refuses it too).
"""

from __future__ import annotations

import contextlib
import json
import re

import pytest
from test_structured_hostile import _before_llguidance

from paged_engine import LLM, GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from paged_engine.structured_output.grammar import grammar_text

llguidance = pytest.importorskip("llguidance")

_FIELD = "structured_outputs.json"
_POSITIVE = "multipleOf must be a number greater than 0"


def _number(m: object) -> dict:
    return {"type": "number", "multipleOf": m}


@pytest.mark.parametrize(
    "schema",
    [
        _number(-2),
        _number(-0.5),
        _number(0),
        _number(-0.0),
        _number(float("nan")),
        {"type": "integer", "multipleOf": -3},
        {"multipleOf": -2},  # no type: still an invalid schema
        {"type": "object", "properties": {"n": _number(-2)}},
        {"$defs": {"n": _number(-2)}, "items": {"$ref": "#/$defs/n"}, "type": "array"},
        {"anyOf": [{"type": "null"}, _number(-1)]},
    ],
)
def test_a_multiple_of_not_above_zero_is_refused(schema: dict) -> None:
    with _before_llguidance(), pytest.raises(ValueError, match=re.escape(_FIELD)) as info:
        grammar_text(StructuredOutputsParams(json=schema))
    assert _POSITIVE in str(info.value), str(info.value)


def test_a_multiple_of_in_a_structural_tags_schema_is_refused() -> None:
    tag = {
        "type": "structural_tag",
        "format": {"type": "tag", "begin": "<f>", "end": "</f>",
                   "content": {"type": "json_schema", "json_schema": _number(-2)}},
    }  # fmt: skip
    with _before_llguidance(), pytest.raises(ValueError) as info:
        grammar_text(StructuredOutputsParams(structural_tag=tag))
    assert str(info.value).startswith("structured_outputs.structural_tag"), str(info.value)
    assert _POSITIVE in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "schema",
    [
        _number(2),
        _number(0.25),
        {"type": "object", "properties": {"multipleOf": {"type": "integer"}}},  # a name
        {"const": {"multipleOf": -1}},  # a value, not a schema
    ],
)
def test_a_positive_multiple_of_and_lookalikes_pass(schema: dict) -> None:
    assert grammar_text(StructuredOutputsParams(json=schema))


def test_the_schema_true_is_the_schema_that_allows_anything(tiny_llama_dir) -> None:
    any_value = grammar_text(StructuredOutputsParams(json={}))
    for spelling in (True, "true"):
        assert grammar_text(StructuredOutputsParams(json=spelling)) == any_value
    loose = StructuredOutputsParams(json=True, whitespace_pattern=r"[ \n]*")
    assert "whitespace_flexible" in grammar_text(loose)  # the options apply as to an object
    import llguidance.hf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ll_tok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    for text in ("null", "-4.5", '"a b"', "[1, true]", '{"k": {"j": []}}'):
        matcher = llguidance.LLMatcher(ll_tok, any_value, log_level=0)
        ids = tok.encode(text, add_special_tokens=False)
        assert all(matcher.consume_token(t) for t in ids), (text, matcher.get_error())
        assert matcher.is_accepting(), text


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=128)


def test_the_engine_serves_true_and_refuses_false(llm: LLM) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=6, structured_outputs=StructuredOutputsParams(json=True)
    )
    (out,) = llm.generate(["x"], params, use_tqdm=False)
    text = out.outputs[0].text
    assert text and text.lstrip()[0] in '{["-0123456789tfn', text  # a JSON value starts
    if out.outputs[0].finish_reason == "stop":
        json.loads(text)
    for so in (
        StructuredOutputsParams(json=False),
        StructuredOutputsParams(json="false"),
        GuidedDecodingParams(json=False),
        {"json": False},
    ):
        with pytest.raises(ValueError, match=re.escape(_FIELD)) as info:
            llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
        assert "the schema `false` matches no JSON value" in str(info.value), str(info.value)
    with pytest.raises(ValueError, match=re.escape(_FIELD)) as info:
        params = SamplingParams(structured_outputs={"json": _number(-2)})
        llm.generate(["x"], params, use_tqdm=False)
    assert _POSITIVE in str(info.value)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(["x"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2


# Data is no schema: `default`, `examples`, `const` / `enum` values and unknown keywords are not
# walked for patterns or multipleOf (llguidance ignores them); every keyword that holds
# subschemas is, and so is whatever a local `$ref` points at, wherever it sits.
_HUGE = {"pattern": "a{1000000}"}
_NEGATIVE = {"multipleOf": -1}


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "default": _HUGE},
        {"type": "number", "default": _NEGATIVE},
        {"type": "object", "examples": [_HUGE, _NEGATIVE]},
        {"type": "object", "properties": {"a": {"type": "string", "examples": [[_HUGE]]}}},
        {"type": "integer", "x-data": {"items": _NEGATIVE}},  # an unknown keyword
        {"type": "array", "items": {"type": "object", "default": {"properties": {"p": _HUGE}}}},
    ],
)
def test_patterns_and_multiples_in_data_are_served(schema: dict) -> None:
    """Before, the walk went into every object of the schema: these were refused."""
    assert grammar_text(StructuredOutputsParams(json=schema))
    tag = {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": schema}}
    assert grammar_text(StructuredOutputsParams(structural_tag=tag))


def _sub(where: str, sub: dict) -> dict:
    """`sub` placed at the schema position `where`."""
    return {
        "items": {"type": "array", "items": sub},
        "prefixItems": {"type": "array", "prefixItems": [{"type": "null"}, sub]},
        "additionalProperties": {"type": "object", "additionalProperties": sub},
        "patternProperties": {"type": "object", "patternProperties": {"^x": sub}},
        "dependentSchemas": {"type": "object", "dependentSchemas": {"a": sub}},
        "allOf": {"allOf": [sub]},
        "not": {"type": "string", "not": sub},
        "then": {"if": {"type": "string"}, "then": sub, "else": {"type": "null"}},
        "contains": {"type": "array", "contains": sub},
        "propertyNames": {"type": "object", "propertyNames": sub},
        "$ref #/$defs": {"$defs": {"x": sub}, "$ref": "#/$defs/x"},
        "$ref #/components": {"components": {"x": sub}, "$ref": "#/components/x"},
        "$ref #/default": {"default": sub, "$ref": "#/default"},  # data made a schema
    }[where]


_POSITIONS = [
    "items", "prefixItems", "additionalProperties", "patternProperties", "dependentSchemas",
    "allOf", "not", "then", "contains", "propertyNames", "$ref #/$defs", "$ref #/components",
    "$ref #/default",
]  # fmt: skip


@pytest.mark.parametrize("where", _POSITIONS)
@pytest.mark.parametrize(
    ("sub", "message"),
    [
        ({"type": "string", **_HUGE}, "pattern 'a{1000000}'"),
        ({"type": "number", **_NEGATIVE}, _POSITIVE),
    ],
)
def test_the_same_keywords_in_a_subschema_are_refused(where: str, sub: dict, message: str) -> None:
    schema = _sub(where, sub)
    with _before_llguidance(), pytest.raises(ValueError, match=re.escape(_FIELD)) as info:
        grammar_text(StructuredOutputsParams(json=schema))
    assert message in str(info.value), str(info.value)
    tag = {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": schema}}
    with _before_llguidance(), pytest.raises(ValueError) as info:
        grammar_text(StructuredOutputsParams(structural_tag=tag))
    assert str(info.value).startswith("structured_outputs.structural_tag.format.json_schema"), str(
        info.value
    )
    assert message in str(info.value), str(info.value)


_FALSE = "the schema `false` matches no JSON value"


@pytest.mark.parametrize(
    ("tag", "path", "message"),
    [
        (
            {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": False}},
            "structured_outputs.structural_tag.format.json_schema",
            _FALSE,
        ),  # before: llguidance's "Unimplemented keys: ["not"]"
        (
            {"structures": [{"begin": "<a>", "schema": False, "end": "</a>"}], "triggers": ["<a"]},
            "structured_outputs.structural_tag.structures[0].schema",
            _FALSE,
        ),
        (  # the older form's schema as JSON text: before, not checked (llguidance served 1)
            {"structures": [{"begin": "<a>", "schema": json.dumps(_number(-1)), "end": "</a>"}],
             "triggers": ["<a"]},
            "structured_outputs.structural_tag.structures[0].schema",
            _POSITIVE,
        ),
    ],
)  # fmt: skip
def test_a_structural_tags_schemas_are_checked_by_their_path(
    tag: dict, path: str, message: str
) -> None:
    early = _before_llguidance() if message == _POSITIVE else contextlib.nullcontext()
    with early, pytest.raises(ValueError) as info:  # (`false`: as the tag is read)
        grammar_text(StructuredOutputsParams(structural_tag=tag))
    assert str(info.value).startswith(f"{path} is invalid"), str(info.value)
    assert message in str(info.value), str(info.value)


def test_a_structural_tags_schema_true_is_any_value() -> None:
    for tag in (
        {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": True}},
        {"structures": [{"begin": "<a>", "schema": True, "end": "</a>"}], "triggers": ["<a"]},
    ):
        assert "%json {" in grammar_text(StructuredOutputsParams(structural_tag=tag))
