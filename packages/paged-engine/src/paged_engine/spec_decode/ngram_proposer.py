"""Prompt lookup (n-gram) proposals: find the sequence's last n tokens earlier in the sequence
and propose what followed them there.

    tokens  ... a b c d ... x a b c      (n = 3: "a b c" occurred before)
    propose d ...                         (up to k tokens that followed that occurrence)

The longest n in [n_min, n_max] with a match wins, and among its matches the most recent. The
search runs over the tokens as a byte string (bytes.rfind: C speed), 4 bytes a token.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k draft tokens continuing `tokens`; [] when no n-gram of the tail recurs."""
    num = len(tokens)
    if num <= n_min or k <= 0:
        return []
    hay = np.asarray(tokens, dtype=np.int32).tobytes()
    for n in range(min(n_max, num - 1), n_min - 1, -1):
        needle = hay[-4 * n :]
        end = len(hay) - 4  # a match must end before the last token (not the tail itself)
        while True:
            at = hay.rfind(needle, 0, end)
            if at < 0:
                break
            if at % 4 == 0:  # token-aligned
                start = at // 4 + n  # the token after the match
                return list(tokens[start : min(start + k, num)])
            end = at + 4 * n - 1  # an unaligned hit: keep searching to its left
    return []
