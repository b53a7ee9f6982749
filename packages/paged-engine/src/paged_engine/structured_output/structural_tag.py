"""vLLM's `structural_tag` (xgrammar's structural tags) -> a Lark grammar for llguidance.

Two forms, as vLLM takes them (a JSON string or object):

    {"type": "structural_tag", "format": FORMAT}                    xgrammar's format tree
    {"structures": [{"begin", "schema", "end"}], "triggers": [...]}  the older form: triggered
                                                                     tags with JSON contents

FORMAT is one of

    {"type": "const_string", "value": s}            exactly s
    {"type": "json_schema", "json_schema": schema}  one JSON value valid under it (`true`: any;
                                                    `false`, which nothing matches, is refused)
    {"type": "regex", "pattern": p}                 text matching p
    {"type": "any_text"}                            any text; inside a tag (or before a constant)
                                                    it ends at the first occurrence of what
                                                    follows it, which it cannot contain
    {"type": "sequence", "elements": [F, ...]}      each in turn
    {"type": "or", "elements": [F, ...]}            one of them
    {"type": "tag", "begin": b, "content": F, "end": e}
    {"type": "triggered_tags", "triggers": [t, ...], "tags": [TAG, ...],
     "at_least_one": false, "stop_after_first": false}
        free text until a trigger appears, then one of the tags whose `begin` starts with that
        trigger, then free text again; the free text never holds a trigger (outside a tag).
        `at_least_one`: one tag or more; `stop_after_first`: the output ends after a tag.
        Only as the whole format or its last part (its free text runs to the end).
    {"type": "tags_with_separator", "tags": [TAG, ...], "separator": s,
     "at_least_one": false, "stop_after_first": false}
        tags separated by s and nothing else (possibly none)

JSON inside is written as the `json` constraint writes it (json.dumps spacing, or as
`disable_any_whitespace` / `whitespace_pattern` say). Lazy lexemes
end free text at the first trigger or end string: llguidance's lexer is greedy and does not
back off, so text that may run into what follows is cut there explicitly. Every error is a
ValueError naming the path (`structural_tag.format.tags[1].begin`).
"""

from __future__ import annotations

import json
from typing import Any

from paged_engine.structured_output.schema_refs import check_ref_cycles

_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")  # escaped in llguidance's /regex/ ("<" ">" are not)
# json.dumps spacing, as the `json` constraint writes JSON by default
_JSON_SPACING = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def structural_tag_lark(
    spec: Any, name: str = "structural_tag", json_options: dict[str, Any] | None = None
) -> str:
    """The Lark grammar of a structural tag (JSON text or an object); ValueError naming the
    offending path. `json_options`: llguidance's JSON spacing options (the `json`
    constraint's)."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"{name} must be an object, got {type(spec).__name__}")
    if "format" in spec:
        kind = spec.get("type", "structural_tag")
        if kind != "structural_tag":
            raise ValueError(f"{name}.type must be 'structural_tag', got {kind!r}")
        fmt, where = spec["format"], f"{name}.format"
    elif "structures" in spec:
        fmt, where = _legacy(spec, name), name
    else:
        raise ValueError(
            f"{name} needs 'format' (xgrammar's structural tag) or 'structures' and 'triggers'"
        )
    builder = _Builder(json_options or _JSON_SPACING)
    body, _ = builder.format(fmt, where, follow=None)
    return "\n".join([f"start: {body}", *builder.rules]) + "\n"


def _legacy(spec: dict, name: str) -> dict:
    """vLLM's older form as the triggered_tags format it stands for."""
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError(f"{name}.structures must be a non-empty list")
    tags = []
    for i, s in enumerate(structures):
        where = f"{name}.structures[{i}]"
        if not isinstance(s, dict) or set(s) - {"begin", "schema", "end"}:
            raise ValueError(f"{where} must be an object with 'begin', 'schema' and 'end'")
        schema = s.get("schema", {})
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"{where}.schema is not valid JSON: {e}") from None
        if schema is False:
            raise ValueError(f"{where}.schema is invalid: the schema `false` matches no JSON value")
        content = {"type": "json_schema", "json_schema": schema}
        tags.append(
            {"type": "tag", "begin": s.get("begin"), "content": content, "end": s.get("end")}
        )
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags}


