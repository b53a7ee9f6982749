"""`StructuredOutputsParams`: what a request's output must match (vLLM's names and meanings).

Exactly one constraint per request:

    json         a JSON schema (dict or JSON text): the output is one JSON value valid under it;
                 `true` allows any JSON value, `false` (no value matches) is refused
    regex        the output matches the regular expression (Rust `regex` syntax, anchored)
    choice       the output is exactly one of these strings
    grammar      a context-free grammar: GBNF / EBNF (`root ::= ...`, as llama.cpp and xgrammar
                 write it) or Lark (`start: ...`)
    json_object  True: the output is any JSON object
    structural_tag  xgrammar's structural tag (JSON text or an object): free text with tagged
                 parts, e.g. tool calls whose arguments match a schema (structural_tag.py)

JSON is written with `json.dumps` spacing (", " and ": ") unless `whitespace_pattern` allows
free whitespace matching it (vLLM's default; small models then pad with newlines) or
`disable_any_whitespace` removes the spaces; `disable_additional_properties`: objects in the
schema take no keys beyond `properties`.
`disable_fallback` is accepted for vLLM compatibility: there is one backend, nothing to fall
back to.

Checked here: the shape (types, exactly one constraint). Whether the schema / regex / grammar
itself is valid is checked when the engine accepts the request (`grammar.py`), with a ValueError
naming the field.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
MAX_CHOICES = 16384  # their grammar compiles in ~0.1 s (grammar.py)


@dataclass(slots=True)
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | dict | None = None

    def __post_init__(self) -> None:
        if self.json_object is False:
            self.json_object = None
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object, structural_tag; got {given or 'none'}"
            )
        if self.json is not None:
            try:  # (a schema nested past Python's recursion limit: RecursionError)
                if isinstance(self.json, str):
                    parsed = _json.loads(self.json)
                else:  # key() dumps it: a cycle or a depth past Python's limit fails here
                    _json.dumps(self.json)
                    parsed = self.json
            except (ValueError, TypeError, RecursionError) as e:
                deep = isinstance(e, RecursionError)
                why = "is nested too deeply" if deep else f"is not valid JSON: {e}"
                raise ValueError(f"structured_outputs.json {why}") from None
            if not isinstance(parsed, (dict, bool)):
                kind = type(parsed).__name__
                raise ValueError(
                    "structured_outputs.json must be a JSON schema (an object, or true / "
                    f"false), got {kind}"
                )
        if self.structural_tag is not None and not isinstance(self.structural_tag, (str, dict)):
            raise ValueError(
                "structured_outputs.structural_tag must be JSON text or an object, got "
                f"{type(self.structural_tag).__name__}"
            )
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            listed = isinstance(self.choice, (list, tuple))
            if listed and len(self.choice) > MAX_CHOICES:
                raise ValueError(
                    f"structured_outputs.choice holds at most {MAX_CHOICES} strings, got "
                    f"{len(self.choice)}"
                )
            items = self.choice if listed else ()
            bad = [c for c in items if not (isinstance(c, str) and c)][:1]
            if not listed or not self.choice or bad:
                shown = bad[0] if bad else self.choice  # one bad item, not the whole list
                raise ValueError(
                    "structured_outputs.choice must be a non-empty list of non-empty strings, "
                    f"got {shown!r:.200}"
                )
            self.choice = list(self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(
                f"structured_outputs.json_object must be true, got {self.json_object!r:.200}"
            )
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool")

    def all_constraints_none(self) -> bool:
        """vLLM's: True when no constraint field is set (construction requires one; code may
        clear it afterwards)."""
        return all(getattr(self, name) is None for name in CONSTRAINTS)

    def all_non_structural_tag_constraints_none(self) -> bool:
        """vLLM's: True when no constraint other than structural_tag is set."""
        return all(getattr(self, name) is None for name in CONSTRAINTS if name != "structural_tag")

    @property
    def kind(self) -> str:
        """The one constraint set: 'json', 'regex', 'choice', 'grammar', 'json_object' or
        'structural_tag'."""
        return next(name for name in CONSTRAINTS if getattr(self, name) is not None)

    @property
    def schema(self) -> Any:
        """The JSON schema as a Python value (json and json_object only)."""
        if self.json_object:
            return {"type": "object"}
        return _json.loads(self.json) if isinstance(self.json, str) else self.json

    def key(self) -> str:
        """A text of everything that shapes the grammar: the compile-cache key. Keys keep their
        order: a schema's `properties` order is the order the output writes them in."""
        spec = self.schema if self.kind in ("json", "json_object") else getattr(self, self.kind)
        return _json.dumps(
            [self.kind, spec, self.disable_any_whitespace, self.disable_additional_properties,
             self.whitespace_pattern],
        )  # fmt: skip

    @classmethod
    def from_dict(cls, value: Any, name: str = "structured_outputs") -> StructuredOutputsParams:
        """From a JSON object (the server's `structured_outputs` field); errors name `name`."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be an object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"{name} has unknown fields {unknown}")
        return cls(**value)


# vLLM's earlier name for the same parameters.
GuidedDecodingParams = StructuredOutputsParams
