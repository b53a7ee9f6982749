"""Every registered tool parser answers the same whether the client streams or not.

The same model output goes through the server's own tool path (`tools.ToolOutput`: `message`
for the whole answer, `rewrite` per streamed chunk, the pieces cut 1, 3 and 7 characters long,
token-like, and whole): the streamed content pieces join to exactly the whole answer's
`content` (its None streams as no content at all), and the streamed calls (names, one id each,
arguments joined and read as JSON) are the whole answer's. The content before the calls is the
text as the model wrote it, not stripped (vLLM's hermes: `model_output[:start]`, None when
empty); whitespace alone before the calls is no content where calls may open the answer with no
marker (llama3_json, pythonic, olmo3, xlam) and for glm45 / hunyuan_a13b (vLLM's answer; jamba:
a lone " ", as vLLM's), and ernie45 trims the newlines before its calls (vLLM's
`rstrip("\n")`): both forms alike. glm45, lfm2, qwen3_coder, deepseek_v3 / v31, seed_oss and
minimax_m2 go on with the text between and after their calls (vLLM streams it), less what is
only whitespace (`INTERLEAVED`): both forms alike too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest

from paged_server.tool_parsers import TOOL_PARSERS
from paged_server.tools import ToolOutput, make_parser, parse_tools

Call = tuple[str, dict[str, Any]]
CALLS: list[Call] = [("get_weather", {"city": "Paris", "days": 3}), ("clock", {"tz": "utc"})]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "clock",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
        },
    },
]


def _json_objects(key: str) -> Callable[[list[Call]], list[str]]:
    return lambda calls: [json.dumps({"name": n, key: a}) for n, a in calls]


def _pythonic(calls: list[Call]) -> list[str]:
    return [f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls]


def _xml(fn: str, param: str, end: str, quote: str = "") -> Callable[[list[Call]], str]:
    def write(calls: list[Call]) -> str:
        out = []
        for n, a in calls:
            params = "".join(
                f"{param}{quote}{k}{quote}>\n{v}\n</parameter>\n" for k, v in a.items()
            )
            out.append(f"{fn}{quote}{n}{quote}>\n{params}{end}")
        return "\n".join(out)

    return write


def _glm(newline: str) -> Callable[[list[Call]], str]:
    def write(calls: list[Call]) -> str:
        return "\n".join(
            f"<tool_call>{n}{newline}"
            + "".join(
                f"<arg_key>{k}</arg_key>{newline}<arg_value>{v}</arg_value>{newline}"
                for k, v in a.items()
            )
            + "</tool_call>"
            for n, a in calls
        )

    return write


QWEN_FN = _xml("<function=", "<parameter=", "</function>")
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
HARMONY_CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>"
)

# name -> (the calls as the model writes them, whether text may stand before the calls,
#          whether text may follow them)
FORMATS: dict[str, tuple[Callable[[list[Call]], str], bool, bool]] = {
    "hermes": (
        lambda c: "\n".join(
            f"<tool_call>\n{j}\n</tool_call>" for j in _json_objects("arguments")(c)
        ),
        True,
        True,
    ),
    "llama3_json": (lambda c: "; ".join(_json_objects("parameters")(c)), False, False),
    "mistral": (
        lambda c: "[TOOL_CALLS][" + ", ".join(_json_objects("arguments")(c)) + "]",
        True,
        False,
    ),
    "granite": (
        lambda c: "<|tool_call|>[" + ", ".join(_json_objects("arguments")(c)) + "]",
        True,
        False,
    ),
    "phi4_mini_json": (
        lambda c: "functools[" + ", ".join(_json_objects("arguments")(c)) + "]",
        True,
        False,
    ),
    "pythonic": (lambda c: "[" + ", ".join(_pythonic(c)) + "]", False, False),
    "lfm2": (
        lambda c: "<|tool_call_start|>[" + ", ".join(_pythonic(c)) + "]<|tool_call_end|>",
        True,
        True,
    ),
    "qwen3_coder": (
        lambda c: "\n".join(f"<tool_call>\n{QWEN_FN([call])}\n</tool_call>" for call in c),
        True,
        True,
    ),
    "openai": (lambda c: "".join(HARMONY_CALL.format(n, json.dumps(a)) for n, a in c), True, False),
    "deepseek_v3": (
        lambda c: (
            DS_BEGIN
            + "".join(
                f"{DS_CALL}function{DS_SEP}{n}\n```json\n{json.dumps(a)}\n```{DS_CALL_END}"
                for n, a in c
            )
            + DS_END
        ),
        True,
        True,
    ),
    "deepseek_v31": (
        lambda c: (
            DS_BEGIN
            + "".join(f"{DS_CALL}{n}{DS_SEP}{json.dumps(a)}{DS_CALL_END}" for n, a in c)
            + DS_END
        ),
        True,
        True,
    ),
    "kimi_k2": (
        lambda c: (
            "<|tool_calls_section_begin|>"
            + "".join(
                f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps(a)}<|tool_call_end|>"
                for i, (n, a) in enumerate(c)
            )
            + "<|tool_calls_section_end|>"
        ),
        True,
        True,
    ),
    "glm45": (_glm("\n"), True, True),
    "glm47": (_glm(""), True, True),
    "seed_oss": (
        lambda c: "<seed:tool_call>\n" + QWEN_FN(c) + "\n</seed:tool_call>",
        True,
        True,
    ),
    "minimax_m2": (
        lambda c: (
            "<minimax:tool_call>\n"
            + _xml("<invoke name=", "<parameter name=", "</invoke>", '"')(c)
            + "\n</minimax:tool_call>"
        ),
        True,
        True,
    ),
    "hunyuan_a13b": (
        lambda c: "<tool_calls>[" + ", ".join(_json_objects("arguments")(c)) + "]</tool_calls>",
        True,
        True,
    ),
    "olmo3": (
        lambda c: "<function_calls>\n" + "\n".join(_pythonic(c)) + "\n</function_calls>",
        True,
        True,
    ),
    "internlm": (
        lambda c: "".join(
            f"<|action_start|><|plugin|>\n{j}<|action_end|>" for j in _json_objects("parameters")(c)
        ),
        True,
        True,
    ),
    "xlam": (lambda c: "[" + ", ".join(_json_objects("arguments")(c)) + "]", False, False),
}
SAME_AS = {  # registered names that read a sibling's format
    "qwen3_xml": "qwen3_coder",
    "ernie45": "hermes",
    "jamba": "hunyuan_a13b",
    "llama4_pythonic": "pythonic",
    "llama4_json": "llama3_json",
}
EXTRA = {  # other forms a parser reads: (parser, writer, text before allowed, text after allowed)
    "olmo3 bare": ("olmo3", lambda c: "\n".join(_pythonic(c)), False, False),
    "xlam fenced": ("xlam", lambda c: "```json\n" + FORMATS["xlam"][0](c) + "\n```", True, True),
    "xlam tagged": (
        "xlam",
        lambda c: "<tool_call>" + FORMATS["xlam"][0](c) + "</tool_call>",
        True,
        True,
    ),
    # a block that is not calls before the one that is: held back, then content at the end
    "xlam after a block": (
        "xlam",
        lambda c: "```python\nprint(1)\n```\nNow:\n" + EXTRA["xlam fenced"][1](c),
        True,
        True,
    ),
}


# parsers whose content goes on between and after the calls -> a call block in their text
INTERLEAVED = {
    "glm45": r"<tool_call>.*?</tool_call>",
    "glm47": r"<tool_call>.*?</tool_call>",
    "lfm2": r"<\|tool_call_start\|>.*?<\|tool_call_end\|>",
    "qwen3_coder": r"<tool_call>.*?</tool_call>",
    "qwen3_xml": r"<tool_call>.*?</tool_call>",
    "deepseek_v3": DS_BEGIN + ".*?" + DS_END,
    "deepseek_v31": DS_BEGIN + ".*?" + DS_END,
    "seed_oss": r"<seed:tool_call>.*?</seed:tool_call>",
    "minimax_m2": r"<minimax:tool_call>.*?</minimax:tool_call>",
}
BLANK_IS_CONTENT = {"lfm2", "qwen3_coder", "qwen3_xml", "deepseek_v3", "deepseek_v31"}
BLANK_IS_CONTENT |= {"seed_oss", "minimax_m2"}


def _outside_calls(name: str, text: str) -> str | None:
    """The content of an interleaving parser's answer: the text before the first call, then
    each piece of text after a call unless it is only whitespace (None: no content)."""
    first, *after = re.split(INTERLEAVED[name], text, flags=re.DOTALL)
    content = first + "".join(piece for piece in after if piece.strip())
    return content if content.strip() or (name in BLANK_IS_CONTENT and content) else None


def _format(name: str) -> tuple[str, Callable[[list[Call]], str], bool, bool]:
    if name in EXTRA:
        return EXTRA[name]
    return (name, *FORMATS[SAME_AS.get(name, name)])


def _outputs(name: str) -> list[tuple[str, int]]:
    """(model output, how many calls it holds) in this parser's format."""
    _, write, before, after = _format(name)
    one, two = write(CALLS[:1]), write(CALLS)
    texts = [
        (one, 1),
        (two, 2),
        ("\n\n" + one + "\n", 1),  # whitespace around
        ("Sure.\n\nNo tool needed here.\n", 0),
        ("  Plain answer, spaces around.  ", 0),
    ]
    if before:
        texts += [("Let me look.\n" + one, 1), ("  Let me look. \n\n" + two, 2), ("Hi " + one, 1)]
    else:  # text first: the calls are no calls, all of it content
        texts += [("Let me look.\n" + one, 0)]
    if after:
        texts += [("Let me look.\n" + two + "\nDone.", 2), (one + "\n\nThat is all.", 1)]
    if name in INTERLEAVED:  # text between the calls, after them, or whitespace only
        other = write(CALLS[1:])
        texts += [
            ("Let me look.\n" + one + "\nNow the clock:\n" + other + "\nDone.\n", 2),
            (one + " and " + other + " \n", 2),
            ("Hi " + one + "\n \n" + other + "\n\n", 2),
            ("\n" + one + " \n" + other + "\nDone.", 2),
        ]
    return texts