class _Builder:
    """Lark rules for a format tree: `format` returns the expression standing for a format
    and whether it consumed the constant that follows it (an any_text cut at it)."""

    def __init__(self, json_options: dict[str, Any]) -> None:
        self.rules: list[str] = []
        self.json_options = json_options

    def _rule(self, body: str, attrs: str = "") -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}{attrs}: {body}")
        return name

    def _token(self, body: str) -> str:
        name = f"T{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def format(self, fmt: Any, where: str, follow: str | None) -> tuple[str, bool]:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise ValueError(f"{where} must be an object with a string 'type'")
        kind = fmt["type"]
        handler = getattr(self, f"_{kind}", None) if kind in _KINDS else None
        if handler is None:
            raise ValueError(f"{where}.type {kind!r} is not one of {sorted(_KINDS)}")
        unknown = sorted(set(fmt) - _KINDS[kind] - {"type"})
        if unknown:
            raise ValueError(f"{where} ({kind}) has unknown fields {unknown}")
        return handler(fmt, where, follow)

    def _const_string(self, fmt: dict, where: str, follow: str | None) -> tuple[str, bool]:
        value = _string(fmt, "value", where, empty=True)
        return (_literal(value) if value else '""'), False

    def _json_schema(self, fmt: dict, where: str, follow: str | None) -> tuple[str, bool]:
        schema = fmt.get("json_schema")
        if schema is False:  # (xgrammar: "Schema 'false' cannot accept any value")
            raise ValueError(
                f"{where}.json_schema is invalid: the schema `false` matches no JSON value"
            )
        if schema is True:  # any JSON value
            schema = {}
        if not isinstance(schema, dict):
            raise ValueError(f"{where}.json_schema must be a JSON schema (an object)")
        text = json.dumps({**schema, "x-guidance": self.json_options})
        if '"$ref"' in text:
            check_ref_cycles(schema, f"{where}.json_schema")
        return "%json " + text, False

    def _regex(self, fmt: dict, where: str, follow: str | None) -> tuple[str, bool]:
        pattern = _string(fmt, "pattern", where)
        return self._token("/" + pattern.replace("/", "\\/") + "/"), False

    def _any_text(self, fmt: dict, where: str, follow: str | None) -> tuple[str, bool]:
        if follow is None:
            return self._token(r"/(.|\n)*/"), False
        return self._rule(f"/(.|\\n)*{_escape(follow)}/", "[lazy]"), True

    def _sequence(self, fmt: dict, where: str, follow: str | None) -> tuple[str, bool]:
        elements = _elements(fmt, where)
        parts: list[str] = []
        consumed = False
        skip = False
        for i, element in enumerate(elements):
            if skip:  # a constant an any_text before it ended at
                skip = False
                continue
            last = i == len(elements) - 1
            nxt = elements[i + 1] if not last else None
            after = follow if last else _const_value(nxt)
            expr, took = self.format(element, f"{where}.elements[{i}]", after)
            parts.append(expr)
            if took:
                if last:
                    consumed = True
                else:
                    skip = True
            elif not last and _is_open(element):
                raise ValueError(
                    f"{where}.elements[{i}]: free text must end the output or be followed by "
                    "a const_string"
                )
        return "(" + " ".join(parts) + ")", consumed

    def _or(self, fmt: dict, where: str, follow: str | None) -> tuple[str, bool]:
        alts = []
        for i, element in enumerate(_elements(fmt, where)):
            expr, took = self.format(element, f"{where}.elements[{i}]", follow)
            alts.append(expr if took or follow is None else f"{expr} {_literal(follow)}")
        if follow is None:
            return "(" + " | ".join(alts) + ")", False
        return "(" + " | ".join(alts) + ")", True  # each alternative holds the follower

    def _tag(self, fmt: dict, where: str, follow: str | None) -> tuple[str, bool]:
        begin = _string(fmt, "begin", where, empty=True)
        end = _string(fmt, "end", where, empty=True)
        if "content" not in fmt:
            raise ValueError(f"{where} needs a 'content' format")
        expr, took = self.format(fmt["content"], f"{where}.content", end or follow)
        parts = [_literal(begin)] if begin else []
        parts.append(expr)
        if end and not took:
            parts.append(_literal(end))
        return "(" + " ".join(parts) + ")", took and not end

    def _tags(self, fmt: dict, where: str) -> list[dict]:
        tags = fmt.get("tags")
        if not isinstance(tags, list) or not tags:
            raise ValueError(f"{where}.tags must be a non-empty list of tag formats")
        for i, tag in enumerate(tags):
            if not isinstance(tag, dict) or tag.get("type", "tag") != "tag":
                raise ValueError(f"{where}.tags[{i}] must be a tag format")
        return [{**t, "type": "tag"} for t in tags]

    def _triggered_tags(self, fmt: dict, where: str, follow: str | None) -> tuple[str, bool]:
        if follow is not None:
            raise ValueError(
                f"{where}: triggered_tags must end the output (its free text runs to the end)"
            )
        triggers = fmt.get("triggers")
        if (
            not isinstance(triggers, list)
            or not triggers
            or not all(isinstance(t, str) and t for t in triggers)
        ):
            raise ValueError(f"{where}.triggers must be a non-empty list of non-empty strings")
        tags = self._tags(fmt, where)
        any_trigger = "|".join(_escape(t) for t in triggers)
        by_trigger: dict[str, list[str]] = {t: [] for t in triggers}
        for i, tag in enumerate(tags):
            begin = tag.get("begin")
            owners = [t for t in triggers if isinstance(begin, str) and begin.startswith(t)]
            if len(owners) != 1:
                raise ValueError(
                    f"{where}.tags[{i}].begin must start with exactly one of the triggers "
                    f"({len(owners)} do)"
                )
            rest = {**tag, "begin": begin[len(owners[0]) :]}
            by_trigger[owners[0]].append(self.format(rest, f"{where}.tags[{i}]", None)[0])
        segments = []
        for trigger, rests in by_trigger.items():
            if not rests:
                continue
            # text up to and with this trigger, holding no trigger before it
            pre = self._token(f"/(.|\\n)*{_escape(trigger)}/ & ~/(.|\\n)*({any_trigger})(.|\\n)+/")
            segments.append(f"{pre} ({' | '.join(rests)})")
        segment = self._rule(" | ".join(segments))
        tail = self._token(f"/(.|\\n)*/ & ~/(.|\\n)*({any_trigger})(.|\\n)*/")
        at_least_one, stop = _flags(fmt, where)
        if stop:
            return (segment if at_least_one else f"({segment} | {tail})"), False
        return f"({segment}{'+' if at_least_one else '*'} {tail})", False

    def _tags_with_separator(self, fmt: dict, where: str, follow: str | None) -> tuple[str, bool]:
        separator = _string(fmt, "separator", where, empty=True)
        tags = self._tags(fmt, where)
        one = self._rule(
            " | ".join(self.format(t, f"{where}.tags[{i}]", None)[0] for i, t in enumerate(tags))
        )
        at_least_one, stop = _flags(fmt, where)
        sep = _literal(separator) + " " if separator else ""
        many = one if stop else f"{one} ({sep}{one})*"
        return (f"({many})" if at_least_one else f"({many})?"), False


