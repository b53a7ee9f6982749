"""The grammar engine behind structured outputs, as one interface (llguidance implements it).

A `GrammarBackend` belongs to one tokenizer and vocabulary: it compiles a checked grammar
(`grammar.grammar_text`) into a matcher at the grammar's start, and fills many matchers' next-token
bitmasks at once. A `GrammarMatcher` follows one sequence's output tokens.

Contract: a matcher's state is a function of the tokens it accepted, nothing else; so a copy
taken at a fork continues independently, and recompute preemption (which keeps every token)
needs no rollback. Speculative drafts are accepted to fill their positions' masks, then rolled
back: the matcher again holds exactly its sequence's tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class GrammarMatcher(ABC):
    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by one token; False if the grammar does not allow it (the matcher is then
        in an error state for good)."""

    @abstractmethod
    def error(self) -> str:
        """Why the matcher failed (a token it rejected, a parser or lexer limit hit), one
        line; "" while it has not."""

    @abstractmethod
    def is_stopped(self) -> bool:
        """Nothing may follow: the output is complete (or the matcher failed)."""

    @abstractmethod
    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state (n > 1 forks)."""

    @abstractmethod
    def validate(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` the grammar allows from here, in order
        (the state does not change)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative drafts, never past a
        token that failed)."""


class GrammarBackend(ABC):
    vocab_size: int  # the bitmask covers token ids [0, vocab_size)

    @abstractmethod
    def check(self, grammar: str) -> str | None:
        """Why `grammar` is invalid for this tokenizer (a special token it lacks, a token id
        past its vocabulary), or None; cheap: no matcher is built."""

    @abstractmethod
    def compile(self, grammar: str) -> GrammarMatcher:
        """A matcher at the start of `grammar`. May take milliseconds: runs off the step thread."""

    @abstractmethod
    def fill_bitmasks(self, rows: list[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        """For each (matcher, row): bitmask[row] = the tokens the matcher allows next
        (bitmask: [R, ceil(vocab_size / 32)] int32, C-contiguous)."""
