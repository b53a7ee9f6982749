"""Requests and their sequences: the state the scheduler owns and the runner only reads.

A `Request` is one prompt with its sampling parameters and one or more `Sequence`s (n > 1 and
beam search fork more). A `Sequence` is one token stream plus its block table:

    token_ids:  | prompt (num_prompt_tokens) | outputs ...                        |
                | computed (KV in cache)     | not yet computed |
                0                num_computed_tokens       num_tokens

Invariants:
- `token_ids` is append-only (prefix-cache block hashes of full blocks are cached in
  `block_hashes` and stay valid across preemption and fork).
- `block_ids` covers at least positions [0, num_computed_tokens); the block manager owns it.
- Every time here is `time.monotonic()`.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2  # EOS, stop token or stop string
    FINISHED_LENGTH = 3  # max_tokens or max_model_len
    FINISHED_ABORTED = 4  # client abort

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI / vLLM `finish_reason` string for a finished status, else None."""
        return _FINISH_REASONS.get(self)


# A request moves through the same states as its sequences; one enum serves both.
RequestStatus = SequenceStatus

_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}

_seq_ids = itertools.count()


def next_seq_id() -> int:
    """Process-wide unique sequence id (the runner may key per-sequence state on it)."""
    return next(_seq_ids)


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request: Request = field(repr=False)
    index: int  # CompletionOutput.index within the request
    token_ids: list[int]  # prompt + outputs, append-only
    num_prompt_tokens: int
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_ids: list[int] = field(default_factory=list)  # block table (block manager owns it)
    status: SequenceStatus = SequenceStatus.WAITING
    num_cached_tokens: int = 0  # prefix-cache hit at the last admission
    # Block manager bookkeeping: chained hashes of the full blocks of token_ids (content only,
    # so valid while token_ids grows), and how many table blocks are registered in the cache.
    block_hashes: list[int] = field(default_factory=list, repr=False)
    num_registered_blocks: int = 0
    # Output side, filled by the output processor.
    cumulative_logprob: float = 0.0
    logprobs: list[Any] | None = None
    output_text: str = ""
    detokenizer: object | None = field(default=None, repr=False)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status >= SequenceStatus.FINISHED_STOPPED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def fork(self, new_seq_id: int, index: int) -> Sequence:
        """A copy of this stream's tokens and output state, with NO blocks.

        `BlockManager.fork(parent, child)` then shares the parent's blocks with the child.
        A detokenizer is forked through its own `fork()` method when it has one, else left
        None for the output processor to set (a shallow copy could share mutable state).
        """
        detok = self.detokenizer
        fork_detok = getattr(detok, "fork", None)
        return Sequence(
            seq_id=new_seq_id,
            request=self.request,
            index=index,
            token_ids=self.token_ids.copy(),
            num_prompt_tokens=self.num_prompt_tokens,
            num_computed_tokens=self.num_computed_tokens,
            status=self.status,
            num_cached_tokens=self.num_cached_tokens,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else self.logprobs.copy(),
            output_text=self.output_text,
            detokenizer=fork_detok() if fork_detok is not None else None,
        )


@dataclass(slots=True, eq=False)
class Request:
    """One prompt; created WAITING with a single sequence holding the prompt tokens."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: Any  # SamplingParams or BeamSearchParams; opaque to the scheduler
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)  # every sequence, live and finished
    status: RequestStatus = RequestStatus.WAITING
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    state: object | None = field(default=None, repr=False)  # output processor's slot
    # Look up the prefix cache at admission. Off when prompt logprobs are wanted: cached
    # prompt positions are never run through the model, so they would have no logits.
    use_prefix_cache: bool = True
    # Sequences this request will fork into (n / best_of, or the beam width): the scheduler
    # reserves that many of max_num_seqs at admission. 0 = derive from params.
    max_live_seqs: int = 0

    def __post_init__(self) -> None:
        params = self.params
        if getattr(params, "prompt_logprobs", None) is not None:
            self.use_prefix_cache = False
        if self.max_live_seqs <= 0:
            width = getattr(params, "beam_width", None) or max(
                getattr(params, "n", None) or 1, getattr(params, "best_of", None) or 1
            )
            self.max_live_seqs = int(width)
        if not self.seqs:
            self.seqs.append(
                Sequence(
                    seq_id=next_seq_id(),
                    request=self,
                    index=0,
                    token_ids=list(self.prompt_token_ids),
                    num_prompt_tokens=len(self.prompt_token_ids),
                )
            )

    def live_seqs(self) -> list[Sequence]:
        """Unfinished sequences, in creation order (a new list: safe to fork while iterating)."""
        seqs = self.seqs
        if len(seqs) == 1:  # fast path: the common single-sequence request
            return [seqs[0]] if seqs[0].status < SequenceStatus.FINISHED_STOPPED else []
        return [s for s in seqs if s.status < SequenceStatus.FINISHED_STOPPED]

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
