"""Structural tags (vLLM's `structural_tag`, xgrammar's format): the grammar accepts exactly the
texts the format describes (checked token by token with llguidance on a tokenizer), every
malformed format is a ValueError naming its path, and the engine's outputs under one match it.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from paged_engine import LLM, SamplingParams, StructuredOutputsParams
from paged_engine.structured_output.grammar import grammar_text

llguidance = pytest.importorskip("llguidance")
pytest.importorskip("llguidance.hf")

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
SMALL = {  # a random model closes it within a few tokens
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "c": {"enum": ["a", "b"]}},
    "required": ["n", "c"],
    "additionalProperties": False,
}
LEGACY = {
    "structures": [
        {"begin": "<function=weather>", "schema": CITY, "end": "</function>"},
        {"begin": "<function=now>", "schema": {"type": "object"}, "end": "</function>"},
    ],
    "triggers": ["<function="],
}


def _tag(begin: str, content: dict, end: str) -> dict:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _json(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": schema}


def _const(value: str) -> dict:
    return {"type": "const_string", "value": value}


THINK_THEN_CALLS = {
    "type": "structural_tag",
    "format": {
        "type": "sequence",
        "elements": [
            _tag("<think>", {"type": "any_text"}, "</think>"),
            _const("\n"),
            {
                "type": "tags_with_separator",
                "tags": [_tag("<tool_call>", _json(CITY), "</tool_call>")],
                "separator": "\n",
                "at_least_one": True,
            },
        ],
    },
}


def _triggered(at_least_one: bool = False, stop_after_first: bool = False) -> dict:
    return {
        "format": {
            "type": "triggered_tags",
            "triggers": ["<a ", "[b]"],
            "tags": [
                _tag("<a x>", _json(CITY), "</a>"),
                _tag("[b]", {"type": "regex", "pattern": "[0-9]{2}/[a-z]"}, "[/b]"),
            ],
            "at_least_one": at_least_one,
            "stop_after_first": stop_after_first,
        }
    }


CASES = [  # (spec, accepted texts, refused texts)
    (
        LEGACY,
        [
            "Hello",
            "",
            'Hi <function=weather>{"city": "Paris"}</function> then',
            'a<function=now>{}</function>b<function=weather>{"city": "x"}</function>',
            "a <functio",
        ],
        [
            "a<function=other>{}</function>",
            '<function=weather>{"town": "x"}</function>',
            '<function=weather>{"city": "x"}',  # a tag left open
            'x <function=weather>{"city":"x"}</function>',  # not the json spacing
        ],
    ),
    (
        THINK_THEN_CALLS,
        [
            '<think>so </think then\n</think>\n<tool_call>{"city": "x"}</tool_call>',
            '<think></think>\n<tool_call>{"city": "x"}</tool_call>\n<tool_call>{"city": "y"}'
            "</tool_call>",
        ],
        [
            "<think>a</think>\n",  # at_least_one
            '<think>a</think>\n<tool_call>{"city": "x"}</tool_call> ',
            '<think>a</think></think>\n<tool_call>{"city": "x"}</tool_call>',
        ],
    ),
    (
        _triggered(),
        ["", "free <b text", 'x <a x>{"city": "q"}</a> y [b]12/z[/b]'],
        ["x <a y>{}</a>", "[b]1/z[/b]", "[b]12/z"],
    ),
    (
        _triggered(at_least_one=True),
        ['<a x>{"city": "q"}</a>', "t[b]12/z[/b]tail[b]34/a[/b]"],
        ["no tag here", ""],
    ),
    (
        _triggered(stop_after_first=True),
        ["text only", 'x<a x>{"city": "q"}</a>'],
        ['x<a x>{"city": "q"}</a> more', "[b]12/z[/b][b]12/z[/b]"],
    ),
    (
        {
            "format": {
                "type": "sequence",
                "elements": [
                    {"type": "any_text"},
                    _const('" & / \\ ~ <x>\n'),
                    {"type": "or", "elements": [_const("A"), _json(SMALL)]},
                ],
            }
        },
        ['anything " & / \\ ~ <x>\nA', '" & / \\ ~ <x>\n{"n": 3, "c": "b"}'],
        ['" & / \\ ~ <x>\nB', "no constant at all"],
    ),
]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from paged_engine.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(str(tiny_llama_dir)))


def _accepts(tokenizer, spec, text: str) -> bool:
    grammar = grammar_text(StructuredOutputsParams(structural_tag=spec))
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer), grammar, log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


@pytest.mark.parametrize(("spec", "good", "bad"), CASES)
def test_the_grammar_takes_what_the_format_describes(tokenizer, spec, good, bad):
    for text in good:
        assert _accepts(tokenizer, spec, text), text
        assert _accepts(tokenizer, json.dumps(spec), text), text  # JSON text too
    for text in bad:
        assert not _accepts(tokenizer, spec, text), text


ROOT = "structured_outputs.structural_tag"


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("{not json", f"{ROOT} is not valid JSON"),
        ({"something": 1}, "needs 'format'"),
        ({"type": "other", "format": _const("x")}, f"{ROOT}.type"),
        ({"format": {"type": "nope"}}, f"{ROOT}.format.type 'nope'"),
        ({"format": {"type": "const_string"}}, f"{ROOT}.format.value"),
        ({"format": {"type": "const_string", "value": "x", "extra": 1}}, "unknown fields"),
        ({"format": {"type": "sequence", "elements": []}}, f"{ROOT}.format.elements"),
        (
            {"format": {"type": "sequence", "elements": [{"type": "any_text"}, _json(CITY)]}},
            f"{ROOT}.format.elements[0]: free text",
        ),
        ({"format": _tag("<a>", {"type": "or"}, "</a>")}, f"{ROOT}.format.content.elements"),
        (
            {"format": {**_triggered()["format"], "triggers": ["<c"]}},
            f"{ROOT}.format.tags[0].begin must start with exactly one",
        ),
        (
            {"format": {"type": "sequence", "elements": [_triggered()["format"], _const("x")]}},
            "triggered_tags must end the output",
        ),
        ({"format": {"type": "regex", "pattern": "(("}}, "invalid regex"),
        ({"format": _json([1])}, f"{ROOT}.format.json_schema"),
        ({"structures": [{"begin": "<a>", "schema": "{x", "end": "</a>"}]}, "schema is not valid"),
        ({"format": {**_triggered()["format"], "at_least_one": "yes"}}, "at_least_one"),
    ],
)
def test_malformed_formats_name_their_path(spec, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        grammar_text(StructuredOutputsParams(structural_tag=spec))


def test_engine_outputs_match_the_format(tiny_llama_dir):
    """Sampled outputs (a random model, n=3) are `Call: <call>{...}</call>` with the JSON
    valid: the engine masks every token outside the format."""
    fmt = {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                _const("Call: "),
                {
                    "type": "tags_with_separator",
                    "tags": [_tag("<call>", _json(SMALL), "</call>")],
                    "separator": ", ",
                    "at_least_one": True,
                    "stop_after_first": True,
                },
            ],
        },
    }
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=256)
    so = StructuredOutputsParams(structural_tag=json.dumps(fmt))
    params = SamplingParams(temperature=1.0, seed=4, n=3, max_tokens=80, structured_outputs=so)
    (out,) = llm.generate(["x"], params, use_tqdm=False)
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        m = re.fullmatch(r"Call: <call>(.*)</call>", c.text)
        assert m is not None, c.text
        jsonschema.validate(json.loads(m.group(1)), SMALL)
    llm.llm_engine.shutdown()
