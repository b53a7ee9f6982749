"""JSON schemas whose `$ref`s loop without ever reaching a JSON value: refused up front.

`{"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}`
passes llguidance's grammar validation, but the grammar's rule for `a` derives nothing: the
matcher fails with "NoExtensionBias" once it must fill a mask there (at the start, or
mid-output when an optional property or an array item leads into the loop), after the request
was accepted. The same holds for loops through `allOf` / `anyOf` / `oneOf` alone
(`{"anyOf": [{"$ref": "#/$defs/a"}]}` in `a`). Recursion through an object or an array
(`{"properties": {"next": {"$ref": ...}}}`, a tree's `items`) is fine: the value starts with
`{` or `[` before it recurses.

`ref_cycle(schema)`: a schema may *start a value* when each of its parts the value must also
match (the `$ref` target, every `allOf` member, one member of each `anyOf` / `oneOf`) may;
anything else (types, objects, arrays, consts, `true` / `false`) starts one. The least fixed
point of that rule leaves exactly the schemas stuck in such loops; one reachable from the root
(through properties, items and the like, following `$ref`s) is reported with its loop.
`$ref`s this module cannot resolve (other documents, `$dynamicRef`) count as starting a value:
llguidance judges those itself; so does a subschema with its own `$id` (its `$ref`s mean other
things), with what lies inside it, while the loop check goes on everywhere else.
"""

from __future__ import annotations

from collections import deque
from typing import Any
from urllib.parse import unquote

# Subschemas a value may contain (reached after the value started): reachability only.
_INNER_MAPS = ("properties", "patternProperties", "dependentSchemas")
_INNER = (
    "additionalProperties",
    "unevaluatedProperties",
    "propertyNames",
    "items",
    "additionalItems",
    "unevaluatedItems",
    "contains",
)
_INNER_LISTS = ("prefixItems", "items")
_ALTERNATIVES = ("anyOf", "oneOf")  # the value matches one member of each
_SHOWN = 8  # the pointers of a loop `ref_cycle` names, at most (the rest: "... (n more)")
_POINTER_CHARS = 200  # a longer pointer is named by its end ("…" and its last characters)


def ref_cycle(schema: Any) -> list[str] | None:
    """The JSON pointers of one `$ref` / `allOf` / `anyOf` / `oneOf` loop that no value can
    leave, reachable from the root of `schema`, first repeated last; None if there is none.
    A loop of more than _SHOWN schemas is named by its first and last ones around a
    "... (n more)" entry."""
    if not isinstance(schema, dict):
        return None
    # id(subschema) -> (its parent's id or None, the pointer's last part or a $ref's whole
    # pointer) along the first path that reached it: pointers are joined only for the loop
    # reported (a pointer per node would be quadratic in the depth times the keys' length)
    nodes: dict[int, tuple[int | None, str]] = {}
    order: list[dict] = []
    groups: dict[int, list[list[dict]]] = {}  # each group: one member must start a value
    anchors: dict[str, dict] = {}  # "$anchor" -> its subschema, found once on first use
    todo: deque[tuple[Any, int | None, str]] = deque([(schema, None, "#")])
    while todo:
        node, parent, part = todo.popleft()
        if not isinstance(node, dict) or id(node) in nodes:
            continue
        here = id(node)
        nodes[here] = (parent, part)
        order.append(node)
        if node is not schema and "$id" in node:  # its own base URI: its $refs mean other
            groups[here] = []  # things (llguidance judges them); it counts as starting a value
            continue
        own: list[list[dict]] = []
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = resolve_ref(schema, ref, anchors)
            if isinstance(target, dict):
                own.append([target])
                todo.append((target, None, _canonical(ref)))
        for key in ("allOf", *_ALTERNATIVES):
            members = node.get(key)
            if not isinstance(members, list):
                continue
            subs = [(m, here, f"{key}/{i}") for i, m in enumerate(members) if isinstance(m, dict)]
            todo.extend(subs)
            if key == "allOf":
                own.extend([m] for m, _, _ in subs)
            elif subs and len(subs) == len(members):  # a `true`/`false` member starts a value
                own.append([m for m, _, _ in subs])
        for key, sub in _inner(node):
            todo.append((sub, here, key))
        groups[here] = own
    starts = _starting(order, groups)
    for node in order:
        if id(node) not in starts:
            loop = _loop(node, groups, starts)
            if len(loop) <= _SHOWN:
                return [_pointer(id(n), nodes) for n in loop]
            shown = [_pointer(id(n), nodes) for n in loop[: _SHOWN - 2]]
            return [*shown, f"... ({len(loop) - _SHOWN + 1} more)", shown[0]]
    return None


