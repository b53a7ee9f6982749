"""Structured-output fields of a request -> the engine's `structured_outputs` (plain dicts).

Three spellings of one feature, at most one per request:

    response_format      OpenAI: {"type": "text" | "json_object" | "json_schema",
                                  "json_schema": {"name", "schema", "strict", "description"}};
                         vLLM's {"type": "structural_tag", "format": {...}} (or the older
                         "structures" and "triggers")
    guided_json / guided_regex / guided_choice / guided_grammar   vLLM's extra parameters
                         (with guided_whitespace_pattern; guided_decoding_backend is accepted
                         and ignored: one grammar engine serves them all)
    structured_outputs   vLLM's newer object: {"json" | "regex" | "choice" | "grammar" |
                         "json_object" | "structural_tag": ..., options}
    structural_tag       older vLLM's top-level spelling (JSON text)

Returns the dict for `SamplingParams(structured_outputs=...)` and the request field it came from,
so the engine's verdict on the grammar itself (an invalid schema or regex) names that field.
"""

from __future__ import annotations

from typing import Any

from paged_server.errors import APIError, bad_request

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
TOP_LEVEL = (*GUIDED, "structural_tag")  # each a constraint of its own name (less guided_)
FIELDS = frozenset(
    {
        "response_format",
        "structured_outputs",
        "guided_whitespace_pattern",
        "guided_decoding_backend",
        *TOP_LEVEL,
    }
)


def parse_structured(body: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """(structured_outputs dict or None, the field that set it)."""
    found: list[tuple[dict[str, Any], str]] = []
    rf = _response_format(body.get("response_format"))
    if rf is not None:
        found.append((rf, "response_format"))
    for name in TOP_LEVEL:
        if body.get(name) is not None:
            found.append(({name.removeprefix("guided_"): body[name]}, name))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("'structured_outputs' must be an object", "structured_outputs")
        found.append((dict(so), "structured_outputs"))
    ws = body.get("guided_whitespace_pattern")
    if ws is not None and not isinstance(ws, str):
        raise bad_request(
            "'guided_whitespace_pattern' must be a string", "guided_whitespace_pattern"
        )
    backend = body.get("guided_decoding_backend")
    if backend is not None and not isinstance(backend, str):
        raise bad_request("'guided_decoding_backend' must be a string", "guided_decoding_backend")
    if len(found) > 1:
        names = [name for _, name in found]
        raise bad_request(
            f"only one structured-output constraint per request, got {names}", names[1]
        )
    if not found:
        return None, None
    spec, name = found[0]
    if isinstance(spec.get("json"), bool):  # vLLM's types (str | dict) refuse a boolean schema
        raise bad_request(
            f"'{name}': a JSON schema must be an object or JSON text, got "
            f"{str(spec['json']).lower()} (a boolean schema: use {{}} for any JSON value)",
            name,
        )
    if ws is not None:
        spec.setdefault("whitespace_pattern", ws)
    return spec, name


def _response_format(rf: Any) -> dict[str, Any] | None:
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad_request(
            "'response_format' must be an object with a string 'type'", "response_format"
        )
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "structural_tag":  # the grammar's checks name its paths (structural_tag.py)
        structures = rf.get("structures")
        for i, s in enumerate(structures if isinstance(structures, list) else []):
            schema = s.get("schema") if isinstance(s, dict) else None
            if schema is not None and not isinstance(schema, dict):  # (vLLM: dict[str, Any])
                raise bad_request(
                    f"'response_format.structures[{i}].schema' must be an object", "response_format"
                )
        return {"structural_tag": rf}
    if kind != "json_schema":
        raise bad_request(
            "'response_format.type' must be 'text', 'json_object', 'json_schema' or "
            f"'structural_tag', got {kind!r}",
            "response_format",
        )
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise bad_request(
            "'response_format.json_schema' must be an object with 'name' and 'schema'",
            "response_format",
        )
    if not isinstance(js.get("name"), str) or not js["name"]:
        raise bad_request(
            "'response_format.json_schema.name' must be a non-empty string", "response_format"
        )
    schema = js.get("schema")  # None (absent or null): refused unless a forced call wins
    if schema is not None and not isinstance(
        schema, dict
    ):  # (vLLM's type: dict; a boolean schema too is a 400)
        raise bad_request(
            "'response_format.json_schema.schema' must be an object", "response_format"
        )
    if js.get("strict") not in (None, True, False):
        raise bad_request(
            "'response_format.json_schema.strict' must be a boolean", "response_format"
        )
    return {"json": schema}  # (`{}`: any JSON value, as vLLM passes it on)


def check_schema_given(spec: dict[str, Any] | None, param: str | None) -> None:
    """A json_schema response_format without a schema constrains nothing: vLLM's
    StructuredOutputsParams(json=None) refuses it (a 400), unless a forced tool call's schema
    replaced the format first (its tool parser's adjust_request)."""
    if param == "response_format" and spec is not None and "json" in spec and spec["json"] is None:
        raise bad_request(
            "'response_format.json_schema.schema' is required: a json_schema format without "
            "a schema constrains nothing (use 'json_object' for any JSON object)",
            param,
        )


def check_structured(params: Any, param: str | None) -> None:
    """Check the grammar on the HTTP thread (400 naming the request field): an invalid schema,
    regex or grammar, or the optional dependency missing. The engine reuses the cached result.
    No thread left to run the check on is the server's state, not the request's: a 503 that
    asks the client to retry (the engine never saw the request)."""
    from paged_engine.structured_output.grammar import GrammarBusyError, grammar_text

    try:
        grammar_text(params.structured_outputs)
    except (ValueError, ImportError) as e:
        raise bad_request(f"'{param}': {e}", param) from None
    except GrammarBusyError as e:
        raise busy(e) from None


def busy(e: Exception) -> APIError:
    """The 503 for a GrammarBusyError (no thread to build a grammar), here or where the
    engine thread adds the request: the client may retry."""
    return APIError(503, f"server busy: {e}", headers={"Retry-After": "1"})