NAMES = sorted(TOOL_PARSERS) + sorted(EXTRA)


def test_every_registered_parser_has_a_format() -> None:
    assert set(TOOL_PARSERS) == set(FORMATS) | set(SAME_AS)


def _pieces(text: str, how: str) -> list[str]:
    if how == "whole":
        return [text]
    if how == "tokens":  # special tokens whole, words, runs of spaces, single characters
        return re.findall(r"<[|｜][^>]*>|<[^<>]*>|\w+|\s+|.", text, re.DOTALL)
    n = int(how)
    return [text[i : i + n] for i in range(0, len(text), n)]


def _tool_output(name: str) -> ToolOutput:
    parser = _format(name)[0]
    req = parse_tools({"tools": TOOLS}, parser)
    assert req is not None
    return ToolOutput(req, make_parser(parser))


def _streamed(name: str, pieces: list[str]) -> tuple[str, list[dict[str, Any]], str | None]:
    """(the content pieces joined, the calls as a client assembles them, finish_reason)."""
    out = _tool_output(name)
    content, calls, reason = "", {}, None
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        entry = out.rewrite(
            {"index": 0, "delta": {"content": piece}, "finish_reason": "stop" if last else None}
        )
        if entry is None:
            continue
        delta = entry["delta"]
        content += delta.get("content", "")
        for tc in delta.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"ids": [], "name": None, "arguments": ""})
            if "id" in tc:
                call["ids"].append(tc["id"])
            fn = tc.get("function", {})
            if "name" in fn:
                assert call["name"] is None, "a call's name is sent once"
                call["name"] = fn["name"]
            call["arguments"] += fn.get("arguments", "")
        reason = entry["finish_reason"] or reason
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[k] for k in sorted(calls)], reason


