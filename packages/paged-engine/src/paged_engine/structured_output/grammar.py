"""From `StructuredOutputsParams` to a checked llguidance grammar (no tokenizer, no torch).

llguidance backs structured outputs: on our workload it compiles a schema in ~1 ms where
xgrammar takes up to 100-400 ms, and fills a batch-32 mask faster (benchmarks/
structured_backends.py, docs/benchmarks/cpu/structured_backends.json). `grammar_text` turns the
parameters into llguidance's grammar and validates it, raising a ValueError that names the
field; results are cached per constraint, so the server's HTTP thread and the engine's input
processor checking the same request pay once.

JSON spacing: by default as `json.dumps` writes it (", " and ": ", no newlines). vLLM's default
lets whitespace go anywhere JSON allows it, and small models then pad with newlines until
max_tokens (SmolLM2 does, on 11 of our 12 schemas); `whitespace_pattern` opts into that,
`disable_any_whitespace` removes the spaces too.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from paged_engine.structured_output.params import StructuredOutputsParams
from paged_engine.structured_output.structural_tag import structural_tag_lark

EXTRA_HINT = "install it with: pip install 'paged-engine[structured]'"


def import_llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:
        raise ImportError(
            f"structured outputs need the optional dependency llguidance ({EXTRA_HINT})"
        ) from e
    return llguidance


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of `params`; ValueError (naming the field) if it is invalid."""
    return _grammar_text(params.key())


@functools.lru_cache(maxsize=512)
def _grammar_text(key: str) -> str:
    kind, spec, no_whitespace, no_extra_props, whitespace = json.loads(key)
    llg = import_llguidance()
    matcher = llg.LLMatcher
    field = f"structured_outputs.{kind}"
    try:
        if kind in ("json", "json_object"):
            if no_extra_props and isinstance(spec, dict):
                spec = _close_objects(spec)
            options = _json_options(no_whitespace, whitespace)
            grammar = matcher.grammar_from_json_schema(spec, overrides=options)
        elif kind == "regex":
            grammar = matcher.grammar_from_regex(spec)
        elif kind == "choice":  # one lexeme: the parser follows at most 2000 alternatives
            choices = " | ".join(json.dumps(c) for c in spec)
            grammar = matcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {choices}")
        elif kind == "structural_tag":
            options = _json_options(no_whitespace, whitespace)
            grammar = matcher.grammar_from_lark(structural_tag_lark(spec, field, options))
        else:  # GBNF / EBNF or Lark
            grammar = llg.grammar_from("grammar", spec)
    except (ValueError, TypeError, RuntimeError) as e:
        why = str(e)  # (a structural tag's errors name their path already)
        raise ValueError(why if why.startswith(field) else f"{field} is invalid: {why}") from None
    error = matcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"{field} is invalid: {error.strip()}")
    return grammar


def _json_options(no_whitespace: bool, whitespace: str | None) -> dict[str, Any]:
    """llguidance's JSON options for the spacing the parameters ask for."""
    if whitespace is not None:  # whitespace where JSON allows it, matching the pattern
        return {"whitespace_flexible": True, "whitespace_pattern": whitespace}
    if no_whitespace:  # no whitespace at all: {"a":1,"b":[2,3]}
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    # json.dumps spacing: {"a": 1, "b": [2, 3]}
    return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _close_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that does not say."""
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _close_objects(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out