_KINDS: dict[str, set[str]] = {
    "const_string": {"value"},
    "json_schema": {"json_schema"},
    "regex": {"pattern"},
    "any_text": set(),
    "sequence": {"elements"},
    "or": {"elements"},
    "tag": {"begin", "content", "end"},
    "triggered_tags": {"triggers", "tags", "at_least_one", "stop_after_first"},
    "tags_with_separator": {"tags", "separator", "at_least_one", "stop_after_first"},
}


def _string(fmt: dict, key: str, where: str, empty: bool = False) -> str:
    value = fmt.get(key)
    if not isinstance(value, str) or not (value or empty):
        raise ValueError(f"{where}.{key} must be a {'' if empty else 'non-empty '}string")
    return value


def _elements(fmt: dict, where: str) -> list:
    elements = fmt.get("elements")
    if not isinstance(elements, list) or not elements:
        raise ValueError(f"{where}.elements must be a non-empty list of formats")
    return elements


def _flags(fmt: dict, where: str) -> tuple[bool, bool]:
    flags = (fmt.get("at_least_one", False), fmt.get("stop_after_first", False))
    if not all(isinstance(f, bool) for f in flags):
        raise ValueError(f"{where}: at_least_one and stop_after_first must be booleans")
    return flags


def _const_value(fmt: Any) -> str | None:
    """The text of a non-empty const_string format, else None."""
    if isinstance(fmt, dict) and fmt.get("type") == "const_string":
        value = fmt.get("value")
        return value if isinstance(value, str) and value else None
    return None


def _is_open(fmt: Any) -> bool:
    """Whether a format's text may run on (any_text / triggered_tags at its end)."""
    if not isinstance(fmt, dict):
        return False
    kind = fmt.get("type")
    if kind in ("any_text", "triggered_tags"):
        return True
    if kind == "sequence" and isinstance(fmt.get("elements"), list) and fmt["elements"]:
        return _is_open(fmt["elements"][-1])
    if kind == "or" and isinstance(fmt.get("elements"), list):
        return any(_is_open(e) for e in fmt["elements"])
    return kind == "tag" and not fmt.get("end") and _is_open(fmt.get("content"))


def _literal(text: str) -> str:
    return json.dumps(text)


def _escape(text: str) -> str:
    """`text` as a literal inside llguidance's /regex/."""
    out = []
    for c in text:
        if c in _REGEX_META:
            out.append("\\" + c)
        elif c == "\n":
            out.append("\\n")
        elif c == "\t":
            out.append("\\t")
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\x{{{ord(c):x}}}")
        else:
            out.append(c)
    return "".join(out)
