"""Suffix decoding (vLLM's method "suffix", after Arctic Inference's SuffixDecoding): model-free
drafts that continue the sequence's recent tokens the way they most often continued before, in
its own prompt and output and in the outputs of earlier requests.

    sequence   ... x a b c                      pattern: its last <= D = max_tree_depth tokens
    earlier    a b c d e ... a b c d f ...     "a b c" (m = 3) occurs twice, both times then d:
    draft      d (2/2), then e or f (1/2)      [d, e] if min_token_prob <= 0.5, else [d]

What it computes is what a suffix tree of depth D over each text gives, whose node for a string
s counts the occurrences of s: for each length m whose last m pattern tokens occur, follow the
most frequent next token while the running product of count(s + t) / count(s) (the estimated
probability of the draft so far) stays >= min_token_prob, for at most
min(num_speculative_tokens, floor(max_spec_factor * m), D - m) tokens (D bounds the match and
the draft together). Each draft scores the sum of its tokens' probabilities; the best score wins
(the longer match on a tie), the sequence's own text against the cache of finished outputs.

Instead of trees (Python objects per node would cost far more memory than the tokens), each text
is an int32 array in which -1 ends every stretch, and occurrences are found there:

- the sequence's own text (prompt + output, synced each call by appending its new tokens): the
  positions of its last token by a vectorized scan, at most `MAX_OCCURRENCES` of the latest;
- the cache (`OutputCache`): finished requests' outputs, FIFO by request up to
  max_cached_requests, indexed by token pair (the latest `MAX_OCCURRENCES` positions of each
  pair are read), so it matches two tokens or more and a lookup costs the same at any cache
  size.

The occurrences' match lengths (how far each agrees with the pattern backwards) split them
into nested groups, and a group's greedy path is computed once. At these sizes (tens to hundreds
of occurrences) a numpy call's fixed cost outweighs its work, so numpy handles only the many:
it narrows the occurrences one pattern token at a time and counts next tokens while more than
`_FEW` are left; the few are compared and counted in Python. Memory: the sequence's own tokens
while it runs; the cache holds at most max_cached_requests outputs.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import deque

import numpy as np

from paged_engine.spec_decode.ngram_proposer import END as _END
from paged_engine.spec_decode.ngram_proposer import TokenBuffer

MAX_OCCURRENCES = 256  # latest occurrences of a last token (own text) or token pair (cache)
_FEW = 16  # up to this many occurrences are compared and counted in Python, more in numpy
_NO_TOKEN = -2  # in no text: ends every match


class OutputCache:
    """Finished requests' outputs in one token store, evicted oldest first, with an index from
    each token pair to its latest positions (absolute: position - `_base` indexes `_store`)."""

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self._store = np.full(1024, _END, dtype=np.int32)
        self._base = 0  # absolute position of _store[0]
        self._end = 0  # absolute end of what was written
        self._spans: deque[tuple[int, int]] = deque()  # (start, end) per cached request
        # token pair -> its positions, ascending; trimmed to the latest MAX_OCCURRENCES when
        # twice as long (int64 arrays: 8 bytes a position, read by numpy without a conversion)
        self._index: dict[int, array[int]] = {}

    def __len__(self) -> int:
        return len(self._spans)

    @property
    def num_tokens(self) -> int:
        """Tokens held (separators included), for the memory bound."""
        return self._end - (self._spans[0][0] if self._spans else self._end)

    def add(self, outputs: list[list[int]]) -> None:
        """Cache one finished request's outputs (one per sequence); evicts the oldest request
        beyond max_requests."""
        outputs = [o for o in outputs if o]
        if not self.max_requests or not outputs:
            return
        parts = []
        for out in outputs:
            parts += [np.asarray(out, dtype=np.int32), np.full(1, _END, dtype=np.int32)]
        tokens = np.concatenate(parts)
        start = self._end
        at = self._make_room(len(tokens))
        self._store[at : at + len(tokens)] = tokens
        self._end += len(tokens)
        self._spans.append((start, self._end))
        pos, keys = _pairs(tokens)
        index = self._index
        for p, key in zip((pos + start).tolist(), keys.tolist(), strict=True):
            latest = index.get(key)
            if latest is None:
                index[key] = array("q", (p,))
                continue
            latest.append(p)
            if len(latest) > 2 * MAX_OCCURRENCES:
                del latest[:MAX_OCCURRENCES]
        while len(self._spans) > self.max_requests:
            self._evict()

    def _make_room(self, num: int) -> int:
        """Where `num` more tokens go in `_store`, compacting or growing it first."""
        used = self._end - self._base
        if used + num <= len(self._store):
            return used
        live_from = self._spans[0][0] if self._spans else self._end
        live = self._store[live_from - self._base : used]
        size = len(self._store)
        while len(live) + num > size // 2:
            size *= 2
        store = np.full(size, _END, dtype=np.int32)
        store[: len(live)] = live
        self._store, self._base = store, live_from
        return len(live)

    def _evict(self) -> None:
        start, end = self._spans.popleft()
        _, keys = _pairs(self._store[start - self._base : end - self._base])
        for key in set(keys.tolist()):
            latest = self._index.get(key)
            if latest is None:
                continue
            cut = bisect_left(latest, end)  # positions grow: the evicted ones lead
            if cut == len(latest):
                del self._index[key]
            else:
                del latest[:cut]

    def occurrences(self, before: int, last: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(store, positions in it) of the latest occurrences of the token pair (before, last);
        None without any."""
        latest = self._index.get((before << 32) | last)
        if not latest:
            return None
        ends = np.frombuffer(latest[-MAX_OCCURRENCES:], dtype=np.int64) - self._base
        return self._store, ends


