"""Bounds on the work a constraint costs where llguidance sets none of its own: refused up front.

- Counted repetition (`a{1000000}`, `((a{1000}){1000}){1000}`) in a `regex`, a JSON schema's
  `pattern` / `patternProperties` or a structural tag's regex: llguidance's lexer builds one
  expression per repetition left, so the cost grows with the product of nested counts. At 1e5
  the compile took ~1 s and each step's mask ~0.3 s on the engine's step thread (stalling every
  request); at 1e6 the compile took 2-5 s, the first mask up to 1.5 s, then the lexer failed
  ("too many expressions constructed") after one token: the output ended there, as if
  complete. At most MAX_REPEAT_PRODUCT (steps then cost ~0.03 s).
- `const` / `enum` values holding objects and arrays: llguidance's "schema too large" limit
  counts subschemas, not the members of a constant, which cost ~0.5 ms each to validate (20k
  keys: 17 s on the checking thread, 25 s to compile, then a panic). At most MAX_CONST_VALUES
  members and items in all of a schema's `const` / `enum` values together (~1 s).

- `anyOf` / `oneOf` alternatives that are objects (or arrays): each is one item of the parser's
  row once the value's `{` (`[`) is out, and llguidance follows at most MAX_ALTERNATIVES (its
  `max_items_in_row`): 2100 objects compiled (0.8 s), then failed after the `{` ("Current row
  has 2100 items; max is 2000"), the output `{` ending as if complete. Counted through nested
  `anyOf` / `oneOf` and local `$ref`s. Strings, numbers and constants merge into one lexeme:
  any number of those is fine.

`maxLength` / `minItems` and the like are not counted repetition for llguidance (1e9 is cheap).
"""

from __future__ import annotations

import re
from typing import Any

from paged_engine.structured_output.schema_refs import _resolve

MAX_REPEAT_PRODUCT = 10_000
MAX_CONST_VALUES = 2_000
MAX_ALTERNATIVES = 2_000  # llguidance's default ParserLimits.max_items_in_row
# `{n}`, `{n,}`, `{n,m}`, `{,m}` (spaces allowed, as Rust's regex does)
_COUNT = re.compile(r"\{\s*(\d*)\s*(,?)\s*(\d*)\s*\}")
_BRACED_ESCAPES = frozenset("pPxuU")  # `\p{Greek}`, `\x{10FFFF}`: braces that are no count
# keywords whose values map names to subschemas (a property may be named "const")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")


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


def check_spec(spec: Any, field: str) -> None:
    """ValueError naming `field` past either bound, for every `pattern` (and
    `patternProperties` key) and every `const` / `enum` value anywhere in `spec` (a JSON
    schema, or a structural tag with schemas and regexes inside)."""
    consts = 0
    root = spec
    todo = [spec]
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key == "pattern" and isinstance(value, str):
                check_regex(value, f"{field} pattern {value[:60]!r}")
            elif key == "patternProperties" and isinstance(value, dict):
                for name in value:
                    check_regex(name, f"{field} patternProperties key {name[:60]!r}")
            if key in ("anyOf", "oneOf") and isinstance(value, list):
                _check_alternatives(root, value, f"{field} {key}")
            if key in _SCHEMA_MAPS and isinstance(value, dict):  # names -> subschemas
                todo.extend(value.values())
            elif key in ("const", "enum"):
                consts += _members(value, MAX_CONST_VALUES - consts + 1, key == "enum")
                if consts > MAX_CONST_VALUES:
                    raise ValueError(
                        f"{field} is invalid: its const / enum values hold more than "
                        f"{MAX_CONST_VALUES} object members and array items (each one is a "
                        "grammar rule of its own): describe such a value with properties / "
                        "items instead"
                    )
            elif isinstance(value, (dict, list)):
                todo.append(value)


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


def _check_alternatives(root: Any, members: list, field: str) -> None:
    """ValueError if `members` (flattened through nested anyOf / oneOf and local $refs) hold
    more than MAX_ALTERNATIVES objects, or arrays."""
    counts = {"object": 0, "array": 0}
    seen: set[int] = set()
    anchors: dict[str, dict] = {}
    todo = list(members)
    while todo:
        node = todo.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        ref = node.get("$ref")
        if isinstance(ref, str) and isinstance(root, dict):
            todo.append(_resolve(root, ref, anchors))
        nested = [m for k in ("anyOf", "oneOf") if isinstance(node.get(k), list) for m in node[k]]
        if nested:
            todo.extend(nested)
            continue
        kind = node.get("type")
        if kind == "object" or (kind is None and "properties" in node):
            counts["object"] += 1
        elif kind == "array" or (kind is None and ("items" in node or "prefixItems" in node)):
            counts["array"] += 1
    for kind, count in counts.items():
        if count > MAX_ALTERNATIVES:
            raise ValueError(
                f"{field} is invalid: it holds {count} {kind} alternatives, more than the "
                f"{MAX_ALTERNATIVES} llguidance's parser follows at once (the output would "
                f"stop after its first character): merge them into fewer {kind}s"
            )
