"""The reasoning parsers beyond think tags read as R1 / Qwen3 (vLLM's names): seed_oss, mistral,
minimax_m2, minimax_m2_append_think, olmo3, ernie45, granite, hunyuan_a13b, deepseek_v3. Each
output whole, then streamed in every 2-way split and in 1-character pieces: the pieces must join
to the whole answer. Unit tests over the splitter, and one request through the in-process
server (mistral: its markers are special tokens, kept in the text)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fake_engine import ScriptedEngine
from server_proc import chat_stream, serve_in_process
from test_reasoning_and_parsers import _streamed

from paged_server.reasoning import (
    REASONING_PARSERS,
    THINK_FORMATS,
    ReasoningOutput,
    ReasoningRequest,
    ThinkSplitter,
    split_reasoning,
    thinking_requested,
)

NEW_PARSERS = (
    "seed_oss",
    "mistral",
    "minimax_m2",
    "minimax_m2_append_think",
    "olmo3",
    "ernie45",
    "granite",
    "hunyuan_a13b",
    "deepseek_v3",
)
HERE_T, HERE_R = "Here is my thought process:", "Here is my response:"

CASES = [
    # (parser, model text, reasoning or None, content)
    # seed_oss: deepseek_r1 with seed tags (the template may have opened the block)
    ("seed_oss", "<seed:think>plan</seed:think>Answer", "plan", "Answer"),
    ("seed_oss", "plan\n</seed:think>\n\nAnswer", "plan\n", "\n\nAnswer"),
    ("seed_oss", "cut short while thinking", "cut short while thinking", ""),
    ("seed_oss", "</seed:think>only content", None, "only content"),
    ("seed_oss", "a</seed:think>b<seed:think>c</seed:think>", "a", "b<seed:think>c</seed:think>"),
    ("seed_oss", "x <seed:thin </seed:think>y", "x <seed:thin ", "y"),
    # mistral: the model opens the block; text around it is content
    ("mistral", "[THINK]plan[/THINK]Answer", "plan", "Answer"),
    ("mistral", "No thinking [here].", None, "No thinking [here]."),
    ("mistral", "[THINK]cut short while thin", "cut short while thin", ""),
    ("mistral", "[THINK][/THINK]only content", None, "only content"),
    ("mistral", "pre [THINK]in[/THINK] post", "in", "pre  post"),
    ("mistral", "stray[/THINK] close", None, "stray close"),  # dropped before the block
    ("mistral", "[THINK]a[/THINK]b[THINK]c[/THINK]", "a", "b[THINK]c[/THINK]"),
    # minimax_m2: the template opened the block
    ("minimax_m2", "plan</think>Answer", "plan", "Answer"),
    ("minimax_m2", "<think>plan</think>\nAnswer", "plan", "\nAnswer"),
    ("minimax_m2", "still thinking", "still thinking", ""),
    ("minimax_m2", "</think>Answer", None, "Answer"),
    ("minimax_m2", "a</think>b</think><think>c", "a", "b</think><think>c"),
    # minimax_m2_append_think: never reasoning; the think block stays inline, opened
    ("minimax_m2_append_think", "plan</think>Answer", None, "<think>plan</think>Answer"),
    ("minimax_m2_append_think", "still thinking", None, "<think>still thinking"),
    ("minimax_m2_append_think", "", None, "<think>"),
    # olmo3: as deepseek_r1 (the template opens the block)
    ("olmo3", "<think>plan</think>Answer", "plan", "Answer"),
    ("olmo3", "plan</think>Answer", "plan", "Answer"),
    ("olmo3", "cut short", "cut short", ""),
    ("olmo3", "<think></think>Answer", None, "Answer"),
    ("olmo3", "a</think>b<think>c</think>d", "a", "b<think>c</think>d"),
    # ernie45: newlines after </think> dropped, <response> ... </response> unwrapped
    ("ernie45", "abc\n</think>\n\n<response>\ndef\n</response>\n", "abc\n", "\ndef\n"),
    ("ernie45", "abc\n</think>\ndef", "abc\n", "def"),
    ("ernie45", "<think>abc</think>def", "abc", "def"),
    ("ernie45", "cut short", "cut short", ""),
    ("ernie45", "</think>\n<response>only</response>", None, "only"),
    (
        "ernie45",
        "a</think>\n<response>b</response>\n\nc</response><think>",
        "a",
        "bc</response><think>",
    ),
    ("ernie45", "a</think>\n<respond>b</response>", "a", "<respond>b</response>"),  # no wrapper
    ("ernie45", "a</think>\n\n<resp", "a", "<resp"),  # cut short inside the opener
    ("ernie45", "a</think>\n<response>b", "a", "b"),  # cut short inside the answer
    # granite: the thought marker only as the first text, up to the response marker
    (
        "granite",
        f"{HERE_T}\nplan\n\n{HERE_R}\nAnswer",
        "\nplan\n\n",
        "\nAnswer",
    ),
    ("granite", "Here's my thought process: p Here's my response: a", " p ", " a"),
    ("granite", f"{HERE_T} p Here's my response: a", " p ", " a"),
    ("granite", f"{HERE_T} cut short", " cut short", ""),
    ("granite", "Hello. Here is my answer.", None, "Hello. Here is my answer."),
    ("granite", f"Hi. {HERE_T} p {HERE_R} a", None, f"Hi. {HERE_T} p {HERE_R} a"),
    ("granite", f"{HERE_T}{HERE_R}only", None, "only"),
    ("granite", f"{HERE_T}p{HERE_R}a {HERE_T} {HERE_R}", "p", f"a {HERE_T} {HERE_R}"),
    ("granite", "Here", None, "Here"),  # cut short inside the marker
    # hunyuan_a13b: <think>\n ... \n</think>\n<answer>\n ... \n</answer>
    ("hunyuan_a13b", "<think>\nplan\n</think>\n<answer>\nAnswer\n</answer>", "plan", "Answer"),
    ("hunyuan_a13b", "<think>\n\n</think>\n<answer>\nAnswer\n</answer>", None, "Answer"),
    ("hunyuan_a13b", "<think>\ncut short\n</thi", "cut short\n</thi", ""),
    ("hunyuan_a13b", "<think>\nplan\n</think>\n<answer>\ncut", "plan", "cut"),
    ("hunyuan_a13b", "No think block.\n</answer>", None, "No think block.\n</answer>"),
    (
        "hunyuan_a13b",
        "<think>\np\n</think>\n<answer>\na\n</answer>\n<think>\nq",
        "p",
        "a\n<think>\nq",
    ),
    ("hunyuan_a13b", "<think>\np\n</think>\nno answer tag", "p\n</think>\nno answer tag", ""),
    # deepseek_v3 without thinking in the request: no reasoning at all
    ("deepseek_v3", "plan</think>Answer", None, "plan</think>Answer"),
    ("deepseek_v3", "<think>x</think>y", None, "<think>x</think>y"),
]


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_split_whole_and_streamed_in_every_chunking(
    parser: str, text: str, reasoning: str | None, content: str
) -> None:
    assert split_reasoning(parser, text) == (reasoning, content)
    want = (reasoning or "", content)
    for i in range(len(text) + 1):
        assert _streamed(parser, [text[:i], text[i:]]) == want, i
    assert _streamed(parser, list(text)) == want
    assert _streamed(parser, ["", *text, ""]) == want  # empty pieces change nothing


def test_every_parser_is_a_cli_choice() -> None:
    assert set(NEW_PARSERS) <= set(THINK_FORMATS)
    every = (*THINK_FORMATS, "openai_gptoss")  # cli_args' --reasoning-parser choices
    assert every == REASONING_PARSERS
    assert len(set(REASONING_PARSERS)) == len(REASONING_PARSERS)
    from paged_server.cli_args import parse_args

    for name in NEW_PARSERS:
        assert parse_args(["--reasoning-parser", name]).reasoning_parser == name


def test_reasoning_streams_before_the_output_ends() -> None:
    s = ThinkSplitter("mistral")
    assert s.feed("[THI") == ("", "")  # might be the tag: held
    assert s.feed("NK]step one, ") == ("step one, ", "")
    assert s.feed("two[/TH") == ("two", "")
    assert s.feed("INK]The answer") == ("", "The answer")
    s = ThinkSplitter("granite")
    assert s.feed("Here is my") == ("", "")  # the opener may still come
    assert s.feed(" thought process: a") == (" a", "")
    assert s.feed(" b. Here") == (" b. ", "")  # "Here" may begin the response marker
    assert s.feed(" we go") == ("Here we go", "")
    s = ThinkSplitter("granite")
    assert s.feed("Hi") == ("", "Hi")  # not the opener: content from the first character
    s = ThinkSplitter("ernie45")
    assert s.feed("a</think>\n\n") == ("a", "")  # the newlines are dropped, not held
    assert s.feed("<resp") == ("", "")
    assert s.feed("onse>\nb") == ("", "\nb")
    s = ThinkSplitter("minimax_m2_append_think")
    assert s.feed("") == ("", "<think>")  # the first piece carries the opener
    assert s.feed("x") == ("", "x")
    assert s.finish() == ("", "")


def test_deepseek_v3_follows_the_request_thinking_switch() -> None:
    assert not thinking_requested(None) and not thinking_requested({"thinking": False})
    assert thinking_requested({"thinking": True}) and thinking_requested({"enable_thinking": 1})
    off = ReasoningRequest("deepseek_v3")
    on = ReasoningRequest("deepseek_v3", template_kwargs={"thinking": True})
    on2 = ReasoningRequest("deepseek_v3", True, False, {"enable_thinking": True})
    assert off.parser == "deepseek_v3" and on.parser == on2.parser == "deepseek_r1"
    text = "plan</think>Answer"
    assert split_reasoning(off.parser, text) == (None, text)
    assert split_reasoning(on.parser, text) == ("plan", "Answer")
    other = ReasoningRequest("qwen3", template_kwargs={"thinking": True})
    assert other.parser == "qwen3"  # only deepseek_v3 reads the switch


def test_special_tokens_are_kept_where_the_markers_are_special() -> None:
    assert ReasoningRequest("mistral").keeps_special_tokens  # [THINK] is a control token
    assert ReasoningRequest("openai_gptoss").keeps_special_tokens
    for name in NEW_PARSERS:
        if name != "mistral":
            assert not ReasoningRequest(name).keeps_special_tokens, name


@pytest.mark.parametrize("parser", ["ernie45", "granite", "hunyuan_a13b", "mistral"])
def test_stream_entries_join_to_the_whole_answer(parser: str) -> None:
    text = {
        "ernie45": "abc\n</think>\n\n<response>\ndef\n</response>\n",
        "granite": f"{HERE_T} p {HERE_R} a",
        "hunyuan_a13b": "<think>\nplan\n</think>\n<answer>\nAnswer\n</answer>",
        "mistral": "[THINK]plan[/THINK]Answer",
    }[parser]
    out = ReasoningOutput(ReasoningRequest(parser))
    reasoning = content = ""
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        entry = {"index": 0, "delta": {"content": piece}, "finish_reason": "stop" if last else None}
        new = out.rewrite(entry)
        if new is None:
            continue
        d = new["delta"]
        assert d.get("reasoning_content", "") == d.get("reasoning", "")
        reasoning += d.get("reasoning_content", "")
        content += d.get("content", "")
    whole = split_reasoning(parser, text)
    assert (reasoning or None, content) == whole


def test_mistral_end_to_end_keeps_the_think_tokens() -> None:
    engine = ScriptedEngine(max_model_len=512, step_time=0.0002)
    args = ["--max-model-len", "512", "--served-model-name", "tiny", "--client-timeout", "3"]
    script = "[THINK]plan it[/THINK]The answer."
    with serve_in_process([*args, "--reasoning-parser", "mistral"], engine) as (http, _):
        engine.script = script
        body = {"messages": [{"role": "user", "content": "Hi"}]}
        status, _, payload = http.request("POST", "/v1/chat/completions", body)
        assert status == 200, payload
        m = payload["choices"][0]["message"]
        assert m["reasoning_content"] == m["reasoning"] == "plan it"
        assert m["content"] == "The answer."
        assert engine.params[payload["id"] + "-0"].skip_special_tokens is False
        s = chat_stream(SimpleNamespace(http=http, engine=engine), script)
        assert (s["reasoning_content"], s["content"], s["finish"]) == (
            "plan it",
            "The answer.",
            "stop",
        )


def test_deepseek_v3_end_to_end_follows_chat_template_kwargs() -> None:
    """The request's chat_template_kwargs reach the parser: thinking on splits at </think>,
    off leaves everything content."""
    engine = ScriptedEngine(max_model_len=512, step_time=0.0002)
    args = ["--max-model-len", "512", "--served-model-name", "tiny", "--client-timeout", "3"]
    with serve_in_process([*args, "--reasoning-parser", "deepseek_v3"], engine) as (http, _):
        engine.script = "plan it</think>The answer."
        for kwargs, reasoning, content in [
            ({"thinking": True}, "plan it", "The answer."),
            ({}, None, "plan it</think>The answer."),
        ]:
            body = {"messages": [{"role": "user", "content": "Hi"}]}
            body["chat_template_kwargs"] = kwargs
            status, _, payload = http.request("POST", "/v1/chat/completions", body)
            assert status == 200, payload
            m = payload["choices"][0]["message"]
            assert (m.get("reasoning_content"), m["content"]) == (reasoning, content)