def _most_frequent(values: np.ndarray) -> tuple[int, int]:
    """The most frequent value of `values` other than END (the smaller on a tie) and its count;
    (END, 0) if there is none."""
    s = np.sort(values)
    counts = np.bincount(s.searchsorted(s))  # counts[i]: how many equal s[i], at each run's start
    if s[0] == _END:  # END sorts first
        counts[0] = 0
    k = int(counts.argmax())  # the first largest: the smaller value
    return int(s[k]), int(counts[k])


def _pairs(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions p (of the second token) and keys of the token pairs inside `tokens`'s stretches."""
    first, second = tokens[:-1].astype(np.int64), tokens[1:].astype(np.int64)
    pos = np.flatnonzero((first >= 0) & (second >= 0)) + 1
    return pos, (first[pos - 1] << 32) | second[pos - 1]


class SuffixProposer:
    """Drafts per sequence (`propose`) and the cache of finished outputs (`finish`)."""

    def __init__(
        self, max_tree_depth: int, max_cached_requests: int, max_spec_factor: float,
        min_token_prob: float,
    ) -> None:  # fmt: skip
        self.depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.cache = OutputCache(max_cached_requests)
        self._texts: dict[int, TokenBuffer] = {}  # seq id -> its tokens
        self._caps: dict[int, list[int]] = {}  # row room -> drafts allowed per match length

    def propose(self, seq_id: int, tokens: list[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` drafts continuing `tokens` (the sequence's prompt and output)."""
        if max_tokens <= 0 or not tokens:
            return []
        text = self._texts.get(seq_id)
        if text is None:
            text = self._texts[seq_id] = TokenBuffer()
        buf = text.sync(tokens)
        num = text.num
        n = min(num, self.depth)
        # the pattern reversed (pattern[0]: the last token), then a value no text holds
        pattern = tokens[-1 : -n - 1 : -1] + [_NO_TOKEN]
        caps = self._caps.get(max_tokens)
        if caps is None:  # drafts allowed after a match of m: caps[m]
            caps = self._caps[max_tokens] = [
                min(max_tokens, int(m * self.max_spec_factor + 1e-6), self.depth - m)
                for m in range(self.depth + 1)
            ]
        ends = (buf[:num] == pattern[0]).nonzero()[0][-MAX_OCCURRENCES:]
        score, best = self._best(buf, ends, pattern, caps, 0.0, shortest=1, whole=num - 1)
        # cache drafts match two tokens or more, and each scores at most its cap
        if n >= 2 and score < max(caps[2 : n + 1]):
            found = self.cache.occurrences(pattern[1], pattern[0])
            if found is not None:
                other, other_best = self._best(*found, pattern, caps, score, shortest=2)
                if other > score:
                    best = other_best
        return best

    def _best(
        self, text: np.ndarray, ends: np.ndarray, pattern: list[int], caps: list[int],
        floor: float, shortest: int, whole: int | None = None,
    ) -> tuple[float, list[int]]:  # fmt: skip
        """The best draft (score, tokens) from the occurrences `ends` (all of them matching at
        least `shortest` tokens; the one at `whole`, if any, all of them) of `pattern` (reversed,
        then `_NO_TOKEN`) in `text` whose score beats `floor`; (floor, []) if none does. Every
        token in `text` is followed by a token or END."""
        n = len(pattern) - 1
        read = memoryview(text)  # its tokens as Python ints, for the few compared one by one
        # match lengths: while the occurrences are many, numpy narrows them one pattern token at
        # a time (cand[0] >= m: no read before text[0]); the few left are compared one by one.
        # A group: the occurrences matching at least `length` tokens (groups nest)
        groups: list[tuple[int, np.ndarray | list[int]]] = []  # (length, group), shortest first
        cand, m = ends, shortest  # cand: those matching at least m
        while len(cand) > _FEW and cand[0] >= m:
            more = cand[text[cand - m] == pattern[m]]  # pattern[n] is in no text
            if len(more) < len(cand):
                groups.append((m, cand))
            cand, m = more, m + 1
        found = []  # (match length, position) of the few left
        for e in cand.tolist():
            k = n if e == whole else m
            while k <= e and read[e - k] == pattern[k]:
                k += 1
            found.append((k, e))
        found.sort()
        for i, (k, _) in enumerate(found):
            if i == 0 or found[i - 1][0] != k:
                groups.append((k, [e for _, e in found[i:]]))
        best_score, best = floor, []
        for i in range(len(groups) - 1, -1, -1):  # longest first: on a tie the longer wins
            length, group = groups[i]
            lower = groups[i - 1][0] if i else shortest - 1
            # every m in (lower, length] keeps the same occurrences: the largest cap serves
            cap = max(caps[lower + 1 : length + 1])
            if cap <= best_score:  # each token scores <= 1
                continue
            if isinstance(group, np.ndarray):
                score, draft = self._follow_many(text, read, group, cap)
            elif group != [whole]:  # (after the pattern itself alone, the text ends)
                score, draft = self._follow(read, group, cap, 0.0, 1.0, [])
            else:
                continue
            if score > best_score:
                best_score, best = score, draft
        return best_score, best

    def _follow_many(
        self, text: np.ndarray, read: memoryview, cur: np.ndarray, cap: int
    ) -> tuple[float, list[int]]:
        """`_follow` from the occurrences `cur` (an array), counted in numpy while many."""
        draft: list[int] = []
        score, prob = 0.0, 1.0
        while len(cur) > _FEW and len(draft) < cap:
            nxt = text[cur + 1]
            token, count = _most_frequent(nxt)
            prob *= count / len(cur)
            if not count or prob < self.min_token_prob:
                return score, draft
            draft.append(token)
            score += prob
            if len(draft) == cap:
                return score, draft
            cur = cur[nxt == token] + 1
        return self._follow(read, cur.tolist(), cap, score, prob, draft)

    def _follow(
        self, read: memoryview, cur: list[int], cap: int, score: float, prob: float,
        draft: list[int],
    ) -> tuple[float, list[int]]:  # fmt: skip
        """Extends the greedy path `draft` (its score and probability so far) to at most `cap`
        tokens after the occurrences `cur` (positions of their last matched token in the text
        `read`): each step the most frequent next token (the smaller id on a tie), at
        probability prod(count(next) / count)."""
        while len(draft) < cap:
            if len(cur) == 1:  # one path: its tokens up to the stretch's end, prob unchanged
                at = cur[0] + 1
                run = read[at : at + cap - len(draft)].tolist()
                if _END in run:
                    run = run[: run.index(_END)]
                return score + prob * len(run), draft + run
            nxt = [read[p + 1] for p in cur]
            counts: dict[int, int] = {}
            token, count = _END, 0  # the most frequent so far, the smaller id on a tie
            for t in nxt:
                if t != _END:  # occurrences that end here count, but lead nowhere
                    c = counts[t] = counts.get(t, 0) + 1
                    if c > count or (c == count and t < token):
                        token, count = t, c
            if not count:
                break
            prob *= count / len(cur)
            if prob < self.min_token_prob:
                break
            draft.append(token)
            score += prob
            cur = [p + 1 for p, t in zip(cur, nxt, strict=True) if t == token]
        return score, draft

    def finish(self, seq_ids: list[int], outputs: list[list[int]]) -> None:
        """A request finished: drop its sequences' texts and cache their outputs."""
        for seq_id in seq_ids:
            self._texts.pop(seq_id, None)
        self.cache.add(outputs)
