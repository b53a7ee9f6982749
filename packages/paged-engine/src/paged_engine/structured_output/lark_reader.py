"""A reader of llguidance's Lark grammars into rules, for `grammar_rules.py`'s analysis.

`read_lark(text)` gives each symbol's alternatives as lists of items: a symbol id, a string literal
(`Lit`), or a terminal it does not look into (`Raw`: a regex, `%json {..}`, a special token, `"a"i`;
taken to match some text). EBNF groups, `[..]` and repetitions become fresh symbols (`x*` / `x?` /
`[..]` / `x{0,n}` / `x~0..n` with an empty alternative; `x+` / `x{m,n}` / `x~m..n` needing `x`),
their operator kept in `Grammar.form`. Terminal definitions (UPPER names) and rules with attributes
keep their source, to be written back. What it does not follow (templates, `%extend` / `%override`,
a definition given twice, syntax llguidance would refuse anyway) raises Unreadable: no verdict. One
pass over the tokens with an explicit stack of open groups: no recursion, however deep the nesting.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_TOKEN = re.compile(
    r"""(?P<head>^[ \t]*[?!]?(?P<name_>[A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?[ \t]*
            (?P<attrs>\[[^\]\n]*\])?[ \t]*:(?!:))
    |(?P<ws>[ \t\f\r]+|\n)|(?P<comment>(?://|\#)[^\n]*)
    |(?P<str>"(?:[^"\\\n]|\\.)*"i?|'(?:[^'\\\n]|\\.)*'i?)
    |(?P<rx>/(?!/)(?:[^/\\\n]|\\.)+/[a-zA-Z]*)
    |(?P<special><\|[^|\n]*\|>|<\[[^\]\n]*\]>|<[A-Za-z_][^>\s]*>|@[A-Za-z0-9_]+)
    |(?P<rep>\{[ \t]*\d*[ \t]*(?:,[ \t]*\d*[ \t]*)?\})
    |(?P<arrow>->)|(?P<algebra>\.\.|[~&]|\d+)
    |(?P<directive>%[A-Za-z_]+)
    |(?P<name>[A-Za-z_][A-Za-z0-9_]*)
    |(?P<op>[|()\[\]?*+])""",
    re.VERBOSE | re.MULTILINE,
)
_TILDE_COUNT = re.compile(r"[ \t]*(\d+)(?:[ \t]*\.\.[ \t]*(\d+))?")  # after `~`: n, n..m
_STATEMENTS = ("import", "ignore", "declare", "llguidance")  # directives that stand alone
_INLINE = ("json", "regex")  # directives that are an item: `%json { schema }`


class Unreadable(Exception):
    """The text uses something this reader does not follow: no verdict."""


@dataclass(slots=True, frozen=True)
class Lit:
    """A string literal: its text, and its source (written back as it was)."""

    text: str
    source: str


@dataclass(slots=True, frozen=True)
class Raw:
    """A terminal not looked into (a regex, `%json {..}`, a special token, `"a"i`): taken to
    match some text; `source` is written back as it was."""

    source: str


Item = int | Lit | Raw  # a symbol id, a string literal, or a terminal not looked into


@dataclass(slots=True)
class Grammar:
    """A context-free grammar: symbol i's alternatives in `alts[i]`. EBNF groups and operators
    become fresh symbols owned by the named rule they sit in (`owner`, for messages), their
    operator in `form` ("(", "[", "?", "*", "+", the "{m,n}" source, or "~n" / "~m..n")."""

    names: list[str] = field(default_factory=list)
    owner: list[int] = field(default_factory=list)
    alts: list[list[list[Item]]] = field(default_factory=list)
    ids: dict[str, int] = field(default_factory=dict)
    defined: set[int] = field(default_factory=set)
    form: dict[int, str] = field(default_factory=dict)
    source: dict[int, str] = field(default_factory=dict)  # definitions written back verbatim
    directives: list[str] = field(default_factory=list)

    def symbol(self, name: str) -> int:
        if name not in self.ids:
            self.ids[name] = self._new(name, len(self.names))
        return self.ids[name]

    def fresh(self, owner: int, form: str, alts: list[list[Item]]) -> int:
        i = self._new(self.names[owner], owner)
        self.alts[i] = alts
        self.form[i] = form
        self.defined.add(i)
        return i

    def _new(self, name: str, owner: int) -> int:
        self.names.append(name)
        self.owner.append(owner)
        self.alts.append([])
        return len(self.names) - 1


def read_lark(text: str) -> Grammar:
    """The rules of an llguidance Lark grammar; Unreadable if some part is not followed. Terminals
    (UPPER names), rules with attributes or terminal algebra (`&`, `..` ranges, `~` negation) keep
    their source to be written back; the last two, and symbols never defined (imported, declared),
    get the one alternative [Raw]: productive, not looked into."""
    g = Grammar()
    head: int | None = None  # the rule being read; None: between rules
    begin = 0  # where its definition starts
    stack: list[tuple[str, list[list[Item]]]] = []  # open groups: ("(" / "[" / ":", alts)
    opaque: set[int] = set()
    alias = False  # the name after `->` names the tree node, not an item
    pos, end = 0, len(text)

    def close(at: int) -> None:
        if head is None:
            return
        if len(stack) != 1 or stack[0][0] != ":":
            raise Unreadable(f"unclosed group in {g.names[head]}")
        g.alts[head].extend(stack[0][1])
        if head in opaque or g.names[head].lstrip("_")[:1].isupper():
            g.source[head] = text[begin:at].strip()

    while pos < end:
        m = _TOKEN.match(text, pos)
        if m is None:
            raise Unreadable(f"at {pos}: {text[pos : pos + 20]!r}")
        pos, kind, tok = m.end(), m.lastgroup, m.group()
        if kind in ("ws", "comment"):
            continue
        if kind == "head":
            close(m.start())
            head, begin = g.symbol(m.group("name_")), m.start()
            if head in g.defined:
                raise Unreadable(f"{g.names[head]} defined twice")
            g.defined.add(head)
            if m.group("attrs"):  # max_tokens / stop / lazy...: ends on its own terms
                opaque.add(head)
            stack, alias = [(":", [[]])], False
            continue
        if kind == "directive":
            word = tok[1:]
            if word in _INLINE and head is not None:
                pos = _skip_json(text, pos)
                stack[-1][1][-1].append(Raw(text[m.start() : pos]))
                continue
            if word not in _STATEMENTS:
                raise Unreadable(tok)
            close(m.start())
            head, stack = None, []
            eol = text.find("\n", pos)
            pos = _skip_json(text, pos) if word == "llguidance" else end if eol < 0 else eol
            g.directives.append(text[m.start() : pos].strip())
            continue
        if head is None:
            raise Unreadable(f"at {m.start()}: {tok!r} outside a rule")
        if alias:
            if kind != "name":
                raise Unreadable(f"-> {tok!r}")
            alias = False
            continue
        if kind == "arrow":
            alias = True
        elif kind == "algebra":
            count = _TILDE_COUNT.match(text, pos) if tok == "~" else None
            if count is None:  # `&`, a `..` range, a `~` negation: not looked into
                opaque.add(head)
                continue
            pos = count.end()  # `x ~ n` / `x ~ n..m`: x{n} / x{n,m}
            low, high = count.groups()
            form = f"~{low}" if high is None else f"~{low}..{high}"
            _repeat(g, head, stack[-1][1][-1], form, int(low) > 0)
        else:
            _item(g, head, stack, kind, tok)
    close(end)
    start = g.ids.get("start")
    if start is None or start not in g.defined:
        raise Unreadable("no start rule")
    for i in range(len(g.names)):
        if i in opaque or i not in g.defined:
            g.alts[i] = [[Raw("")]]
    return g


def _skip_json(text: str, pos: int) -> int:
    """The end of the `{...}` JSON value after `pos` (braces inside strings skipped)."""
    i = pos
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    if i >= len(text) or text[i] != "{":
        raise Unreadable(f"at {pos}: no JSON object")
    depth, in_str = 0, False
    while i < len(text):
        c = text[i]
        if in_str:
            if c == "\\":
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise Unreadable("unclosed JSON object")


def _item(g: Grammar, head: int, stack: list, kind: str | None, tok: str) -> None:
    alts = stack[-1][1]
    seq = alts[-1]
    if kind == "str":
        seq.append(_literal(tok))
    elif kind in ("rx", "special"):
        seq.append(Raw(tok))
    elif kind == "name":
        seq.append(g.symbol(tok))
    elif kind == "rep":  # {m}, {m,n}, {,n}, {m,}
        low = tok.strip("{} \t").split(",")[0].strip()
        _repeat(g, head, seq, tok, low != "" and int(low) > 0)
    elif tok in "?*+":
        _repeat(g, head, seq, tok, tok == "+")
    elif tok == "|":
        alts.append([])
    elif tok in "([":
        stack.append((tok, [[]]))
    elif tok in ")]":
        opener, inner = stack.pop()
        if opener != ("(" if tok == ")" else "[") or not stack:
            raise Unreadable(f"unbalanced {tok}")
        if tok == "]":
            inner.append([])
        stack[-1][1][-1].append(g.fresh(head, opener, inner))
    else:
        raise Unreadable(tok)


def _repeat(g: Grammar, head: int, seq: list[Item], op: str, at_least_one: bool) -> None:
    if not seq:
        raise Unreadable(f"{op} without an item")
    x = seq.pop()
    i = g.fresh(head, op, [])
    # x? -> [x] | []; x* (x{0,n}) -> [x i] | []; x+ (x{m,n}, m >= 1: a superset) -> [x i] | [x]
    g.alts[i] = [[x, i], [x]] if at_least_one else [[x], []] if op == "?" else [[x, i], []]
    seq.append(i)


def _literal(tok: str) -> Lit | Raw:
    """A string literal; Raw for a case-insensitive one (`"a"i`) or escapes not followed."""
    if tok.endswith("i"):
        return Raw(tok)
    body = tok[1:-1]
    if "\\" not in body:
        return Lit(body, tok)
    if re.search(r"\\[^nrt\\\"'u]", body):
        return Raw(tok)
    try:
        return Lit(body.encode("latin-1", "backslashreplace").decode("unicode_escape"), tok)
    except UnicodeDecodeError:
        return Raw(tok)
