"""Lark / GBNF grammars with a rule that can never end (no base case) are refused when the
request is added, naming the rule (`structured_output/grammar_rules.py`): before, llguidance
admitted them and the request ended quietly mid-output (finish_reason "stop", text "ac" for
`start: "a" x | "b"` with `x: "c" x`). Grammars that can always finish are accepted: real-world
ones, every llguidance syntax feature, recursion with a way out, dead alternatives whose every
prefix a live one also matches, and text the reader does not follow (no verdict).
"""

from __future__ import annotations

import re
import time

import pytest

from paged_engine import LLM, SamplingParams, StructuredOutputsParams
from paged_engine.structured_output import grammar, grammar_rules
from paged_engine.structured_output.grammar_rules import gbnf_names, stuck_rules
from paged_engine.structured_output.lark_reader import Unreadable, read_lark

llg = pytest.importorskip("llguidance")

JSON_LARK = r"""
start: value
?value: object
      | array
      | string
      | SIGNED_NUMBER      -> number
      | "true"             -> true
      | "false"            -> false
      | "null"             -> null
array  : "[" [value ("," value)*] "]"
object : "{" [pair ("," pair)*] "}"
pair   : string ":" value
string : ESCAPED_STRING
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS
"""
JSON_LLG = r"""
%llguidance {}
start: value
value: object | array | STRING | NUMBER | "true" | "false" | "null"
object: "{" (member ("," member)*)? "}"
member: STRING ":" value
array: "[" (value ("," value)*)? "]"
STRING: /"(\\.|[^"\\])*"/
NUMBER: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/
"""
SQL_GBNF = r"""
# a small SELECT dialect
root ::= select-stmt ";"
select-stmt ::= "SELECT " columns " FROM " ident where-clause? order-by?
columns ::= "*" | ident (", " ident)*
where-clause ::= " WHERE " condition
condition ::= comparison ((" AND " | " OR ") comparison)* | "(" condition ")"
comparison ::= ident " " op " " value
op ::= "=" | "<>" | "<" | ">" | "<=" | ">="
value ::= number | "'" [^'\n]* "'"
number ::= "-"? [0-9]+ ("." [0-9]{1,6})?
order-by ::= " ORDER BY " ident (" ASC" | " DESC")?
ident ::= [a-zA-Z_] [a-zA-Z0-9_]{0,30}
"""
ARITH_GBNF = """root ::= (expr "=" ws term "\\n")+
expr ::= term ([-+*/] term)*
term ::= ident | num | "(" ws expr ")" ws
ident ::= [a-z] [a-z0-9_]* ws
num ::= [0-9]+ ws
ws ::= [ \\t\\n]*
"""
LLAMA_CPP_JSON = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
"""
TOOL_CALLS = r"""
%llguidance {}
start: TEXT? (call TEXT?)* <|eos|>?
TEXT: /[^<]+/
call: "<tool>" %json {"type": "object", "properties": {"a": {"type": "integer"}}} "</tool>"
"""
FINISHING = {
    "llama_cpp_json_gbnf": LLAMA_CPP_JSON,
    "llama_cpp_list_gbnf": 'root ::= item+\nitem ::= "- " [^\\r\\n\\x0b\\x0c]+ "\\n"',
    "tool_calls_lark": TOOL_CALLS,
    "json_lark": JSON_LARK,
    "json_llguidance": JSON_LLG,
    "sql_gbnf": SQL_GBNF,
    "arith_gbnf": ARITH_GBNF,
    "productive_recursion": 'start: "a" x | "b"\nx: "c" x | "d"',
    "gbnf_productive_recursion": 'root ::= "a" r | "z"\nr ::= "b" r | "d"',
    "left_recursion": 'start: expr\nexpr: expr "+" term | term\nterm: "1" | "(" expr ")"',
    "mutual_recursion": 'start: a\na: "x" b | "y"\nb: "z" a',
    "nullable_recursion": 'start: "<" a ">"\na: a "x" |',
    "star_way_out": 'start: "a" x\nx: ("c" x)*',
    "optional_way_out": 'start: "a" x\nx: "c" [x]',
    "question_way_out": 'start: "a" x\nx: "c" x?',
    "zero_repeat_way_out": 'start: "a" x\nx: "c" x{0,3}',
    "gbnf_repeat_way_out": 'root ::= "a" r\nr ::= "b" r{0,2}',
    "aliases_and_inline": 'start: item+\n!item: "a" -> first\n    | "b" x -> second\nx: "c"',
    "terminal_refs": 'start: A B\nA: "a" B?\nB: "b"',
    "ranges_and_case": 'start: L "x"i\nL: "a".."z"',
    "terminal_algebra": "start: A\nA: /[a-z]+/ & ~/foo/",
    "lark_repeat_tilde": 'start: "a" ~ 3',
    "lark_repeat_tilde_range": 'start: ("a" | "b")~3..5 x~0..2\nx: "c"',
    "json_and_regex_items": (
        'start: "x=" %json {"type": "integer"} | %regex {"substring_words": "a b"}'
    ),
    "attributes": 'start: "say: " t\nt[max_tokens=5, stop=""]: /[a-z ]*/',
    "lazy_rule": 'start: "<" t ">"\nt[lazy]: /.*/',
    "comments": '// c1\nstart: "a" # c2\n    | "b" // c3',
    "indented_rules": '  start: "a" x\n  x: "c" x | "d"',
    "multiline_groups": 'start: ("a"\n  | "b") "c"\n    | "d"',
    "escapes": 'start: "\\n" "\\"" "\\u00e9" /\\//',
    "dead_alt_shadowed": 'start: "a" "c"* | "a" x\nx: "c" x',  # a live path matches "ac..."
    "dead_alt_writes_nothing": 'start: x | "a"\nx: x',  # x offers no text: never entered
    "unreachable_loop": 'start: "a"\nx: "c" x',
}
# stuck, but no literal witness leads there (a regex first): left to llguidance
NOT_PROVEN = {
    "dead_alt_after_regex": 'start: /[0-9]+/ x | "1"\nx: "c" x',
    # llguidance's lexer takes "ab" whole: the witness "abc" is not taken, no proof
    "greedy_lexeme": 'start: "ab" "z" | "a" x\nx: "bc" x',
    # the live `t` may write "ac...": every prefix of the dead path is a live one too
    "shadowed_by_attributes": 'start: t | "a" x\nt[max_tokens=3]: /[a-z]+/\nx: "c" x',
}
UNREAD = {  # no verdict: llguidance judges these alone
    "template": 'start: sep{"a"}\nsep{x}: x ("," x)*',
    "extend": 'start: x\nx: "a" x\n%extend x: "b"',
    "garbage": 'start: "a" $$$',
    "no_start": 'root: "a"',
}
# grammar -> the start of the reason (after "structured_outputs.grammar is invalid: ")
STUCK = {
    "lark_start": ('start: "a" x\nx: "c" x', "rule 'start' can never end: every alternative "
                   "runs into the rule loop start -> x -> x"),
    "lark_alternative": ('start: "a" x | "b"\nx: "c" x', "rule 'x' can never end (every "
                         "alternative runs into the rule loop x -> x"),
    "gbnf_root": ('root ::= "a" r\nr ::= "b" r', "rule 'root' can never end: every alternative "
                  "runs into the rule loop root -> r -> r"),
    "gbnf_alternative": ('root ::= "a" r | "z"\nr ::= "b" r', "rule 'r' can never end"),
    "gbnf_names_as_written": ('root ::= "a" my-Rule | "z"\nmy-Rule ::= "b" my-Rule',
                              "rule 'my-Rule' can never end (every alternative runs into the "
                              "rule loop my-Rule -> my-Rule"),
    "self_only": ("start: a\na: a", "rule 'start' can never end"),
    "mutual": ('start: "(" a ")" | "-"\na: "x" b\nb: "y" a', "rule 'a' can never end (every "
               "alternative runs into the rule loop a -> b -> a"),
    "optional_entry": ('start: "a" x?\nx: "c" x', "rule 'x' can never end"),
    "star_entry": ('start: ("a" x)* "b"\nx: "c" x', "rule 'x' can never end"),
    "group_entry": ('start: "q" ("a" x | "b")\nx: "c" x', "rule 'x' can never end"),
    # `x ~ n` is `x{n}` (before: terminal algebra, not looked into)
    "tilde_entry": ('start: "a" x~2\nx: "c" x', "rule 'start' can never end"),
    "tilde_optional_entry": ('start: "a" x ~ 0..2 | "b"\nx: "c" x', "rule 'x' can never end"),
    "entered_without_text": ('start: "z" x | "a"\nx: x', "after the output 'z' nothing"),
    "deep_entry": ('start: "a" b | "q"\nb: "b" c\nc: "c" d\nd: "d" d', "rule 'b' can never "
                   "end (every alternative runs into the rule loop b -> c -> d -> d"),
    # two ways into x of one length (a heap tie that compared items and raised TypeError)
    "two_leads": ('start: "q" | "z" x\nx: "a" x | "b" x', "rule 'x' can never end"),
    "with_ignore": ('start: "a" x | "b"\nx: "c" x\n%ignore " "', "rule 'x' can never end"),
    "through_terminal": ('start: A x | "b"\nA: "a"\nx: C x\nC: "c"', "after the output 'ac'"),
    "escapes": ('start: "\\n" x | "b"\nx: "\\"" x', "after the output '\\n\"'"),
    "unicode": ('start: "é" x | "b"\nx: "ü" x', "after the output 'éü'"),
    "beside_json": ('start: %json {"type": "integer"} | "a" x\nx: "c" x', "rule 'x' can "
                    "never end"),
}  # fmt: skip
STUCK["json_array_without_end"] = (
    JSON_LLG.replace('array: "[" (value ("," value)*)? "]"', 'array: "[" value array'),
    "rule 'array' can never end (every alternative runs into the rule loop array -> array",
)


def _lark(text: str) -> str:
    lark = llg.grammar_from("grammar", text)
    assert not llg.LLMatcher.validate_grammar(lark), llg.LLMatcher.validate_grammar(lark)
    return lark


def _why(text: str) -> str | None:
    return grammar.on_big_stack(stuck_rules, _lark(text), gbnf_names(text))


@pytest.mark.parametrize("name", list(FINISHING))
def test_grammars_that_can_always_finish_are_read_and_accepted(name):
    text = FINISHING[name]
    read_lark(_lark(text))  # followed: the verdict below is the analysis', not a shrug
    assert _why(text) is None
    grammar.grammar_text(StructuredOutputsParams(grammar=text))  # no ValueError


@pytest.mark.parametrize("name", list(NOT_PROVEN))
def test_dead_alternatives_without_a_proof_are_left_to_llguidance(name):
    assert _why(NOT_PROVEN[name]) is None


@pytest.mark.parametrize("name", list(UNREAD))
def test_text_the_reader_does_not_follow_gets_no_verdict(name):
    with pytest.raises(Unreadable):
        read_lark(UNREAD[name])
    assert stuck_rules(UNREAD[name]) is None


@pytest.mark.parametrize("name", list(STUCK))
def test_a_rule_that_cannot_end_is_refused_naming_it(name):
    text, reason = STUCK[name]
    with pytest.raises(ValueError) as e:
        grammar.grammar_text(StructuredOutputsParams(grammar=text))
    assert str(e.value).startswith("structured_outputs.grammar is invalid: rule '"), e.value
    assert reason in str(e.value), e.value


def test_a_flaw_in_the_analysis_leaves_the_grammar_to_llguidance(monkeypatch, caplog):
    def flawed(*args):
        raise TypeError("a bug")

    monkeypatch.setattr(grammar_rules, "stuck_rules", flawed)
    text = 'start: "a" x | "b"\nx: "c" x | "e"'  # not cached by the tests above
    grammar.grammar_text(StructuredOutputsParams(grammar=text))  # no ValueError, no TypeError
    assert "grammar_rules: no verdict" in caplog.text


def test_gbnf_names_follow_llguidances_renaming():
    names = gbnf_names('root ::= a-b\na-b ::= fooBar\nfooBar ::= "x"')
    assert names == {"start": "root", "a_b": "a-b", "foo_bar": "fooBar"}
    assert gbnf_names('start: "a"') is None


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=512)


def _params(text: str, n: int = 1) -> SamplingParams:
    so = StructuredOutputsParams(grammar=text)
    return SamplingParams(temperature=1.0, seed=0, n=n, max_tokens=60, structured_outputs=so)


@pytest.mark.parametrize("name", ["lark_start", "lark_alternative", "gbnf_root"])
def test_the_engine_refuses_on_add_and_serves_on(llm, name):
    text, _ = STUCK[name]
    with pytest.raises(ValueError, match=r"^structured_outputs\.grammar is invalid: rule '"):
        llm.generate(["x"], _params(text), use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine.engine_core.num_compiling == 0
    out = llm.generate(["x"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    ("name", "pattern"),
    [
        ("productive_recursion", r"b|ac*d"),
        ("gbnf_productive_recursion", r"z|ab*d"),
        ("dead_alt_shadowed", r"ac*"),
        ("dead_alt_writes_nothing", r"a"),
    ],
)
def test_accepted_grammars_with_recursion_or_dead_alternatives_finish(llm, name, pattern):
    """Sampled outputs all end with "stop" and match: none gets stuck."""
    (out,) = llm.generate(["x"], _params(FINISHING[name], n=8), use_tqdm=False)
    for c in out.outputs:
        assert c.finish_reason == "stop" and re.fullmatch(pattern, c.text), (
            c.finish_reason,
            c.text,
        )


def _on_big_stack_timed(text: str) -> tuple[str | None, float]:
    t = time.perf_counter()
    why = grammar.on_big_stack(stuck_rules, text)
    return why, time.perf_counter() - t


def test_hostile_grammars_are_bounded():
    """Past grammar_text's 100k-character limit (the analysis alone: llguidance is not asked
    past 200k): 200k nested groups, a 30k-rule chain; no recursion limit, linear time
    (1-4 MB took 2-6 s on one core: the PR's measurements)."""
    deep = "start: " + "(" * 200_000 + "x" + ")" * 200_000 + '\nx: "b" x'
    why, took = _on_big_stack_timed(deep)
    assert why is not None and why.startswith("rule 'start' can never end"), why
    n = 30_000
    chain = 'start: r0 | "q"\n' + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(n))
    why, took2 = _on_big_stack_timed(chain + f"r{n}: r0\n")  # 0.5 MB: llguidance not asked
    assert why is None
    why, took3 = _on_big_stack_timed(chain + f'r{n}: "z"\n')
    assert why is None
    assert max(took, took2, took3) < 30, (took, took2, took3)
    assert stuck_rules("start: " + "(" * 100_000) is None  # unbalanced: no verdict, no crash