@pytest.mark.parametrize("name", NAMES)
def test_streamed_answer_is_the_whole_answer(name: str) -> None:
    for text, n_calls in _outputs(name):
        msg, whole_reason = _tool_output(name).message(text, "stop")
        whole_calls = msg.get("tool_calls", [])
        assert len(whole_calls) == n_calls, (name, text)
        if n_calls and name in INTERLEAVED:
            assert msg["content"] == _outside_calls(name, text), (name, text)
        elif n_calls:
            assert msg["content"] is None or text.startswith(msg["content"]), "not stripped"
        else:
            assert msg["content"] == text
        for how in ("whole", "1", "3", "7", "tokens"):
            content, calls, reason = _streamed(name, _pieces(text, how))
            where = (name, how, text)
            assert content == (msg["content"] or ""), where
            assert reason == whole_reason, where
            assert [c["name"] for c in calls] == [c["function"]["name"] for c in whole_calls], where
            assert all(len(c["ids"]) == 1 for c in calls), where
            for got, want in zip(calls, whole_calls):
                assert json.loads(got["arguments"]) == json.loads(want["function"]["arguments"]), (
                    where
                )


def test_content_before_calls_is_as_written() -> None:
    """vLLM's hermes: content = model_output[:start], not stripped; whitespace-only content
    before a marker stays (as vLLM answers it); before bare calls, and for parsers whose vLLM
    counterpart answers None for it (glm45, hunyuan_a13b), it is none (jamba: only a lone " ",
    as vLLM's `content != " "`); ernie45 trims the newlines before the calls (vLLM:
    rstrip("\\n"))."""

    def content(parser: str, text: str) -> str | None:
        return _tool_output(parser).message(text, "stop")[0]["content"]

    for parser in ("hermes", "mistral", "kimi_k2", "qwen3_coder", "glm45", "jamba", "xlam fenced"):
        one = _format(parser)[1](CALLS[:1])
        assert content(parser, " Let me look. \n" + one) == " Let me look. \n"
        assert content(parser, "\n\n" + one) == (
            "\n\n" if parser in ("hermes", "mistral", "kimi_k2", "qwen3_coder", "jamba") else None
        )
    for parser in ("jamba", "hunyuan_a13b"):
        one = _format(parser)[1](CALLS[:1])
        assert content(parser, " " + one) is None
        assert content(parser, "  " + one) == ("  " if parser == "jamba" else None)
    assert content("pythonic", "\n" + FORMATS["pythonic"][0](CALLS)) is None
    hermes = FORMATS["hermes"][0](CALLS[:1])
    assert content("ernie45", "Let me look.\n\n" + hermes) == "Let me look."
    assert content("ernie45", "\n\n" + hermes) is None
    assert content("ernie45", "Let me look.\n\n") == "Let me look.\n\n"  # no call: as written


@pytest.mark.parametrize("name", sorted(INTERLEAVED))
def test_a_call_nested_past_the_recursion_limit_ends_the_calls(name: str) -> None:
    """A call whose value json.loads cannot read (100k "[" raise RecursionError) after a call
    and some text: no exception, streamed in one piece or in many, and the streamed content is
    the whole answer's."""
    deep = "[" * 100_000 + "]" * 100_000
    write = _format(name)[1]
    bad = write([("get_weather", {"city": "Paris", "days": "DEEP"})])
    for quoted in ('"DEEP"', "'DEEP'", "DEEP"):
        bad = bad.replace(quoted, deep)
    text = "Hi " + write(CALLS[1:]) + " then " + bad + " after"
    msg, _ = _tool_output(name).message(text, "stop")
    assert [c["function"]["name"] for c in msg["tool_calls"]][:1] == ["clock"]
    for how in ("whole", "7", "4096"):
        content, calls, _ = _streamed(name, _pieces(text, how))
        assert content == (msg["content"] or ""), (name, how)
        assert [c["name"] for c in calls][:1] == ["clock"], (name, how)
