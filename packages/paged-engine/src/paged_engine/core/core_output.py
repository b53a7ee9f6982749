"""`EngineCoreOutput`: what the engine core hands the output stage per request and step.

Token-level facts only (new token ids, raw logprob numbers, finish reasons, forks); the output
stage turns them into text, logprob dicts and `RequestOutput`s. Plain data that needs no torch:
it can cross a thread or process boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class LogprobsLists:
    """Raw logprobs as host lists, one row per scored token: its id, logprob and rank (1 =
    most likely), and the top-k (token id, logprob, rank) triples, best first (or the
    request's logprob_token_ids, in their order)."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float, int]]]  # [] where k = 0


@dataclass(slots=True)
class PromptLogprobsChunk:
    """Prompt logprobs of positions [start, start + len): row j scores prompt token
    start + j + 1 (`lists.token_ids`)."""

    start: int
    lists: LogprobsLists


@dataclass(slots=True)
class SeqUpdate:
    """One sequence's progress in one step."""

    index: int
    new_token_ids: list[int]
    # Raw logprob / rank / top-k of each new token; None unless the request reads them.
    logprobs: list[float] | None = None
    ranks: list[int] | None = None
    top: list[list[tuple[int, float, int]]] | None = None
    finish_reason: str | None = None  # "stop" here means a stop token or eos
    stop_reason: int | None = None  # the stop token id, None for eos or length
    fork_of: int | None = None  # starts as a copy of this index's state (before its tokens)
    # "stop" because the grammar is complete: the last token is output text, not a stop token
    grammar_end: bool = False


@dataclass(slots=True)
class BeamHypothesis:
    token_ids: list[int]  # generated tokens only
    cumulative_logprob: float
    finish_reason: str | None
    trace: Any = None  # its candidates at each step (sample/beam_search.py BeamTrace)


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    seqs: list[SeqUpdate] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: PromptLogprobsChunk | None = None
    pooled: tuple[int, int, list[float]] | None = None  # an embedding request's chunk
    # Beam search: the live beams while running, the finished hypotheses (best first) at the end.
    beams: list[BeamHypothesis] | None = None
    first_scheduled_time: float | None = None
    num_cached_tokens: int = 0
