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

From the occurrences, each one's match length (how far it agrees with the pattern backwards,
one gather) splits them into nested groups; a group's greedy path is computed once. Memory:
the sequence's own tokens while it runs; the cache holds at most max_cached_requests outputs.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter, deque

import numpy as np

from paged_engine.spec_decode.ngram_proposer import END as _END
from paged_engine.spec_decode.ngram_proposer import TokenBuffer

MAX_OCCURRENCES = 256  # latest occurrences of a last token (own text) or token pair (cache)


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
        # twice as long (lists: a deque per pair would cost ~600 bytes even when it holds one)
        self._index: dict[int, list[int]] = {}

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
                index[key] = [p]
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

    def occurrences(self, rev: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(store, positions in it) of the latest occurrences of the pattern's last two tokens
        (`rev`: the pattern reversed); None without any."""
        if len(rev) < 2:
            return None
        latest = self._index.get((int(rev[1]) << 32) | int(rev[0]))
        if not latest:
            return None
        ends = np.array(latest[-MAX_OCCURRENCES:], dtype=np.int64) - self._base
        return self._store, ends


def _by_count(item: tuple[int, int]) -> tuple[int, int]:
    return item[1], -item[0]  # the most frequent, the smaller id on a tie


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
        self._back = np.arange(max_tree_depth, dtype=np.int64)
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
        rev = buf[max(0, num - self.depth) : num][::-1]  # rev[0]: the last token
        ends = np.flatnonzero(buf[:num] == rev[0])[-MAX_OCCURRENCES:]
        score, best = self._best(buf, ends, rev, max_tokens, 0, shortest=1)
        found = self.cache.occurrences(rev)
        if found is not None:  # matches of two tokens or more (a token pair's index)
            other, other_best = self._best(*found, rev, max_tokens, score, shortest=2)
            if other > score:
                best = other_best
        return best

    def _best(
        self, text: np.ndarray, ends: np.ndarray, rev: np.ndarray, limit: int, floor: float,
        shortest: int,
    ) -> tuple[float, list[int]]:  # fmt: skip
        """The best draft (score, tokens) from the occurrences `ends` (all of them matching at
        least `shortest` tokens) of the pattern `rev` in `text` whose score beats `floor`;
        (floor, []) if none does."""
        n = len(rev)
        match = np.full(len(ends), shortest, dtype=np.int64)  # [E]: each one's match length
        if n > shortest:  # those agreeing on one more token are compared further (one gather)
            more = (text[np.maximum(ends - shortest, 0)] == rev[shortest]) & (ends >= shortest)
            longer, j = ends[more], shortest + 1
            if len(longer) and n > j:
                back = longer[:, None] - self._back[j:n]  # positions of rev[j:] if they agree
                agree = (text[np.maximum(back, 0)] == rev[j:]) & (back >= 0)
                match[more] = j + np.where(agree.all(axis=1), n - j, agree.argmin(axis=1))
            else:
                match[more] = j
        caps = self._caps.get(limit)
        if caps is None:  # drafts allowed after a match of m: caps[m]
            caps = self._caps[limit] = [
                min(limit, int(m * self.max_spec_factor + 1e-6), self.depth - m)
                for m in range(self.depth + 1)
            ]
        lengths = np.flatnonzero(np.bincount(match, minlength=n + 1))[::-1].tolist()
        best_score, best = floor, []
        for i, length in enumerate(lengths):  # longest first: their occurrences nest
            lower = lengths[i + 1] if i + 1 < len(lengths) else shortest - 1
            # every m in (lower, length] keeps the same occurrences: the largest cap serves
            cap = max(caps[lower + 1 : length + 1])
            if cap <= best_score:  # each token scores <= 1
                continue
            score, draft = self._follow(text, ends[match >= length], cap)
            if score > best_score:
                best_score, best = score, draft
        return best_score, best

    def _follow(self, text: np.ndarray, cur: np.ndarray, cap: int) -> tuple[float, list[int]]:
        """The greedy path after the occurrences `cur` (positions of their last matched token):
        each step the most frequent next token (the smaller id on a tie), at probability
        prod(count(next) / count)."""
        draft: list[int] = []
        score, prob = 0.0, 1.0
        while len(draft) < cap:
            num = len(cur)
            if num == 1:  # one path: its tokens up to the stretch's end, prob unchanged
                run = text[cur[0] + 1 : cur[0] + 1 + cap - len(draft)]
                stop = np.flatnonzero(run == _END)
                run = run[: stop[0]] if len(stop) else run
                draft += run.tolist()
                score += prob * len(run)
                break
            nxt = text[cur + 1]
            if num <= 64:  # counted in Python: cheaper than numpy on a few
                counts = Counter(nxt.tolist())
                counts.pop(_END, None)  # occurrences that end here count, but lead nowhere
                if not counts:
                    break
                token, count = max(counts.items(), key=_by_count)
            else:
                values, counts_np = np.unique(nxt, return_counts=True)
                if values[0] == _END:
                    values, counts_np = values[1:], counts_np[1:]
                if not len(values):
                    break
                j = int(counts_np.argmax())
                token, count = int(values[j]), int(counts_np[j])
            prob *= count / num
            if prob < self.min_token_prob:
                break
            draft.append(token)
            score += prob
            cur = cur[nxt == token] + 1
        return score, draft

    def finish(self, seq_ids: list[int], outputs: list[list[int]]) -> None:
        """A request finished: drop its sequences' texts and cache their outputs."""
        for seq_id in seq_ids:
            self._texts.pop(seq_id, None)
        self.cache.add(outputs)
