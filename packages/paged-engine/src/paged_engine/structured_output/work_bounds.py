"""Bounds on the work a constraint costs where llguidance sets none of its own: refused up front.

- Counted repetition (`a{1000000}`, `((a{1000}){1000}){1000}`) in a `regex`, a JSON schema's
  `pattern` / `patternProperties` or a structural tag's regex: llguidance's lexer builds one
  expression per repetition left, so the cost grows with the product of nested counts. At 1e5
  the compile took ~1 s and each step's mask ~0.3 s on the engine's step thread (stalling every
  request); at 1e6 the compile took 2-5 s, the first mask up to 1.5 s, then the lexer failed
  ("too many expressions constructed") after one token: the output ended there, as if
  complete. At most MAX_REPEAT_PRODUCT (steps then cost ~0.03 s). In a grammar, counts also
  multiply through rule references (`a: b~100`, `b: c{100}`, `c: "x"{100}`: check_rule_repeats).
- `const` / `enum` values holding objects and arrays: llguidance's "schema too large" limit
  counts subschemas, not the members of a constant, which cost ~0.5 ms each to validate (20k
  keys: 17 s on the checking thread, 25 s to compile, then a panic). At most MAX_CONST_VALUES
  members and items in all of a schema's `const` / `enum` values together (~1 s).

- `anyOf` / `oneOf` alternatives that are objects (or arrays): each is one item of the parser's
  row once the value's `{` (`[`) is out, and llguidance follows at most MAX_ALTERNATIVES (its
  `max_items_in_row`): 2100 objects compiled (0.8 s), then failed after the `{` ("Current row
  has 2100 items; max is 2000"), the output `{` ending as if complete. Counted through nested
  `anyOf` / `oneOf` and local `$ref`s, each subschema's alternatives found once (linear in the
  schema however many `anyOf`s share a `$def`). Strings, numbers and constants merge into one
  lexeme: any number of those is fine.

The same walk of a schema refuses a `multipleOf` not above 0 (JSON Schema requires > 0):
llguidance refused 0 ("invalid multiple of") but served -2 as 2.

`maxLength` / `minItems` and the like are not counted repetition for llguidance (1e9 is cheap).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Iterator
from typing import Any

from paged_engine.structured_output.lark_reader import Grammar, Raw, Unreadable, read_lark
from paged_engine.structured_output.schema_refs import resolve_ref

MAX_REPEAT_PRODUCT = 10_000
MAX_CONST_VALUES = 2_000
MAX_ALTERNATIVES = 2_000  # llguidance's default ParserLimits.max_items_in_row
# `{n}`, `{n,}`, `{n,m}`, `{,m}` (spaces allowed, as Rust's regex does)
_COUNT = re.compile(r"\{\s*(\d*)\s*(,?)\s*(\d*)\s*\}")
_BRACED_ESCAPES = frozenset("pPxuU")  # `\p{Greek}`, `\x{10FFFF}`: braces that are no count
# keywords whose values are subschemas (JSON Schema 2020-12, with draft-07's spellings):
# name -> subschema (a property may be named "const" or "pattern")
_SCHEMA_MAPS = frozenset(
    ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
)
_SCHEMA_LISTS = frozenset(("items", "prefixItems", "allOf", "anyOf", "oneOf"))  # or one subschema
_SCHEMA_ONE = frozenset(
    (
        "not", "if", "then", "else", "contains", "additionalProperties", "additionalItems",
        "unevaluatedProperties", "unevaluatedItems", "propertyNames", "contentSchema",
    )
)  # fmt: skip


def repeat_product(regex: str) -> int:
    """The largest product of nested counted repetitions in `regex` (1 if it has none); a
    count past 1e12 counts as 1e12. Character classes and escapes are skipped."""
    best = 1
    stack: list[int] = []  # per open group: the largest product inside it so far
    inner = 0  # the largest product inside the group open now
    last = 0  # the product of the atom just ended (0: no atom to repeat)
    i, n = 0, len(regex)
    while i < n:
        c = regex[i]
        if c == "\\":
            i += 2
            if i - 1 < n and regex[i - 1] in _BRACED_ESCAPES and i < n and regex[i] == "{":
                close = regex.find("}", i)
                i = n if close < 0 else close + 1
            last = 1
            continue
        if c == "[":
            i = _class_end(regex, i)
            last = 1
            continue
        if c == "(":
            stack.append(inner)
            inner, last = 1, 0
        elif c == ")":
            group = inner
            inner = max(stack.pop(), group) if stack else group
            last = group
            i += 1
            continue
        elif c == "{" and last:
            m = _COUNT.match(regex, i)
            if m is not None:
                low, comma, high = m.groups()
                count = int(high[:13] or 0) if comma else int(low[:13] or 0)
                count = max(count, int(low[:13] or 0), 1)
                last = min(last * count, 10**12)
                best = max(best, last)
                inner = max(inner, last)
                i = m.end()
                continue
            last = 1  # a literal brace
        elif c not in "*+?|^$":
            last = 1
        elif c == "|":
            last = 0
        inner = max(inner, last)
        i += 1
    return best


def _class_end(regex: str, i: int) -> int:
    """The index past the character class opening at `i` (nested classes, escapes, a `]`
    first in the class taken literally)."""
    depth, n = 0, len(regex)
    while i < n:
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            depth += 1
            i += 1
            if i < n and regex[i] == "^":
                i += 1
            if i < n and regex[i] == "]":
                i += 1
            continue
        if c == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return n


def check_regex(regex: str, field: str) -> None:
    product = repeat_product(regex)
    if product > MAX_REPEAT_PRODUCT:
        raise ValueError(
            f"{field} is invalid: its counted repetitions nest to {product} repeats (at most "
            f"{MAX_REPEAT_PRODUCT}; the lexer builds a state per repeat): use `+` / `*`, or "
            "a JSON schema's maxLength / maxItems"
        )


def check_rule_repeats(lark: str, field: str, names: dict[str, str] | None = None) -> None:
    """ValueError naming `field` if counted repetitions nest past MAX_REPEAT_PRODUCT through
    the rules of `lark` (llguidance's Lark text of a grammar): `a: b{100}`, `b: c~100`,
    `c: "x"{100}` repeat "x" 1e6 times as surely as `(("x"{100}){100}){100}` does (terminals:
    the lexer's 2.5 s, then "too many expressions constructed"; rules: the parser's "Too many
    items" at the first mask). Within one rule or regex, check_regex counts them already.
    Rules are named as `names` renames them (GBNF's, grammar_rules.gbnf_names); a grammar
    lark_reader does not follow gets no verdict."""
    try:
        g = read_lark(lark)
    except (Unreadable, ValueError, RecursionError):
        return
    product, path = _rule_product(g)
    if product > MAX_REPEAT_PRODUCT:
        rules: list[str] = []
        for s in path:
            name = g.names[g.owner[s]]  # (llguidance writes an all-terminal GBNF rule upper)
            name = (names or {}).get(name) or (names or {}).get(name.lower(), name)
            if not rules or rules[-1] != name:
                rules.append(name)
        shown = " -> ".join(rules[:8]) + (" -> ..." if len(rules) > 8 else "")
        raise ValueError(
            f"{field} is invalid: its counted repetitions nest to {product} repeats through "
            f"the rules {shown} (at most {MAX_REPEAT_PRODUCT}; llguidance builds each repeat): "
            "use `+` / `*`"
        )


def _rule_product(g: Grammar) -> tuple[int, list[int]]:
    """The largest product of counted repetitions along a path of references from `start`
    (a regex terminal adding its own, a reference back into the path counting 1: recursion
    is no repeat llguidance builds), and that path's symbols; a walk without recursion."""
    n = len(g.names)
    best = [0] * n  # a symbol's product once walked
    inner = [1] * n  # the largest product among what it references so far
    via: list[int | None] = [None] * n  # the reference that product comes through
    start = g.ids["start"]
    entered = {start}
    work = [(start, iter([x for alt in g.alts[start] for x in alt]))]
    while work:
        s, items = work[-1]
        for x in items:
            if isinstance(x, int):
                if best[x] > inner[s]:
                    inner[s], via[s] = best[x], x
                elif not best[x] and x not in entered:  # (entered, not walked: a loop)
                    entered.add(x)
                    work.append((x, iter([y for alt in g.alts[x] for y in alt])))
                    break
            elif isinstance(x, Raw) and x.source.startswith("/"):  # a regex terminal
                product = repeat_product(x.source)
                if product > inner[s]:
                    inner[s], via[s] = product, None
        else:
            work.pop()
            best[s] = min(_form_count(g.form.get(s)) * inner[s], 10**12)
            if work and best[s] > inner[work[-1][0]]:
                inner[work[-1][0]], via[work[-1][0]] = best[s], s
    path, s = [start], via[start]
    while s is not None:
        path.append(s)
        s = via[s]
    return best[start], path


def _form_count(form: str | None) -> int:
    """The count of a repetition's operator (`{m,n}`: as repeat_product reads it; `~m..n`);
    1 for any other operator or none."""
    if form is None:
        return 1
    if form.startswith("~"):
        return max(int(part[:13]) for part in form[1:].split(".."))
    m = _COUNT.fullmatch(form)
    if m is None:
        return 1
    low, comma, high = m.groups()
    count = int(high[:13] or 0) if comma else int(low[:13] or 0)
    return max(count, int(low[:13] or 0), 1)


def check_spec(schema: Any, field: str) -> None:
    """ValueError naming `field` past any bound, for every `pattern` (and `patternProperties`
    key), every `const` / `enum` value and every `anyOf` / `oneOf` of the JSON schema `schema`;
    also for a `multipleOf` that is no number > 0 (check_multiple_of). Subschemas are what the
    keywords of _SCHEMA_MAPS / _SCHEMA_LISTS / _SCHEMA_ONE hold and what a local `$ref` points
    at (anywhere: llguidance follows `#/components/x` or `#/default` too); data (`default`,
    `examples`, `const`, `enum`) and unknown keywords are not looked into (llguidance ignores
    them: a `pattern` in an example is no pattern)."""
    if not isinstance(schema, dict):
        return
    consts = 0
    alternatives = _Alternatives(schema)
    seen = {id(schema)}
    todo = [schema]
    while todo:
        node = todo.pop()
        subs: list[Any] = []
        for key, value in node.items():
            if key == "pattern" and isinstance(value, str):
                check_regex(value, f"{field} pattern {value[:60]!r}")
            elif key == "patternProperties" and isinstance(value, dict):
                for name in value:
                    check_regex(name, f"{field} patternProperties key {name[:60]!r}")
            elif key == "multipleOf":
                check_multiple_of(value, field)
            elif key == "$ref" and isinstance(value, str):
                subs.append(alternatives.resolve(value))
            elif key in ("const", "enum"):
                consts += _members(value, MAX_CONST_VALUES - consts + 1, key == "enum")
                if consts > MAX_CONST_VALUES:
                    raise ValueError(
                        f"{field} is invalid: its const / enum values hold more than "
                        f"{MAX_CONST_VALUES} object members and array items (each one is a "
                        "grammar rule of its own): describe such a value with properties / "
                        "items instead"
                    )
            if key in _NESTED and isinstance(value, list):
                alternatives.check(value, f"{field} {key}")
            if key in _SCHEMA_MAPS and isinstance(value, dict):  # names -> subschemas
                subs.extend(value.values())
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                subs.extend(value)
            elif key in _SCHEMA_LISTS or key in _SCHEMA_ONE:
                subs.append(value)
        for sub in subs:  # (a boolean subschema has nothing to check)
            if isinstance(sub, dict) and id(sub) not in seen:
                seen.add(id(sub))
                todo.append(sub)


def check_structural_tag(tag: Any, field: str) -> None:
    """check_spec for each JSON schema of a structural tag (a `json_schema` format's, an older
    form's `structures[i].schema`, given as JSON text too) and check_regex for each `regex`
    format's pattern, errors naming the path; a malformed tag is left to structural_tag.py."""
    todo: list[tuple[Any, str]] = [(tag, field)]
    while todo:
        node, where = todo.pop()
        if isinstance(node, list):
            todo.extend((item, f"{where}[{i}]") for i, item in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            path = f"{where}.{key}"
            if key == "json_schema" and node.get("type") == "json_schema":
                check_spec(value, path)
            elif key == "schema" and "begin" in node:  # the older form's structures
                if isinstance(value, str):
                    with contextlib.suppress(ValueError, RecursionError):
                        value = json.loads(value)  # (invalid JSON: structural_tag.py says why)
                check_spec(value, path)
            elif key == "pattern" and node.get("type") == "regex" and isinstance(value, str):
                check_regex(value, f"{where} pattern {value[:60]!r}")
            elif isinstance(value, (dict, list)):
                todo.append((value, path))


def check_multiple_of(value: Any, field: str) -> None:
    """ValueError naming `field` unless a numeric `multipleOf` is finite and > 0, as JSON
    Schema requires (llguidance refuses 0 but serves a negative one; a value of another type it
    refuses itself, naming the keyword)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and not (value > 0 and (isinstance(value, int) or math.isfinite(value))):
        raise ValueError(
            f"{field} is invalid: multipleOf must be a number greater than 0, got {value!r}"
        )


def _members(value: Any, limit: int, is_enum: bool) -> int:
    """Object members and array items in `value`, all levels (counting stops past `limit`);
    an `enum` list's own entries are not counted (each is one lexeme alternative)."""
    count = 0
    todo = list(value) if is_enum and isinstance(value, list) else [value]
    while todo and count <= limit:
        node = todo.pop()
        if isinstance(node, dict):
            count += len(node)
            todo.extend(node.values())
        elif isinstance(node, list):
            count += len(node)
            todo.extend(node)
    return count


# ids of the (object, array) alternatives a subschema flattens to
_Found = tuple[frozenset[int], frozenset[int]]
_NOTHING: _Found = (frozenset(), frozenset())
_NESTED = ("anyOf", "oneOf")


class _TooMany(Exception):
    """Some subschema flattens to more than MAX_ALTERNATIVES objects (or arrays)."""


class _Alternatives:
    """The object and array alternatives of every `anyOf` / `oneOf` of one schema, flattened
    through nested `anyOf` / `oneOf` and local `$ref`s, each counted once however many paths
    reach it.

    Each subschema's set is found once and kept (by id: the schema holds every subschema for
    as long as this lives), so that many `anyOf`s reaching one large `$def` walk it once: every
    subschema is walked once, every $ref resolved once, and a set holds at most
    MAX_ALTERNATIVES + 1 ids before the check fails. Subschemas in a `$ref` loop reach the same
    alternatives: one set per strongly connected component (Tarjan), none kept half-known."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.anchors: dict[str, dict] = {}  # resolve_ref's, for this root
        self.targets: dict[str, Any] = {}  # $ref -> what it points at (None: not here)
        self.found: dict[int, _Found] = {}  # id(subschema) -> its alternatives

    def resolve(self, ref: str) -> Any:
        """What the local `ref` points at in the root (each $ref text resolved once)."""
        if ref not in self.targets:
            root = self.root
            found = resolve_ref(root, ref, self.anchors) if isinstance(root, dict) else None
            self.targets[ref] = found
        return self.targets[ref]

    def check(self, members: list, field: str) -> None:
        """ValueError naming `field` if `members` flatten to more than MAX_ALTERNATIVES objects,
        or arrays."""
        try:
            _union([self._of(m) for m in members if isinstance(m, dict)])
        except _TooMany:
            counts = self._count(members)  # the exact number, for the message: walked once
            kind = max(counts, key=counts.__getitem__)
            raise ValueError(
                f"{field} is invalid: it holds {counts[kind]} {kind} alternatives, more than "
                f"the {MAX_ALTERNATIVES} llguidance's parser follows at once (the output would "
                f"stop after its first character): merge them into fewer {kind}s"
            ) from None

    def _of(self, start: dict) -> _Found:
        """The alternatives `start` flattens to (Tarjan's algorithm, without recursion)."""
        found = self.found
        if id(start) in found:
            return found[id(start)]
        index: dict[int, int] = {}  # the order subschemas were entered in
        low: dict[int, int] = {}  # the lowest index reachable from one, along this walk
        parts: dict[int, list[_Found]] = {}  # entered, component not yet done: what they hold
        stack: list[dict] = []  # entered, component not yet done
        work: list[tuple[dict, Iterator[dict]]] = []

        def enter(node: dict) -> None:
            index[id(node)] = low[id(node)] = len(index)
            parts[id(node)] = [_own(node)]
            stack.append(node)
            work.append((node, iter(self._next(node))))

        enter(start)
        while work:
            node, after = work[-1]
            here = id(node)
            for sub in after:
                if id(sub) in found:
                    parts[here].append(found[id(sub)])
                elif id(sub) not in index:
                    enter(sub)
                    break
                else:  # on the stack: in this subschema's component
                    low[here] = min(low[here], index[id(sub)])
            else:
                work.pop()
                if low[here] == index[here]:  # the component's first: all of it is known
                    component: list[dict] = []
                    while not component or component[-1] is not node:
                        component.append(stack.pop())
                    whole = _union([p for n in component for p in parts.pop(id(n))])
                    for n in component:
                        found[id(n)] = whole
                if work:
                    parent = id(work[-1][0])
                    if here in found:
                        parts[parent].append(found[here])
                    else:
                        low[parent] = min(low[parent], low[here])
        return found[id(start)]

    def _next(self, node: dict) -> list[dict]:
        """The subschemas `node` flattens into: its anyOf / oneOf members and its $ref's target."""
        out = [m for k in _NESTED if isinstance(node.get(k), list) for m in node[k]]
        ref = node.get("$ref")
        if isinstance(ref, str):
            out.append(self.resolve(ref))
        return [m for m in out if isinstance(m, dict)]

    def _count(self, members: list) -> dict[str, int]:
        counts = {"object": 0, "array": 0}
        seen: set[int] = set()
        todo = [m for m in members if isinstance(m, dict)]
        while todo:
            node = todo.pop()
            if id(node) not in seen:
                seen.add(id(node))
                todo.extend(self._next(node))
                kind = _kind(node)
                if kind is not None:
                    counts[kind] += 1
        return counts


def _kind(node: dict) -> str | None:
    """'object' or 'array' for a subschema that is one alternative of that kind: no nested
    anyOf / oneOf members of its own (those are the alternatives then)."""
    if any(isinstance(node.get(k), list) and node[k] for k in _NESTED):
        return None
    kind = node.get("type")
    if kind == "object" or (kind is None and "properties" in node):
        return "object"
    if kind == "array" or (kind is None and ("items" in node or "prefixItems" in node)):
        return "array"
    return None


def _own(node: dict) -> _Found:
    kind = _kind(node)
    if kind is None:
        return _NOTHING
    one = frozenset((id(node),))
    return (one, frozenset()) if kind == "object" else (frozenset(), one)


def _union(parts: list[_Found]) -> _Found:
    """The union of `parts` (a set shared, not copied, where one part holds all); _TooMany
    past MAX_ALTERNATIVES of either kind."""
    out = []
    for k in (0, 1):
        sets = list({id(p[k]): p[k] for p in parts if p[k]}.values())
        whole = sets[0] if len(sets) == 1 else frozenset().union(*sets)
        if len(whole) > MAX_ALTERNATIVES:
            raise _TooMany
        out.append(whole)
    return out[0], out[1]
