"""Requests and their sequences: token-level state owned by the engine core.

A `Request` is one prompt with its sampling parameters and one or more `Sequence`s (n > 1 and
beam search fork more). A `Sequence` is one token stream plus its block table:

    token_ids + pending:  | prompt (num_prompt_tokens) | outputs ...        | pending |
                          | computed (KV in cache or scheduled)   | not yet scheduled |
                          0                           num_computed_tokens     num_tokens

Invariants:
- `token_ids` holds the tokens the host knows and is append-only (prefix-cache block hashes of
  full blocks are cached in `block_hashes` and stay valid across preemption and fork).
- `num_pending` counts tokens a scheduled step will sample that the host does not know yet (0
  or 1; the worker has them on the device). `num_tokens` includes them, so the scheduler can
  schedule the next step before the last one's output arrived (async scheduling).
- `num_computed_tokens` advances when a step is scheduled, not after it ran: the KV of
  positions [0, num_computed_tokens) is in the cache or written by a step already scheduled
  (steps run in order on one stream).
- `block_ids` covers at least positions [0, num_computed_tokens); the block manager owns it.
  The worker's copy of the table is in sync for entries [0, num_synced_blocks) while
  `in_worker` (the scheduler sends the rest as a delta).
- Text-level state (detokenizer, output text, logprob dicts) lives in the output stage, not here.
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
    FINISHED_REPETITION = 5  # repetition_detection found a loop

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
    SequenceStatus.FINISHED_REPETITION: "repetition",
}

_seq_ids = itertools.count()


def next_seq_id() -> int:
    """Process-wide unique sequence id (the worker keys its per-sequence state on it)."""
    return next(_seq_ids)


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request: Request = field(repr=False)
    index: int  # CompletionOutput.index within the request
    token_ids: list[int]  # prompt + outputs known to the host, append-only
    num_prompt_tokens: int
    num_pending: int = 0  # sampled by a scheduled step, not known to the host yet
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)  # block table (block manager owns it)
    status: SequenceStatus = SequenceStatus.WAITING
    num_cached_tokens: int = 0  # prefix-cache hit at the last admission
    num_external_tokens: int = 0  # prompt tokens a KV connector loaded then (kv_transfer/)
    # Block manager bookkeeping: chained hashes of the full blocks of token_ids (content only,
    # so valid while token_ids grows), and how many table blocks are registered in the cache.
    block_hashes: list[int] = field(default_factory=list, repr=False)
    num_registered_blocks: int = 0
    # The worker's view (see the module docstring).
    in_worker: bool = False
    num_synced_blocks: int = 0
    state_slot: int = -1  # hybrid models: its recurrent-state row (core/state_slots.py)
    # Hybrid models with prefix caching: block boundaries (ascending, past num_computed_tokens)
    # where a step must end so that the state there is kept as a snapshot.
    state_checkpoints: list[int] = field(default_factory=list, repr=False)
    # ... and its decode snapshot's row while it runs (core/state_slots.py), or -1
    snapshot_row: int = -1
    # Models with a recurrent state under speculative decoding: a verify step that rejected a
    # draft left the state before its row, so positions [num_computed_tokens, replay_end) run
    # again, their tokens sent to the worker (which knows generated tokens on the device only).
    replay_end: int = 0
    cumulative_logprob: float = 0.0  # beam search score (raw logprobs)
    # beam search: each step's candidates (`BeamTrace`, sample/beam_search.py), newest last
    beam_trace: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        """Outputs, pending ones included."""
        return len(self.token_ids) + self.num_pending - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status >= SequenceStatus.FINISHED_STOPPED

    def fork(self, new_seq_id: int, index: int) -> Sequence:
        """A copy of this stream's tokens with NO blocks (`BlockManager.fork` shares them)."""
        assert not self.num_pending, "fork a sequence whose tokens are all known"
        return Sequence(
            seq_id=new_seq_id,
            request=self.request,
            index=index,
            token_ids=self.token_ids.copy(),
            num_prompt_tokens=self.num_prompt_tokens,
            num_computed_tokens=self.num_computed_tokens,
            status=self.status,
            num_cached_tokens=self.num_cached_tokens,
            num_external_tokens=self.num_external_tokens,
            cumulative_logprob=self.cumulative_logprob,
        )


