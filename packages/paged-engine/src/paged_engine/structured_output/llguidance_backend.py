"""`GrammarBackend` on llguidance: a Rust Earley parser over the tokenizer's token trie.

The tokenizer is converted once per engine (~0.5 s for 49k tokens, ~2 s for 150k); masks of a
step's matchers are filled by llguidance's thread pool in one call, with the GIL released.
Building a matcher recurses over the grammar's rules: it runs on a big stack (grammar.py,
`on_big_stack`), and computes its first mask there too, so the lexer states a grammar like
`a{1000000}` builds lazily (0.6-1.5 s) are built off the engine's step thread.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np

from paged_engine.structured_output.backend import GrammarBackend, GrammarMatcher
from paged_engine.structured_output.grammar import import_llguidance, on_big_stack


class LLGuidanceMatcher(GrammarMatcher):
    __slots__ = ("m",)

    def __init__(self, matcher) -> None:
        self.m = matcher  # llguidance.LLMatcher

    def accept(self, token_id: int) -> bool:
        return self.m.consume_token(token_id)

    def is_stopped(self) -> bool:
        return self.m.is_stopped() or self.m.is_error()

    def error(self) -> str:
        # (llguidance appends a dump of the parser's state after the first line)
        return self.m.get_error().split("\n", 1)[0] if self.m.is_error() else ""

    def copy(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.m.deep_copy())

    def validate(self, token_ids: list[int]) -> int:
        return self.m.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self.m.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens")


class LLGuidanceBackend(GrammarBackend):
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        llg = import_llguidance()
        import llguidance.hf

        self._llg = llg
        self.vocab_size = vocab_size
        eos = sorted(eos_token_ids) or None
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self._executor = llg.LLExecutor()

    def check(self, grammar: str) -> str | None:
        error = on_big_stack(self._llg.LLMatcher.validate_grammar, grammar, self.tokenizer)
        return error.strip() or None

    def compile(self, grammar: str) -> LLGuidanceMatcher:
        matcher = on_big_stack(self._build, grammar)
        if matcher.is_error():
            error = matcher.get_error()
            if error.startswith("NoExtensionBias"):  # (then a dump of the parser's state)
                error = (
                    "no output can match it (NoExtensionBias: no token may start it, e.g. a "
                    'terminal that matches nothing, `A: "a" & "b"`)'
                )
            raise ValueError(f"grammar rejected for this tokenizer: {error}")
        return LLGuidanceMatcher(matcher)

    def _build(self, grammar: str) -> Any:  # an llguidance.LLMatcher
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if not matcher.is_error():
            matcher.compute_bitmask()  # warms the lexer here, not in the first step's mask
        return matcher

    def fill_bitmasks(self, rows: list[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        assert bitmask.dtype == np.int32 and bitmask.flags.c_contiguous, bitmask.dtype
        assert bitmask.shape[1] * 32 >= self.vocab_size, bitmask.shape
        pairs = [(m.m, row) for m, row in rows]  # type: ignore[attr-defined]
        self._executor.unsafe_compute_mask_ptr(
            pairs, bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0]
        )
