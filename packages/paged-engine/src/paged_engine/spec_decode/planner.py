"""`DraftPlanner`: which decode rows speculate this step, with which drafts, and when to stop.

The scheduler asks it for a decoding sequence's drafts; the engine core reports how many the
target accepted. With n-gram lookup and suffix decoding the drafts are real tokens (any number
up to the row's room); with a draft model they are `DRAFT_PLACEHOLDER` slots that the worker's
draft model fills in the same step. Suffix decoding also learns from finished requests: `forget`
(the scheduler's request-finish hook) hands their outputs to its cache.

A sequence speculates unless it has beams, or its sample fans out into n > 1 sequences.
Repetition / frequency / presence penalties speculate: the worker judges draft j with drafts
0..j-1 among the outputs, so every position sees plain decoding's history. A constrained
request (grammar, bad words) drafts n-gram tokens, up to the first its constraint refuses, and
each draft position gets its own mask; with a draft model or head it does not draft (the
worker's drafts would need the grammar), nor with a thinking budget. After that fan-out
each sequence of an n > 1 request drafts (over its own tokens) and is verified on its own. Drafts
never run past max_tokens or max_model_len (the step emits at most drafts + 1 tokens).

Switching off: each proposal that gets nothing accepted doubles a sequence's pause (its next
decode rows without proposals: 1, 2, 4, ... up to 64); an accepted token resets it. On text the
n-grams do not predict the sequence soon stops paying for verification. The pause counts the
sequence's own decode rows, not engine steps, so async scheduling (which adds steps where a
sequence waits) drafts at exactly the rows the synchronous engine drafts at.

Async scheduling: a row may be planned while its last token is still pending (sampled by the
step in flight, known only on the device). It cannot draft then: n-gram drafts continue the
host's tokens, and a verify row's position depends on how many drafts the step in flight
accepts. `due` says whether it would draft now; the scheduler then holds it back a step, until
its token lands, so it drafts exactly as the synchronous engine would.
"""

from __future__ import annotations

from dataclasses import dataclass

from paged_engine.core.request import Request, Sequence
from paged_engine.spec_decode.config import SpeculativeConfig
from paged_engine.spec_decode.ngram_proposer import TokenBuffer, propose_ngram
from paged_engine.spec_decode.suffix_proposer import SuffixProposer

MAX_PAUSE = 64
# A draft slot the worker's draft model proposes (method "draft_model"): the scheduler plans
# how many drafts a row runs, the worker decides which tokens they are.
DRAFT_PLACEHOLDER = -1


@dataclass(slots=True)
class _Backoff:
    misses: int = 0  # proposals in a row with nothing accepted
    pause: int = 0  # decode rows left without proposals


class DraftPlanner:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self._backoff: dict[int, _Backoff] = {}  # seq id -> its pause
        self._k = config.num_speculative_tokens  # drafts a row may run this step
        # Totals (vLLM's spec_decode_* counters): proposals, drafted and accepted tokens, and
        # per draft position j the proposals whose drafts 0..j were all accepted (so
        # sum(per_pos) == num_accepted_tokens and per_pos[0] <= num_drafts).
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * config.num_speculative_tokens
        self._texts: dict[int, TokenBuffer] = {}  # n-gram lookup: seq id -> its tokens
        self.suffix: SuffixProposer | None = None
        if config.is_suffix:
            self.suffix = SuffixProposer(
                config.suffix_decoding_max_tree_depth,
                config.suffix_decoding_max_cached_requests,
                config.suffix_decoding_max_spec_factor,
                config.suffix_decoding_min_token_prob,
            )

    def next_step(self, batch_size: int = 0) -> None:
        """A new step, scheduled while `batch_size` requests run (the draft count may depend
        on it: num_speculative_tokens_per_batch_size)."""
        self._k = self.config.num_tokens_at(batch_size)

    def due(self, req: Request, seq: Sequence, budget: int) -> bool:
        """Whether a decode row of `seq` would speculate now (with `budget` more tokens), in
        which case a pending last token makes it wait (async scheduling). Changes nothing."""
        if not _eligible(req, self.config.uses_draft_model):
            return False
        state = self._backoff.get(seq.seq_id)
        return (state is None or not state.pause) and self._room(req, seq, budget) > 0

    def drafts(self, req: Request, seq: Sequence, budget: int) -> list[int]:
        """Drafts for a decode row of `seq` (its one new token is the last one) that `budget`
        more tokens can carry; [] when it does not speculate. Called once per decode row: a
        paused sequence spends a row of its pause (a pending row too: it is not `due`)."""
        if not _eligible(req, self.config.uses_draft_model):
            return []
        state = self._backoff.get(seq.seq_id)
        if state is not None and state.pause:
            state.pause -= 1
            return []
        room = self._room(req, seq, budget)
        if room <= 0:
            return []
        assert not seq.num_pending, "a pending row that is due waits for its token (Scheduler)"
        cfg = self.config
        if cfg.uses_draft_model:  # the worker's draft model fills these in at the step
            return [DRAFT_PLACEHOLDER] * room
        tokens = seq.token_ids
        if self.suffix is not None:
            drafts = self.suffix.propose(seq.seq_id, tokens, room)
        else:
            text = self._texts.get(seq.seq_id)
            if text is None:
                text = self._texts[seq.seq_id] = TokenBuffer()
            text.sync(tokens)
            drafts = propose_ngram(
                text.buf[: text.num], room, cfg.prompt_lookup_min, cfg.prompt_lookup_max
            )
        constraint = req.constraint
        if constraint is not None and drafts:
            drafts = drafts[: constraint.valid_drafts(seq.seq_id, seq.output_token_ids, drafts)]
        return drafts

    def _room(self, req: Request, seq: Sequence, budget: int) -> int:
        """Drafts the row may run: never past max_tokens or max_model_len (pending included)."""
        num = seq.num_tokens
        room = min(self._k, budget, self.max_model_len - num - 1)
        if req.max_tokens is not None:
            room = min(room, req.max_tokens - (num - seq.num_prompt_tokens) - 1)
        return room

    def feedback(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """A verified step of `seq`: `num_accepted` of its `num_drafts` drafts were kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        for j in range(num_accepted):
            per_pos[j] += 1
        state = self._backoff.setdefault(seq.seq_id, _Backoff())
        if num_accepted:
            state.misses, state.pause = 0, 0
            return
        state.misses += 1
        state.pause = min(MAX_PAUSE, 2 ** (state.misses - 1))

    def forget(self, req: Request) -> None:
        """`req` finished (any way): drop its sequences' state; suffix decoding caches their
        outputs (not beams': their sequences are candidates, not outputs)."""
        for seq in req.seqs:
            self._backoff.pop(seq.seq_id, None)
            self._texts.pop(seq.seq_id, None)
        if self.suffix is not None:
            outputs = [] if req.beam is not None else [s.output_token_ids for s in req.seqs]
            self.suffix.finish([s.seq_id for s in req.seqs], outputs)


def _eligible(req: Request, uses_draft_model: bool) -> bool:
    if req.beam is not None:
        return False
    constraint = req.constraint  # masks by every output token: drafts need their masks here
    if constraint is not None and (uses_draft_model or constraint.thinking is not None):
        return False
    # this row's sample becomes the first token of every one of n sequences
    return not req.fans_out