@dataclass(slots=True, eq=False)
class Request:
    """One prompt; created WAITING with a single sequence holding the prompt tokens.

    `params` is a SamplingParams or BeamSearchParams (duck-typed here: the scheduler reads
    `n` / `best_of` / `beam_width` / `prompt_logprobs` / `max_tokens` when present)."""

    request_id: str
    prompt_token_ids: list[int]
    params: Any
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)  # every sequence, live and finished
    status: RequestStatus = RequestStatus.WAITING
    first_scheduled_time: float | None = None
    # prefix-cache hits (local and external) of its first sequence at its FIRST schedule, as
    # vLLM reports them: a readmission after a recompute preemption hits its own blocks
    num_cached_tokens: int = 0
    finished_time: float | None = None
    num_preemptions: int = 0
    # Token-level stop rules, checked by the engine core when a token is appended.
    eos_token_ids: frozenset[int] = frozenset()  # empty with ignore_eos
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0  # stop tokens and eos count only from this many outputs on
    beam: Any = None  # BeamSearchState for beam search requests
    # Look up the prefix cache at admission. Off when prompt logprobs are wanted: cached
    # prompt positions are never run through the model, so they would have no logits.
    use_prefix_cache: bool = True
    # Sequences this request will fork into (n / best_of, or the beam width): the scheduler
    # reserves that many of max_num_seqs at admission. 0 = derive from params.
    max_live_seqs: int = 0
    max_tokens: int | None = None  # resolved from params; None = up to max_model_len
    # Grammar / bad words (structured_output.RequestConstraint): the next mask depends on every
    # output token, computed by the engine core from the tokens it applied.
    constraint: Any = None
    # The LoRA adapter it runs with (0: the base model). Its KV differs from the base model's
    # for the same tokens, so its prefix-cache hashes start from their own root.
    lora_id: int = 0
    lora_path: str | None = None
    # vLLM's cache_salt: prefix-cache hits only between requests with the same salt (tenants
    # that must not learn, from timing, which prompts others sent). Part of the hash root.
    cache_salt: str | None = None
    # SamplingParams.repetition_detection (a RepetitionDetectionParams), checked per token
    repetition: Any = None
    # scheduling_policy="priority": lower runs first; ties go by arrival_time
    priority: int = 0
    # Images of the prompt (multimodal/inputs.py ImageInput), in placeholder order: the worker
    # embeds them at their placeholders; a block covering one is keyed by its hash too.
    mm_inputs: tuple = ()
    # Qwen-VL with images: the prompt's M-RoPE positions (multimodal/mrope.py MropePositions)
    mrope: Any = None
    # PAGED_COMPUTE_NANS_IN_LOGITS: a step's logits for it held a NaN (vLLM's corrupted request)
    corrupted: bool = False

    def __post_init__(self) -> None:
        params = self.params
        if getattr(params, "prompt_logprobs", None) is not None:
            self.use_prefix_cache = False
        if getattr(params, "skip_reading_prefix_cache", None):  # vLLM's per-request switch
            self.use_prefix_cache = False
        self.repetition = getattr(params, "repetition_detection", None)
        # every prompt position, or the first one (CLS), must run: never read from the cache
        if getattr(params, "pooling_type", None) in ("MEAN", "ALL", "CLS"):
            self.use_prefix_cache = False
        if self.max_live_seqs <= 0:
            width = getattr(params, "beam_width", None) or max(
                getattr(params, "n", None) or 1, getattr(params, "best_of", None) or 1
            )
            self.max_live_seqs = int(width)
        if self.max_tokens is None:
            self.max_tokens = getattr(params, "max_tokens", None)
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
    def fans_out(self) -> bool:
        """The next sample forks the prompt sequence into max_live_seqs samples (n > 1)."""
        return (
            self.beam is None
            and self.max_live_seqs > 1
            and len(self.seqs) == 1
            and len(self.seqs[0].token_ids) == self.seqs[0].num_prompt_tokens
        )

    @property
    def needs_host_result(self) -> bool:
        """Its next step depends on the host seeing the last one (beams pick parents; a fan-out
        creates the samples; a constraint masks by every output token): with async scheduling
        it sits out while a step is in flight."""
        return self.beam is not None or self.constraint is not None or self.fans_out

    @property
    def num_pending(self) -> int:
        return sum(s.num_pending for s in self.seqs)

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
