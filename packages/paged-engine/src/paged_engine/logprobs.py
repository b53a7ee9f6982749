"""Logprobs of a request's positions: `Logprob`, and the two containers (vLLM's `vllm.logprobs`).

A request's sample (or prompt) logprobs are a sequence with one entry per position, each a
`dict[int, Logprob]` (token id -> its logprob, rank and text). By default that sequence is a
plain list; with `SamplingParams(flat_logprobs=True)` it is a `FlatLogprobs`, which reads the
same (indexing, slicing, iteration and `len` give what the list would) but keeps every position
in six flat columns, so a long output with top-k logprobs costs a constant number of Python
objects instead of k + 2 per position (less memory, and far less for the garbage collector to
walk while the request runs).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableSequence
from dataclasses import dataclass, field
from typing import overload


@dataclass(slots=True)
class Logprob:
    """Raw model logprob of one token; `rank` is 1 for the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


LogprobsOnePosition = dict[int, Logprob]


@dataclass(slots=True)
class FlatLogprobs(MutableSequence[LogprobsOnePosition]):
    """Positions' logprobs in flat columns. Position i owns the rows
    `start_indices[i]:end_indices[i]` of `token_ids`, `logprobs`, `ranks` and `decoded_tokens`;
    within a position a token id appears once. Read-only but for `append` / `extend`: entries
    cannot be replaced, inserted or deleted. A position appended as None (the prompt's first
    token) reads back as an empty dict, as in vLLM."""

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    def append(self, value: LogprobsOnePosition | None) -> None:
        """Adds the next position from its dict (None: a position without logprobs)."""
        entries = () if value is None else value.items()
        self.append_position(
            [t for t, _ in entries],
            [lp.logprob for _, lp in entries],
            [lp.rank for _, lp in entries],
            [lp.decoded_token for _, lp in entries],
        )

    def append_position(
        self,
        token_ids: list[int],
        logprobs: list[float],
        ranks: list[int | None],
        decoded_tokens: list[str | None],
    ) -> None:
        """Adds the next position from its columns (distinct token ids), no dict built."""
        self.start_indices.append(len(self.token_ids))
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.ranks += ranks
        self.decoded_tokens += decoded_tokens
        self.end_indices.append(len(self.token_ids))

    def extend(self, values: Iterable[LogprobsOnePosition | None]) -> None:
        if isinstance(values, FlatLogprobs):  # column by column, offsets moved
            shift = len(self.token_ids) - (values.start_indices[0] if values else 0)
            self.start_indices += [i + shift for i in values.start_indices]
            self.end_indices += [i + shift for i in values.end_indices]
            a, b = (values.start_indices[0], values.end_indices[-1]) if values else (0, 0)
            self.token_ids += values.token_ids[a:b]
            self.logprobs += values.logprobs[a:b]
            self.ranks += values.ranks[a:b]
            self.decoded_tokens += values.decoded_tokens[a:b]
            return
        for value in values:
            self.append(value)

    def copy(self) -> FlatLogprobs:
        return self[:]

    def __len__(self) -> int:
        return len(self.start_indices)

    @overload
    def __getitem__(self, index: int) -> LogprobsOnePosition: ...

    @overload
    def __getitem__(self, index: slice) -> FlatLogprobs: ...

    def __getitem__(self, index: int | slice) -> LogprobsOnePosition | FlatLogprobs:
        if isinstance(index, slice):
            starts, ends = self.start_indices[index], self.end_indices[index]
            if not starts:
                return FlatLogprobs()
            if index.step not in (None, 1):  # positions not side by side: one at a time
                out = FlatLogprobs()
                for a, b in zip(starts, ends):
                    out.append_position(*(col[a:b] for col in self._columns()))
                return out
            a, b = starts[0], ends[-1]
            return FlatLogprobs(
                [i - a for i in starts],
                [i - a for i in ends],
                *(col[a:b] for col in self._columns()),
            )
        a, b = self.start_indices[index], self.end_indices[index]  # IndexError as a list's
        return {
            self.token_ids[i]: Logprob(self.logprobs[i], self.ranks[i], self.decoded_tokens[i])
            for i in range(a, b)
        }

    def __iter__(self) -> Iterator[LogprobsOnePosition]:
        for i in range(len(self.start_indices)):
            yield self[i]

    def _columns(self) -> tuple[list, list, list, list]:
        return self.token_ids, self.logprobs, self.ranks, self.decoded_tokens

    def __setitem__(self, index, value) -> None:
        raise TypeError("FlatLogprobs positions cannot be replaced")

    def __delitem__(self, index) -> None:
        raise TypeError("FlatLogprobs positions cannot be deleted")

    def insert(self, index: int, value: LogprobsOnePosition | None) -> None:
        raise TypeError("FlatLogprobs positions cannot be inserted, only appended")


# Per position: token id -> Logprob, the top-k tokens plus the sampled (or actual) one.
SampleLogprobs = FlatLogprobs | list[LogprobsOnePosition]
# The first prompt token has no logprob: None in a list, an empty position in FlatLogprobs.
PromptLogprobs = FlatLogprobs | list[LogprobsOnePosition | None]
