"""Hostile structured-output constraints whose cost llguidance does not bound itself: refused up
front, before llguidance compiles, with a ValueError naming the field
(structured_output/work_bounds.py).

- Counted repetition (`a{1000000}`, nested counts) in a regex, a schema `pattern` or a
  `patternProperties` key: compiling took 2-5 s, each step's mask up to 1.5 s on the engine's
  step thread, and then the lexer failed after one token ("too many expressions constructed"),
  ending the output as if complete.
- A `const` object of 20k keys: 17 s to validate, 25 s to compile, then an llguidance panic.
- An `anyOf` of 2100 objects (or Lark `"a"{1000000}`): compiled, then failed after the first
  character of output, which ended there as if complete.
- A grammar failing mid-output anyway (a limit no check foresees) logs why.

The rest of the audit's cases (deep nesting, `$ref` cycles and remote `$ref`s, unsupported
keywords, unsatisfiable bounds, non-object schemas, bad choices) already failed fast; a few are
kept here as a table of the messages a client gets.
"""

from __future__ import annotations

import re
import time
from types import SimpleNamespace
from unittest import mock

import pytest

from paged_engine import LLM, SamplingParams, StructuredOutputsParams
from paged_engine.structured_output import work_bounds
from paged_engine.structured_output.grammar import grammar_text
from paged_engine.structured_output.work_bounds import (
    MAX_ALTERNATIVES,
    MAX_CONST_VALUES,
    MAX_REPEAT_PRODUCT,
    check_spec,
    repeat_product,
)

pytest.importorskip("llguidance")

_NEST = "((a{1000}){1000}){1000}"
_TAG = {
    "type": "structural_tag",
    "format": {"type": "tag", "begin": "<x>", "end": "</x>",
               "content": {"type": "regex", "pattern": "b{200000}"}},
}  # fmt: skip


@pytest.mark.parametrize(
    ("regex", "product"),
    [
        ("a{1000000}", 10**6),
        (_NEST, 10**9),
        ("(?:a{10}|b{20}){30}", 600),
        ("[a-z]{1,5}x{2,}y{,9}", 9),
        (r"\p{L}{3}\x{41}{4}", 4),  # braces of an escape are no count
        (r"\{5}[{]{7}", 7),  # an escaped brace; a brace inside a class
        ("[[a]{5}]{3}", 3),  # a nested class
        ("a{99999999999999999999}", 10**12),  # capped, never a 20-digit int
        ("plain|text*", 1),
    ],
)
def test_repeat_product(regex: str, product: int) -> None:
    assert repeat_product(regex) == product


class _Compile:
    """llguidance's LLMatcher stand-in: reaching any of it fails the test."""

    def __getattr__(self, name: str) -> None:
        raise AssertionError(f"llguidance reached ({name}): the constraint was not refused first")


def _before_llguidance() -> mock._patch:
    """The refusal must come before llguidance compiles anything (what took 2-40 s): its
    import hands back a matcher that fails the test when used (deterministic, unlike timing a
    process whose other threads may be busy)."""
    llg = SimpleNamespace(LLMatcher=_Compile())
    return mock.patch("paged_engine.structured_output.grammar.import_llguidance", lambda: llg)


def _refused(so: dict, field: str, message: str) -> None:
    with _before_llguidance(), pytest.raises(ValueError, match=re.escape(field)) as info:
        grammar_text(StructuredOutputsParams(**so))
    assert message in str(info.value), str(info.value)


def _objects(n: int, tag: int = 0) -> list[dict]:
    return [
        {
            "type": "object",
            "properties": {f"k{tag}_{i}": {"type": "integer"}},
            "required": [f"k{tag}_{i}"],
        }
        for i in range(n)
    ]


def _defs(n: int) -> dict:
    return {f"d{i}": o for i, o in enumerate(_objects(n))}


def _refs(n: int) -> list[dict]:
    return [{"$ref": f"#/$defs/d{i}"} for i in range(n)]


_HUGE_CONST = {"const": {f"k{i}": list(range(10)) for i in range(20_000)}}


