"""Tool calling for /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`.

    tool_choice "none"      the tools are shown to the chat template; the output is plain text
    "auto" (default)        the model decides; its text is parsed with --tool-call-parser
                            (hermes, llama3_json, openai, ...) into `tool_calls` (400 without
                            a parser)
    "required"              the output is forced (structured outputs) to a JSON array of
                            {"name", "parameters"} objects, one of the tools each, at least one
                            (exactly one when parallel_tool_calls is false)
    {"type": "function", "function": {"name": N}}   forced to N's parameters schema as sent
                            (`{}`: any JSON value); N without parameters is not constrained
                            (its text is the arguments), as vLLM's get_json_schema_from_tools

parallel_tool_calls false keeps only the first parsed call (index 0 in a stream), as vLLM's
maybe_filter_parallel_tool_calls does; the Responses and Messages APIs pass theirs through.

Forced outputs are valid JSON for the functions' parameters by construction, unless max_tokens
cuts them short (finish_reason "length"): then a named call carries the partial arguments text
and "required" the calls announced before the cut, the last with its partial arguments; never
the forced JSON as content. Forced calls stream as they are generated (forced_calls.py: the
same reader makes the whole answer, so a call's streamed pieces join to its arguments).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from paged_server.errors import bad_request
from paged_server.forced_calls import ForcedCalls, forced_calls
from paged_server.tool_parsers import TOOL_PARSERS, ParsedCall, ToolParser
from paged_server.tool_parsers.base import parse_or_content

# llguidance's parser follows at most 2000 alternatives at a time: past that a forced call list
# failed after its first token (a 200 with no call)
MAX_REQUIRED_TOOLS = 1024


@dataclass(slots=True)
class ToolRequest:
    tools: list[dict[str, Any]]  # OpenAI's tool objects, for the chat template
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None
    parallel: bool = True
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> parameters
    # name -> parameters as sent (None: absent or null); schemas maps a falsy one to an object
    sent: dict[str, dict[str, Any] | None] = field(default_factory=dict)

    def constraint(self) -> dict[str, Any] | None:
        """structured_outputs forcing the call(s), for "required" and a named function."""
        if self.choice == "named":  # vLLM forces the parameters as sent, none when absent
            assert self.named is not None
            params = self.sent[self.named]
            return None if params is None else {"json": params}
        if self.choice != "required":
            return None
        one_of = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in self.schemas.items()
        ]
        array: dict[str, Any] = {"type": "array", "items": {"anyOf": one_of}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return {"json": array}

    def calls_from_forced(self, text: str) -> list[ParsedCall]:
        """The tool calls of a forced output (what its stream announces, forced_calls.py)."""
        return forced_calls(text, self.named if self.choice == "named" else None)


def parse_tools(body: dict[str, Any], parser_name: str | None) -> ToolRequest | None:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel  # null: the default (vLLM's bool | None)
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if tools == []:  # vLLM (check_tool_usage), as OpenAI: omit the field instead
        raise bad_request(
            "'tools' must not be an empty array: give at least one tool or omit the field",
            "tools",
        )
    if tools is None:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of tool objects", "tools")
    schemas: dict[str, dict[str, Any]] = {}
    sent: dict[str, dict[str, Any] | None] = {}
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(f"{param} must be {{'type': 'function', 'function': {{...}}}}", param)
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{param}.function.name must be a non-empty string", param)
        if name in schemas:
            raise bad_request(f"{param}: duplicate function name {name!r}", param)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"{param}.function.parameters must be a JSON schema object", param)
        sent[name] = params
        schemas[name] = params or {"type": "object", "properties": {}}
    req = ToolRequest(tools=tools, choice="auto", parallel=parallel, schemas=schemas, sent=sent)
    if choice is None or choice == "auto":
        if parser_name is None:
            raise bad_request(
                "tool_choice 'auto' needs the server started with --tool-call-parser "
                f"({' or '.join(TOOL_PARSERS)})",
                "tool_choice",
            )
    elif choice in ("none", "required"):
        req.choice = choice
        if choice == "required" and len(schemas) > MAX_REQUIRED_TOOLS:
            raise bad_request(
                f"a required tool call chooses among at most {MAX_REQUIRED_TOOLS} tools, got "
                f"{len(schemas)}: its grammar holds one alternative per tool",
                "tools",
            )
    elif isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in schemas:
            raise bad_request(f"'tool_choice' names an unknown function {name!r}", "tool_choice")
        req.choice, req.named = "named", name
    else:
        raise bad_request(
            "'tool_choice' must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    return req


def call_id_maker(parser: ToolParser | None) -> Callable[[], str]:
    """The parser's call ids (OpenAI-style unless its model checks them: Mistral's)."""
    return (parser or ToolParser).new_call_id


def tool_call_json(
    calls: list[ParsedCall], new_id: Callable[[], str] = ToolParser.new_call_id
) -> list[dict[str, Any]]:
    """OpenAI's message.tool_calls."""
    return [
        {
            "id": new_id(),
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in calls
    ]


def make_parser(name: str | None) -> ToolParser | None:
    return None if name is None else TOOL_PARSERS[name]()


class ToolOutput:
    """One chat choice's text -> content and tool calls: whole (`message`) or as a stream
    (`rewrite`, applied to each chunk entry of that choice)."""

    def __init__(self, req: ToolRequest, parser: ToolParser | None) -> None:
        self.req = req
        self.parser = parser if req.choice == "auto" else None
        if self.parser is not None:
            self.parser.schemas = req.schemas
        self.stream = self.parser.streamer() if self.parser is not None else None
        forced = req.choice in ("required", "named")
        self.forced = ForcedCalls(req.named if req.choice == "named" else None) if forced else None
        self.new_id = call_id_maker(parser)  # forced calls too

    def _calls(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        if self.req.choice in ("required", "named"):  # the text is the calls' JSON, not content
            return None, self.req.calls_from_forced(text)
        if self.parser is not None:
            return parse_or_content(self.parser, text)
        return text, []

    def _finish_reason(self, calls: list[ParsedCall], reason: str | None) -> str | None:
        if calls and self.req.choice != "named" and reason == "stop":
            return "tool_calls"
        return reason

    def message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        content, calls = self._calls(text)
        if not self.req.parallel:  # vLLM keeps the first call of a parsed output
            calls = calls[:1]
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = tool_call_json(calls, self.new_id)
        return msg, self._finish_reason(calls, reason)

    def rewrite(self, entry: dict[str, Any]) -> dict[str, Any] | None:
        """The chunk entry with its content passed through the tool logic; None if nothing is
        left to send this time."""
        if self.req.choice == "none":
            return entry
        delta = entry.get("delta", {})
        text = delta.get("content", "")
        reason = entry.get("finish_reason")
        entries: list[dict[str, Any]] = []  # delta.tool_calls
        shown = ""
        if self.stream is not None:
            shown, entries = self.stream.feed(text)
        elif self.forced is not None:  # the text is the calls' JSON, never content
            entries = self.forced.feed(text)
        calls: list[ParsedCall] = []
        if reason is not None:
            if self.stream is not None:
                rest, more, calls = self.stream.finish()
                shown, entries = shown + rest, entries + more
            elif self.forced is not None:
                more, calls = self.forced.finish()
                entries += more
        if not self.req.parallel:  # as message(): the first call only
            entries = [e for e in entries if e["index"] == 0]
        # reasoning.py split the reasoning off before: it passes through
        new_delta = {k: v for k, v in delta.items() if k in ("reasoning_content", "reasoning")}
        if shown:
            new_delta["content"] = shown
        if entries:
            for e in entries:  # the parser's own id for each call, once announced
                if "id" in e:
                    e["id"] = self.new_id()
            new_delta["tool_calls"] = _merge_by_index(entries)
        if not new_delta and reason is None:
            return None
        return {**entry, "delta": new_delta, "finish_reason": self._finish_reason(calls, reason)}


def _merge_by_index(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per call in a chunk: pieces of the same call's arguments joined."""
    merged: dict[int, dict[str, Any]] = {}
    for e in entries:
        m = merged.get(e["index"])
        if m is None:
            merged[e["index"]] = {**e, "function": dict(e["function"])}
        else:
            m["function"]["arguments"] = m["function"].get("arguments", "") + e["function"].get(
                "arguments", ""
            )
    return list(merged.values())
