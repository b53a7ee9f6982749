"""Prompt lookup (n-gram) proposals: find the sequence's last n tokens earlier in the sequence
and propose what followed them there.

    tokens  ... a b c d ... x a b c      (n = 3: "a b c" occurred before)
    propose d ...                         (up to k tokens that followed that occurrence)

The longest n in [n_min, n_max] with a match wins, and among its matches the most recent. The
search runs over the tokens as a byte string (bytes.rfind: C speed), 4 bytes a token.
"""

from __future__ import annotations

import numpy as np

END = -1  # follows a TokenBuffer's tokens (and ends suffix decoding's stretches): no id is < 0


class TokenBuffer:
    """A growing int32 copy of one sequence's tokens, followed by `END`, kept per sequence by
    the proposers: each step appends the new tokens (converting the whole list costs ~50 us
    for 1.5k tokens, most of a proposal)."""

    __slots__ = ("buf", "num")

    def __init__(self) -> None:
        self.buf = np.full(64, END, dtype=np.int32)
        self.num = 0

    def sync(self, tokens: list[int]) -> np.ndarray:
        """Append what `tokens` gained since the last call (rebuilt if they changed otherwise);
        returns the buffer, `END` at `num`."""
        num, total = self.num, len(tokens)
        if total < num or (num and self.buf[num - 1] != tokens[num - 1]):
            num = 0
        if total + 1 > len(self.buf):
            grown = np.full(max(2 * len(self.buf), total + 64), END, dtype=np.int32)
            grown[:num] = self.buf[:num]
            self.buf = grown
        if total > num:
            self.buf[num:total] = tokens[num:]
        self.buf[total] = END
        self.num = total
        return self.buf


def propose_ngram(tokens: list[int] | np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k draft tokens continuing `tokens` (a list, or an int32 array: a TokenBuffer's
    `buf[:num]`); [] when no n-gram of the tail recurs."""
    num = len(tokens)
    if num <= n_min or k <= 0:
        return []
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens, dtype=np.int32)
    hay = arr.tobytes()
    for n in range(min(n_max, num - 1), n_min - 1, -1):
        needle = hay[-4 * n :]
        end = len(hay) - 4  # a match must end before the last token (not the tail itself)
        while True:
            at = hay.rfind(needle, 0, end)
            if at < 0:
                break
            if at % 4 == 0:  # token-aligned
                start = at // 4 + n  # the token after the match
                return arr[start : min(start + k, num)].tolist()
            end = at + 4 * n - 1  # an unaligned hit: keep searching to its left
    return []