@pytest.mark.parametrize(
    ("so", "message"),
    [
        ({"regex": "a{1000000}"}, f"nest to 1000000 repeats (at most {MAX_REPEAT_PRODUCT}"),
        ({"regex": _NEST}, "nest to 1000000000 repeats"),
        ({"json": {"type": "string", "pattern": "^a{1000000}$"}}, "pattern '^a{1000000}$'"),
        (
            {"json": {"type": "object", "patternProperties": {"^k{99999}$": {}}}},
            "patternProperties key '^k{99999}$'",
        ),
        ({"structural_tag": _TAG}, "pattern 'b{200000}'"),
        ({"json": _HUGE_CONST}, f"more than {MAX_CONST_VALUES} object members"),
        ({"json": {"enum": [{"a": list(range(5000))}]}}, "const / enum values"),
        (
            {"json": {"anyOf": _objects(2100)}},
            f"2100 object alternatives, more than the {MAX_ALTERNATIVES}",
        ),
        ({"json": {"oneOf": [{"anyOf": _objects(50, j)} for j in range(50)]}}, "2500 object"),
        ({"json": {"$defs": _defs(2100), "anyOf": _refs(2100)}}, "2100 object alternatives"),
        ({"json": {"anyOf": [{"type": "array", "items": o} for o in _objects(2001)]}}, "array"),
        ({"grammar": 'start: "a"{1000000}'}, "nest to 1000000 repeats"),
        ({"grammar": "start: /a{1000000}/"}, "nest to 1000000 repeats"),
        ({"grammar": 'root ::= ("a"{100}){1000}'}, "nest to 100000 repeats"),
    ],
)
def test_costly_constraints_are_refused_at_once(so: dict, message: str) -> None:
    _refused(so, f"structured_outputs.{next(iter(so))}", message)


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        ('start: a\na: b~100\nb: c~100\nc: "x"~100', "1000000 repeats through the rules "
         "start -> a -> b -> c (at most 10000"),
        ('start: A\nA: B{100}\nB: C{100}\nC: "x"{100}', "through the rules start -> A -> B"),
        ('start: "<" a ">"\na: B{2,20}\nB: /x{1000}/', "20000 repeats through the rules start"),
        ('root ::= a{100}\na ::= b{100}\nb ::= "x"{1,100}', "the rules root -> a -> b ("),
    ],
)  # fmt: skip
def test_repeats_nested_through_rules_are_refused(grammar: str, message: str) -> None:
    """Counted repeats multiply through rule references as through nested groups: `a: b~100`,
    `b: c~100`, `c: "x"~100` cost llguidance what `(("x"{100}){100}){100}` does (with terminals
    2.5 s of the compile thread, then "too many expressions constructed"; with rules, "Too many
    items" at the first mask), where the text's check saw three counts of 100 apart."""
    with pytest.raises(ValueError, match=re.escape("structured_outputs.grammar")) as info:
        grammar_text(StructuredOutputsParams(grammar=grammar))
    assert message in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "so",
    [
        {"regex": "a{10000}"},
        {"regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"},
        {"json": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{1,8}$", "maxLength": 10**9}},
        {"json": {"type": "array", "items": {"type": "integer"}, "minItems": 10**9}},
        {"json": {"const": {f"k{i}": i for i in range(500)}}},
        {"json": {"enum": [f"value-{i}" for i in range(10_000)]}},  # strings: one lexeme
        # a property named "const" / "enum" is no constant (20k such would be refused)
        {"json": {"type": "object", "properties": {"const": {"type": "string"}}}},
        {"json": {"anyOf": _objects(1900)}},
        {"json": {"$defs": _defs(100), "anyOf": [*_refs(100), *_refs(100)]}},  # one each
        {"json": {"anyOf": [{"const": f"x{i}"} for i in range(2500)]}},  # one lexeme
        {"grammar": 'start: ("a" "b"){10000}'},
        {"grammar": 'start: "{" x{3} "}"\nx: "a"'},  # braces in literals
        {"grammar": 'start: a{100} b{200}\na: "x"{50}\nb: "y"{40}'},  # side by side: 8000
        {"grammar": "start: a\na: B{100}\nB: /x{100}/"},  # 10000: at the bound
        {"grammar": 'start: x{100}\nx: "a" x | "b"'},  # recursion repeats nothing built
    ],
)
def test_ordinary_constraints_pass(so: dict) -> None:
    assert grammar_text(StructuredOutputsParams(**so))


def test_alternatives_walk_a_shared_def_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """2000 `anyOf`s each reaching one `$def` of 1000 `$ref`'d objects: each subschema's
    alternatives are found once and shared, every `$ref` text resolved once (before: the 1000 were
    walked again for each `anyOf`, 2 million resolutions, quadratic in the schema)."""
    calls = 0
    resolve = work_bounds.resolve_ref

    def counted(*args):
        nonlocal calls
        calls += 1
        return resolve(*args)

    monkeypatch.setattr(work_bounds, "resolve_ref", counted)
    uses = {f"p{i}": {"anyOf": [{"$ref": "#/$defs/big"}, {"type": "null"}]} for i in range(2000)}
    defs = {**_defs(1000), "big": {"anyOf": _refs(1000)}}
    check_spec({"type": "object", "properties": uses, "$defs": defs}, "f")
    assert calls == 1 + 1000  # each $ref text once (the schema walk shares them)
    calls = 0
    defs = {**_defs(2100), "big": {"anyOf": _refs(2100)}}
    with pytest.raises(ValueError, match="f anyOf is invalid: it holds 2100 object alt"):
        check_spec({"type": "object", "properties": uses, "$defs": defs}, "f")
    assert calls <= 2 * (2000 + 2100)  # found once, then counted once for the message


