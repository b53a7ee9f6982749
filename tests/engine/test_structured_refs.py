"""JSON schemas whose `$ref`s loop without reaching a value (llguidance builds them, then fails
to fill a mask: "NoExtensionBias", after admission or mid-output) are refused when the request
is added, with a ValueError naming the field and the loop; recursion through an object or an
array still generates valid JSON. A thread that cannot start for the grammar check is the
server's state (`GrammarBusyError`), not the request's: nothing is queued, the engine serves on.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jsonschema
import pytest

from paged_engine import LLM, SamplingParams, StructuredOutputsParams
from paged_engine.core.step_isolation import RequestFailedError
from paged_engine.structured_output import grammar
from paged_engine.structured_output.schema_refs import ref_cycle

pytest.importorskip("llguidance")


def _defs(root: dict, **defs: dict) -> dict:
    return {**root, "$defs": defs}


A, B, C = ({"$ref": f"#/$defs/{n}"} for n in "abc")
# (schema, the loop the error names)
LOOPS = {
    "mutual": (_defs(A, a=B, b=A), "#/$defs/a -> #/$defs/b -> #/$defs/a"),
    "self": (_defs(A, a=A), "#/$defs/a -> #/$defs/a"),
    "three": (_defs(A, a=B, b=C, c=A), "#/$defs/a -> #/$defs/b -> #/$defs/c -> #/$defs/a"),
    "root": ({"$ref": "#"}, "# -> #"),
    "definitions": (
        {"definitions": {"a": {"$ref": "#/definitions/a"}}, "$ref": "#/definitions/a"},
        "#/definitions/a -> #/definitions/a",
    ),
    "allOf": (_defs(A, a={"allOf": [A]}), "#/$defs/a -> #/$defs/a/allOf/0 -> #/$defs/a"),
    "anyOf": (_defs(A, a={"anyOf": [B]}, b={"anyOf": [A]}), "#/$defs/a/anyOf/0 -> #/$defs/b"),
    "oneOf": (_defs(A, a={"oneOf": [A]}), "#/$defs/a -> #/$defs/a/oneOf/0 -> #/$defs/a"),
    # reached mid-output: llguidance fails once the model wrote `{"x": ` / `{"k": `
    "optional_property": (
        _defs({"type": "object", "properties": {"x": A}}, a=B, b=A),
        "#/$defs/a -> #/$defs/b -> #/$defs/a",
    ),
    "additional_properties": (
        _defs({"type": "object", "additionalProperties": A}, a=A),
        "#/$defs/a -> #/$defs/a",
    ),
    "pointer_into_properties": (
        {
            "type": "object",
            "properties": {"x": {"$ref": "#/properties/y"}, "y": {"$ref": "#/properties/x"}},
        },
        "#/properties/x -> #/properties/y -> #/properties/x",
    ),
}
LINKED_LIST = _defs(
    A,
    a={
        "type": "object",
        "properties": {"v": {"enum": [1, 2]}, "next": {"anyOf": [A, {"type": "null"}]}},
        "required": ["v", "next"],
        "additionalProperties": False,
    },
)
TREE = _defs(
    A,
    a={
        "type": "object",
        "properties": {
            "v": {"type": "integer", "minimum": 0, "maximum": 9},
            "kids": {"type": "array", "items": A, "maxItems": 2},
        },
        "required": ["v"],
        "additionalProperties": False,
    },
)
# fine: each loop passes through an object or an array, or has a way out
RECURSIVE = {
    "linked_list": LINKED_LIST,
    "tree": TREE,
    "root_children": {
        "type": "object",
        "properties": {"c": {"type": "array", "items": {"$ref": "#"}}},
    },
    "anyOf_way_out": _defs(A, a={"anyOf": [A, {"type": "integer"}]}),
    "unreached_loop": _defs({"type": "integer"}, a=B, b=A),
    "chain": _defs(
        {"$ref": "#/$defs/d0"},
        **{f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(500)},
        d500={"type": "integer"},
    ),
}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=512)


def _params(max_tokens: int = 200, **so) -> SamplingParams:
    so_params = StructuredOutputsParams(**so)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so_params)


def _serves_on(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine.engine_core.num_compiling == 0
    out = llm.generate(["x"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize("name", list(LOOPS))
def test_a_ref_loop_is_refused_on_add(llm, name):
    schema, loop = LOOPS[name]
    with pytest.raises(ValueError, match=r"^structured_outputs\.json is invalid: unresolv") as e:
        llm.generate(["x"], _params(json=schema), use_tqdm=False)
    assert loop in str(e.value)
    _serves_on(llm)


def test_a_ref_loop_in_a_structural_tag_is_refused_on_add(llm):
    schema, _ = LOOPS["mutual"]
    tag = {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": schema}}
    with pytest.raises(ValueError, match=r"structural_tag\.format\.json_schema is invalid: unre"):
        llm.generate(["x"], _params(structural_tag=tag), use_tqdm=False)
    _serves_on(llm)


@pytest.mark.parametrize("name", ["linked_list", "tree"])
def test_recursion_through_objects_generates_valid_json(llm, name):
    """Sampled outputs end (the random model takes the way out) and validate; some recurse."""
    schema = RECURSIVE[name]
    so = StructuredOutputsParams(json=schema)
    params = SamplingParams(temperature=1.0, seed=0, n=8, max_tokens=200, structured_outputs=so)
    (out,) = llm.generate(["List:"], params, use_tqdm=False)
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)
    assert max(c.text.count('"v"') for c in out.outputs) >= 2  # a nested node


@pytest.mark.parametrize("name", list(RECURSIVE))
def test_recursion_with_a_way_out_passes_the_check(name):
    assert ref_cycle(RECURSIVE[name]) is None
    grammar.grammar_text(StructuredOutputsParams(json=RECURSIVE[name]))  # no ValueError


def test_a_thread_that_cannot_start_is_grammar_busy_and_the_engine_serves_on(llm, monkeypatch):
    """`can't start new thread` for the big-stack check: GrammarBusyError (a RuntimeError the
    server answers 503), nothing queued, nothing cached; the same request passes once threads
    start again."""

    def cannot_start(fn, args):
        raise RuntimeError("can't start new thread")

    schema = {
        "type": "object",
        "properties": {"busy": {"enum": [1, 2]}},
        "required": ["busy"],
        "additionalProperties": False,
    }
    monkeypatch.setattr(grammar, "_thread", SimpleNamespace(start_new_thread=cannot_start))
    with pytest.raises(grammar.GrammarBusyError, match=re.escape("can't start new thread")):
        llm.generate(["x"], _params(json=schema), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    monkeypatch.undo()
    (out,) = llm.generate(["x"], _params(json=schema), use_tqdm=False)
    jsonschema.validate(json.loads(out.outputs[0].text), schema)
    _serves_on(llm)


def test_a_grammar_matching_nothing_fails_with_a_readable_cause(llm):
    """A terminal matching nothing (`"a" & "b"`) is not analysed up front (a rule loop such
    as `a: a` is: grammar_rules.py): compiling finds it, and the request fails after admission
    naming the field, with a one-line cause (not llguidance's parser-state dump)."""
    with pytest.raises(RequestFailedError) as e:
        llm.generate(["x"], _params(grammar='start: A\nA: "a" & "b"'), use_tqdm=False)
    cause = str(e.value.cause)
    assert cause.startswith("structured_outputs.grammar: grammar rejected for this tokenizer: ")
    assert "no output can match it" in cause and "\n" not in cause, cause
    _serves_on(llm)
