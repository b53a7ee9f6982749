"""ChatDeltas' streamed logprobs (the Responses API's message logprobs): whatever batches the
engine's tokens arrive in, the entries sent with the content are the content's tokens' own,
the reasoning's and the tool calls' left out, the same as the whole answer's."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest

from paged_server.chat_output import ChatDeltas
from paged_server.reasoning import ReasoningRequest
from paged_server.tools import ToolOutput, ToolRequest, make_parser

# One token a piece; token id = position + 100 (its logprob entry carries the id back).
THINK = ["<think>", "Yes", " plan", "</", "think", ">", "Ye", "s", "."]
TOOL = ["Sure", ".", " <tool_call>", '{"name": "f", ', '"arguments": {}}', "</tool_call>"]


def _batches(pieces: list[str], cuts: tuple[int, ...]) -> list[SimpleNamespace]:
    bounds = [0, *cuts, len(pieces)]
    outs = []
    for a, b in itertools.pairwise(bounds):
        last = b == len(pieces)
        ids = list(range(100 + a, 100 + b))
        lp = [SimpleNamespace(logprob=-0.5, rank=1, decoded_token=pieces[t - 100]) for t in ids]
        lps = [{t: e} for t, e in zip(ids, lp, strict=True)]
        seq = SimpleNamespace(
            text="".join(pieces[a:b]),
            token_ids=ids,
            logprobs=lps,
            finish_reason="stop" if last else None,
            stop_reason=None,
        )
        outs.append(SimpleNamespace(outputs=[seq], finished=last))
    return outs


def _stream(pieces: list[str], cuts: tuple[int, ...], reasoning, tools) -> tuple[str, list[int]]:
    text = dict(enumerate(pieces, 100))
    deltas = ChatDeltas(reasoning, tools, text.__getitem__, 0)
    content, ids = "", []
    for out in _batches(pieces, cuts):
        d = deltas.feed([(0, out)])
        if d is None:
            continue
        content += d.get("content") or ""
        ids += [pieces.index(e["token"]) + 100 for e in d.get("logprobs", [])]
    return content, ids


def _splits(n: int, rng: random.Random) -> list[tuple[int, ...]]:
    every = [()] + [(i,) for i in range(1, n)] + [tuple(range(1, n))]
    pairs = list(itertools.combinations(range(1, n), 2))
    return every + rng.sample(pairs, min(10, len(pairs)))


@pytest.mark.parametrize("cuts", _splits(len(THINK), random.Random(0)))
def test_reasoning_tokens_stay_out_of_the_contents_logprobs(cuts: tuple[int, ...]) -> None:
    content, ids = _stream(THINK, cuts, ReasoningRequest("deepseek_r1"), None)
    assert content == "Yes."
    assert ids == [106, 107, 108]  # "Ye" "s" ".": not the reasoning's "Yes" (101)


@pytest.mark.parametrize("cuts", _splits(len(TOOL), random.Random(1)))
def test_tool_call_tokens_stay_out_of_the_contents_logprobs(cuts: tuple[int, ...]) -> None:
    tools = ToolOutput(ToolRequest(tools=[], choice="auto"), make_parser("hermes"))
    content, ids = _stream(TOOL, cuts, None, tools)
    assert content.strip() == "Sure."
    assert ids[:2] == [100, 101] and all(i in (100, 101, 102) for i in ids)


def test_plain_content_keeps_every_entry() -> None:
    pieces = ["a", "b", "c"]
    content, ids = _stream(pieces, (1,), None, None)
    assert (content, ids) == ("abc", [100, 101, 102])
