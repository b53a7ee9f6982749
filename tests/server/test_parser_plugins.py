"""--tool-parser-plugin / --reasoning-parser-plugin: a user's file registers a tool-call parser
and a reasoning format; the server parses a scripted model's calls and reasoning with them,
whole and streamed; bad files and names are refused naming the flag."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fake_engine import ScriptedEngine
from server_proc import chat_stream, serve_in_process

from paged_server.cli_args import parse_args
from paged_server.reasoning import THINK_FORMATS
from paged_server.tool_parsers import TOOL_PARSERS

PLUGIN = '''
import json
import re
from paged_server.parser_plugins import register_reasoning_parser, register_tool_parser
from paged_server.reasoning import ThinkFormat
from paged_server.tool_parsers import ToolParser
from paged_server.tool_parsers.streaming import scan_call

MARK = "@@call "


@register_tool_parser("at_calls")
class AtCalls(ToolParser):
    """One call a line: @@call {"name": ..., "arguments": {...}}."""

    start_markers = (MARK,)

    def parse(self, text):
        start = text.find(MARK)
        if start < 0:
            return text, []
        calls = []
        for line in text[start:].split(MARK)[1:]:
            call = self.call_from(json.loads(line.strip()))
            if call is None:
                return text, []
            calls.append(call)
        return text[:start].strip() or None, calls

    def partial_calls(self, text):
        calls = []
        for found in re.finditer(re.escape(MARK), text):
            brace = text.find("{", found.end())
            if brace < 0 or (calls and calls[-1].end is None):
                break
            calls.append(scan_call(text, brace, ("arguments",)))
        return calls


register_reasoning_parser("reason_tags", ThinkFormat(("<reason>",), ("</reason>",)))
'''
SCRIPT = (
    '<reason>check the city</reason>Sure. @@call {"name": "get_weather", "arguments": '
    '{"city": "Paris"}}'
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def plugin_file(tmp_path_factory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("plugins") / "my_parsers.py"
    path.write_text(textwrap.dedent(PLUGIN))
    yield str(path)
    TOOL_PARSERS.pop("at_calls", None)  # the registries are the process's
    THINK_FORMATS.pop("reason_tags", None)


@pytest.fixture(scope="module")
def srv(plugin_file) -> Iterator[SimpleNamespace]:
    argv = ["--max-model-len", "1024", "--served-model-name", "tiny"]
    argv += ["--tool-parser-plugin", plugin_file, "--tool-call-parser", "at_calls"]
    argv += ["--reasoning-parser-plugin", plugin_file, "--reasoning-parser", "reason_tags"]
    parse_args(["m", *argv])  # what paged-server runs first: the plugin registers its names
    engine = ScriptedEngine(max_model_len=1024, step_time=0.0005)
    with serve_in_process(argv, engine) as (http, _):
        yield SimpleNamespace(http=http, engine=engine)


def test_the_plugins_parsers_serve(srv) -> None:
    srv.engine.script = SCRIPT
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather?"}]}
    status, _, r = srv.http.request("POST", "/v1/chat/completions", {**body, "tools": TOOLS})
    assert status == 200, r
    msg = r["choices"][0]["message"]
    assert r["choices"][0]["finish_reason"] == "tool_calls"
    assert msg["reasoning_content"] == "check the city" and msg["content"] == "Sure."
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    streamed = chat_stream(srv, SCRIPT, tools=TOOLS)
    assert streamed["reasoning"] == "check the city" and streamed["content"].strip() == "Sure."
    calls = list(streamed["calls"].values())
    assert [json.loads(c["arguments"]) for c in calls] == [{"city": "Paris"}]
    assert streamed["finish"] == "tool_calls"


def test_bad_plugins_and_names_are_refused_naming_the_flag(plugin_file, tmp_path, capsys):
    cases = [
        (["--tool-parser-plugin", str(tmp_path / "missing.py")], "--tool-parser-plugin"),
        (["--tool-call-parser", "nope"], "--tool-call-parser"),
        (["--reasoning-parser", "nope"], "--reasoning-parser"),
    ]
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('not today')\n")
    cases.append((["--reasoning-parser-plugin", str(broken)], "not today"))
    clash = tmp_path / "clash.py"
    clash.write_text(
        "from paged_server.parser_plugins import register_tool_parser\n"
        "from paged_server.tool_parsers import ToolParser\n"
        "@register_tool_parser('hermes')\n"
        "class Mine(ToolParser):\n    pass\n"
    )
    cases.append((["--tool-parser-plugin", str(clash)], "'hermes' is taken"))
    for argv, says in cases:
        with pytest.raises(SystemExit):
            parse_args(["m", *argv])
        assert says in capsys.readouterr().err, argv
    # the built-in names still parse without any plugin
    assert parse_args(["m", "--tool-call-parser", "hermes"]).tool_call_parser == "hermes"
