"""`RequestConstraint`: what limits one request's next tokens beyond its sampling settings.

A grammar (structured outputs), bad words (vLLM's `bad_words`: token sequences that must not
appear in the output) and / or a thinking budget (vLLM's `thinking_token_budget`:
structured_output/thinking_budget.py). Each depends on every output token so far, so a
constrained request waits for its sampled token before it is scheduled again
(`Request.needs_host_result`, as beams and the n > 1 fan-out do): its next mask is computed on
the host, by the engine core, from tokens the core has applied.

Owned by the engine core: `EngineCore._apply` is the only caller of `accept` and `fork`, in the
order tokens are appended, so each matcher holds exactly the tokens its sequence holds. A
sequence recomputed after preemption keeps its tokens and its matcher unchanged.

Speculative (n-gram) drafts: `valid_drafts` keeps the leading drafts the constraint allows
(the scheduler drafts only those), and the step's masks of the draft positions are filled with
the drafts accepted, then rolled back (`StructuredOutputManager.fill_bitmask`). A thinking
budget does not draft.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

import numpy as np

from paged_engine.structured_output.backend import GrammarMatcher
from paged_engine.structured_output.thinking_budget import ThinkingBudget

logger = logging.getLogger(__name__)


class RequestConstraint:
    __slots__ = ("bad_words", "grammar", "matchers", "thinking")

    def __init__(
        self,
        grammar: Future[GrammarMatcher] | None,
        bad_words: list[list[int]],
        thinking: ThinkingBudget | None = None,
    ) -> None:
        self.grammar = grammar  # resolves to a matcher at the grammar's start (the template)
        self.bad_words = bad_words  # token id sequences, never empty
        self.matchers: dict[int, GrammarMatcher] = {}  # seq_id -> that sequence's matcher
        self.thinking = thinking

    @property
    def ready(self) -> bool:
        return self.grammar is None or self.grammar.done()

    def error(self) -> str | None:
        """Why the grammar could not be compiled (once ready), else None."""
        if self.grammar is None or self.grammar.exception() is None:
            return None
        return str(self.grammar.exception())

    def matcher(self, seq_id: int) -> GrammarMatcher | None:
        """The sequence's matcher; the first sequence starts from the compiled template."""
        if self.grammar is None:
            return None
        m = self.matchers.get(seq_id)
        if m is None:
            m = self.matchers[seq_id] = self.grammar.result().copy()
        return m

    def fork(self, parent_id: int, child_ids: list[int]) -> None:
        """Children take a copy of the parent's state (call before the parent accepts its
        token: the fan-out's samples all come from the parent's state)."""
        m = self.matcher(parent_id)
        if m is not None:
            for child in child_ids:
                self.matchers[child] = m.copy()
        if self.thinking is not None:
            self.thinking.fork(parent_id, child_ids)

    def accept(self, seq_id: int, token_id: int) -> bool:
        """Advance the sequence's matcher; True when its output must end here (the grammar is
        complete, or it rejected the token)."""
        if self.thinking is not None:
            self.thinking.accept(seq_id, token_id)
        m = self.matcher(seq_id)
        if m is None:
            return False
        if m.accept(token_id):
            return m.is_stopped()
        # The mask allowed only tokens the grammar accepts: llguidance hit one of its own
        # limits mid-output (a parser row past 2000 items, a lexer past its expression budget).
        # The output ends here, finish_reason "stop", as in vLLM; the log says why.
        logger.warning(
            "structured outputs: sequence %d's grammar failed at token %d, its output ends "
            "here: %s", seq_id, token_id, m.error()[:300],
        )  # fmt: skip
        return True

    def valid_drafts(self, seq_id: int, output_ids: list[int], drafts: list[int]) -> int:
        """How many leading `drafts` may follow `output_ids`: each allowed by the grammar, none
        completing a bad word, and none after which the grammar allows nothing more (the
        position after it would have an empty mask; the sequence would end there anyway)."""
        if self.thinking is not None or not drafts:
            return 0
        n = len(drafts)
        if self.bad_words:
            history = list(output_ids)
            for j, t in enumerate(drafts):
                if t in self._bad_next(history):
                    n = j
                    break
                history.append(t)
        m = self.matcher(seq_id)
        if m is None or n == 0:
            return n
        n = m.validate(drafts[:n])
        for j in range(n):  # the state after each: stop before a token that ends the grammar
            m.accept(drafts[j])
            if m.is_stopped():
                m.rollback(j + 1)
                return j
        m.rollback(n)
        return n

    def _bad_next(self, output_ids: list[int]) -> list[int]:
        """The tokens that would complete a bad word after `output_ids`."""
        out = []
        for word in self.bad_words:
            prefix = word[:-1]
            if not prefix or output_ids[-len(prefix) :] == prefix:
                out.append(word[-1])
        return out

    def drop(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)
        if self.thinking is not None:
            self.thinking.drop(seq_id)

    def force(self, seq_id: int, row: np.ndarray) -> None:
        """A thinking budget spent: the row allows only the closer's next id."""
        t = self.thinking.forced(seq_id) if self.thinking is not None else None
        if t is not None:
            row[:] = 0
            row.view(np.uint8)[t >> 3] = np.uint8(1 << (t & 7))

    def ban_bad_words(self, output_ids: list[int], row: np.ndarray) -> None:
        """Clear the bits of tokens that would complete a bad word after `output_ids` (row:
        one [W] int32 bitmask row, little-endian words)."""
        as_bytes = row.view(np.uint8)
        for t in self._bad_next(output_ids):
            as_bytes[t >> 3] &= ~np.uint8(1 << (t & 7))