def _loop_defs(order: str) -> dict:
    """e and x reach each other (1200 objects each way round), y reaches x (2100 in all)."""
    defs = {
        "e": {"anyOf": [{"$ref": "#/$defs/x"}, *_objects(600, 1)]},
        "x": {"anyOf": [{"$ref": "#/$defs/e"}, *_objects(600, 2)]},
        "y": {"anyOf": [{"$ref": "#/$defs/x"}, *_objects(900, 3)]},
    }
    return {"$defs": {k: defs[k] for k in order}}


@pytest.mark.parametrize("order", ["exy", "yxe", "xey", "yex"])
def test_alternatives_through_a_ref_loop_are_counted_whole(order: str) -> None:
    """Subschemas on a `$ref` loop reach the same alternatives whichever is walked first (a
    memo of one found half-way round the loop would let y through with 1500)."""
    with pytest.raises(ValueError, match="it holds 2100 object alternatives"):
        check_spec(_loop_defs(order), "f")
    check_spec({"$defs": {k: v for k, v in _loop_defs(order)["$defs"].items() if k != "y"}}, "f")


# What the other hostile cases get (unchanged by this audit): (constraint, message).
_TABLE = [
    ({"json": {"$ref": "#"}}, "unresolvable $ref cycle"),
    ({"json": {"$ref": "http://127.0.0.1:9/s.json"}}, "retriever does not fetch"),
    ({"json": {"$ref": "file:///etc/passwd"}}, "retriever does not fetch"),
    ({"json": {"not": {"type": "string"}}}, 'Unimplemented keys: ["not"]'),
    ({"json": {"type": "integer", "multipleOf": 0}}, "multipleOf must be a number greater than 0"),
    ({"json": {"type": "string", "pattern": "(?=a)a"}}, "look-around"),
    ({"json": {"type": "number", "minimum": 5.5, "maximum": 1.5}}, "Unsatisfiable"),
    ({"json": [{"type": "string"}]}, "must be a JSON schema (an object, or true / false)"),
    ({"json": "{not json"}, "is not valid JSON"),
    ({"regex": r"(a)\1"}, "backreferences"),
    ({"regex": ""}, "non-empty string"),
    ({"choice": []}, "non-empty list"),
    ({"choice": [1, 2]}, "non-empty list of non-empty strings"),
    ({"choice": [f"c{i}" for i in range(100_000)]}, "at most 16384 strings"),
]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=64)


def test_the_engine_refuses_each_on_add_and_serves_on(llm: LLM) -> None:
    for so, message in [({"regex": "a{1000000}"}, "repeats"), ({"json": _HUGE_CONST}, "const")]:
        field = f"structured_outputs.{next(iter(so))}"
        with _before_llguidance(), pytest.raises(ValueError, match=re.escape(field)) as info:
            params = StructuredOutputsParams(**so)
            sp = SamplingParams(max_tokens=4, structured_outputs=params)
            llm.generate(["x"], sp, use_tqdm=False)
        assert message in str(info.value), (so, str(info.value))
    for so, message in _TABLE:
        field = f"structured_outputs.{next(iter(so))}"
        t0 = time.process_time()
        with pytest.raises(ValueError, match=re.escape(field)) as info:
            params = StructuredOutputsParams(**so)
            sp = SamplingParams(max_tokens=4, structured_outputs=params)
            llm.generate(["x"], sp, use_tqdm=False)
        assert message in str(info.value), (so, str(info.value))
        assert time.process_time() - t0 < 1.0, so
    assert not llm.llm_engine.has_unfinished_requests()
    ok = StructuredOutputsParams(choice=["yes", "no"])
    out = llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=ok), use_tqdm=False)
    assert out[0].outputs[0].text in ("yes", "no")


def test_a_grammar_failing_mid_output_logs_why(tiny_llama_dir, caplog) -> None:
    """llguidance's own limits can fail a matcher after admission (an `anyOf` of 5000 objects:
    "Current row has 5000 items; max is 2000" after the `{`); the output then ends, as in vLLM,
    and the log names the cause (before: nothing said why the output stopped)."""
    from transformers import AutoTokenizer

    from paged_engine.structured_output.manager import StructuredOutputManager

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    manager = StructuredOutputManager(tok, len(tok), [tok.eos_token_id])
    try:
        constraint = manager.new_constraint(StructuredOutputsParams(regex="ab"), [])
        assert constraint is not None
        constraint.grammar.result(timeout=60)
        bad = tok.encode("z", add_special_tokens=False)[-1]  # a token the mask never allows
        with caplog.at_level("WARNING", logger="paged_engine.structured_output"):
            assert constraint.accept(0, bad)  # the output ends
        assert f"sequence 0's grammar failed at token {bad}" in caplog.text, caplog.text
        assert "<state>" not in caplog.text  # one line, not llguidance's state dump
    finally:
        manager.shutdown()