def _inner(node: dict) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key in _INNER_MAPS:
        value = node.get(key)
        if isinstance(value, dict):
            out += [(f"{key}/{_escape(k)}", v) for k, v in value.items()]
    for key in _INNER:
        if isinstance(node.get(key), dict):
            out.append((key, node[key]))
    for key in _INNER_LISTS:
        if isinstance(node.get(key), list):
            out += [(f"{key}/{i}", v) for i, v in enumerate(node[key])]
    return out


def _starting(order: list[dict], groups: dict[int, list[list[dict]]]) -> set[int]:
    """ids of the subschemas that may start a value: the least fixed point, by propagation
    from those with nothing to wait for (linear in the number of edges)."""
    pending = {id(n): len(groups[id(n)]) for n in order}
    waiting: dict[int, list[tuple[int, int]]] = {}  # member -> (schema, group index)
    for n in order:
        for g, members in enumerate(groups[id(n)]):
            for m in members:
                waiting.setdefault(id(m), []).append((id(n), g))
    done: set[tuple[int, int]] = set()
    ready = deque(i for i, count in pending.items() if count == 0)
    starts: set[int] = set()
    while ready:
        i = ready.popleft()
        if i in starts:
            continue
        starts.add(i)
        for parent, g in waiting.get(i, ()):
            if (parent, g) in done:
                continue
            done.add((parent, g))
            pending[parent] -= 1
            if pending[parent] == 0:
                ready.append(parent)
    return starts


def _loop(node: dict, groups: dict[int, list[list[dict]]], starts: set[int]) -> list[dict]:
    """Follow, from a schema that cannot start a value, a group with no member that can: it
    comes back to a schema on the way (all of them are finite and stuck)."""
    path: list[dict] = []
    seen: dict[int, int] = {}
    while id(node) not in seen:
        seen[id(node)] = len(path)
        path.append(node)
        stuck = next(g for g in groups[id(node)] if not any(id(m) in starts for m in g))
        node = stuck[0]
    return path[seen[id(node)] :] + [node]


def _pointer(i: int | None, nodes: dict[int, tuple[int | None, str]]) -> str:
    """The pointer of node id `i`, joined from its parents; its end when it is long."""
    parts: list[str] = []
    size = 0
    while i is not None and size <= _POINTER_CHARS:
        i, part = nodes[i]
        parts.append(part)
        size += len(part) + 1
    text = "/".join(reversed(parts))
    return text if i is None and len(text) <= _POINTER_CHARS else "…" + text[-_POINTER_CHARS:]


def resolve_ref(root: dict, ref: str, anchors: dict[str, dict]) -> Any:
    """The subschema `ref` points at inside `root` ("#", "#/json/pointer", "#anchor", or
    either after the root's own `$id`); None if it is elsewhere or missing. `anchors`: one
    dict per `root`, kept by the caller (filled with the root's `$anchor`s on first use)."""
    base = root.get("$id")
    if isinstance(base, str) and base and ref.startswith(base.split("#")[0]):
        ref = ref[len(base.split("#")[0]) :]
    if not ref.startswith("#"):
        return None
    fragment = unquote(ref[1:])
    if fragment and not fragment.startswith("/"):
        if not anchors:
            anchors.update(_anchors(root))
            anchors.setdefault("", root)  # (found: never searched again)
        return anchors.get(fragment)
    node: Any = root
    for part in fragment.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and 0 <= _index(part) < len(node):
            node = node[_index(part)]
        else:
            return None
        if isinstance(node, dict) and "$id" in node:  # inside another base URI's schema
            return None
    return node


def _index(part: str) -> int:
    """A pointer part as an array index; -1 unless ASCII digits (int() takes "²" no more than
    it takes 5000 digits)."""
    return int(part) if part.isascii() and part.isdigit() and len(part) < 19 else -1


def _anchors(root: dict) -> dict[str, dict]:
    found: dict[str, dict] = {}
    todo: list[Any] = [root]
    while todo:
        node = todo.pop()
        if isinstance(node, dict) and (node is root or "$id" not in node):  # (the root's own)
            name = node.get("$anchor")
            if isinstance(name, str):
                found.setdefault(name, node)
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return found


def _canonical(ref: str) -> str:
    return ref if ref.startswith("#") else ref[ref.find("#") :] if "#" in ref else ref


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def check_ref_cycles(schema: Any, where: str) -> None:
    """ValueError naming `where` if `schema` holds a `$ref` loop no value can leave."""
    loop = ref_cycle(schema)
    if loop is not None:
        raise ValueError(
            f"{where} is invalid: unresolvable $ref cycle {' -> '.join(loop)}: every path "
            "through it ($ref, allOf, anyOf, oneOf) leads back into it, so no JSON value can "
            "match; recurse through an object property or an array item, or add an anyOf "
            "alternative that ends the recursion"
        )
