"""`CustomLogitsProcessors`: the worker's custom logits processors (sample/logits_processor.py)
and the dense batch indices they address sequences by.

Invariant after `update()`: `seq_at` lists the sampling sequences of the worker's batch, each
at its index, with no gap (`batch_size == len(seq_at)`), and every processor has been told each
change since the last update as one `BatchUpdate` (removed, then added, then moved). A sequence
that arrives takes the lowest index freed since the last update, else the next one; indices
still free at the update are filled by moving the last sequences down, as vLLM's persistent
batch condenses.

Each step the sampled rows are bound to their indices (`bind`): the processors see a
[batch_size, V] tensor (the sampled rows themselves when they are exactly indices 0..n-1 in
order, else a zero tensor with those rows copied in) and the rows are read back from it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import replace

import torch

from paged_engine.sample.logits_processor import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)
from paged_engine.sample.metadata import SamplingMetadata


class CustomLogitsProcessors:
    def __init__(self, classes: Sequence[type[LogitsProcessor]], config, device) -> None:
        pinned = device.type == "cuda"
        self.procs = [cls(config, device, pinned) for cls in classes]
        self.device = device
        self.index: dict[int, int] = {}  # seq id -> batch index
        self.seq_at: list[int | None] = []  # batch index -> seq id (None: freed, pending)
        self._free: list[int] = []  # freed indices, a min-heap
        self._removed: list[int] = []
        self._added: list[AddedRequest] = []

    def add(self, seq_id: int, params, prompt_ids: list[int] | None, output_ids: list[int]) -> None:
        if self._free:
            i = heapq.heappop(self._free)
            self.seq_at[i] = seq_id
        else:
            i = len(self.seq_at)
            self.seq_at.append(seq_id)
        self.index[seq_id] = i
        self._added.append((i, params, prompt_ids, output_ids))

    def remove(self, seq_id: int) -> None:
        i = self.index.pop(seq_id, None)
        if i is None:
            return
        self.seq_at[i] = None
        heapq.heappush(self._free, i)
        self._removed.append(i)

    def update(self) -> None:
        """Condense the batch and tell every processor what changed (None if nothing)."""
        moved = []
        seq_at, free = self.seq_at, self._free
        while seq_at and seq_at[-1] is None:
            seq_at.pop()
        while free:
            hole = heapq.heappop(free)
            if hole >= len(seq_at):
                continue  # trimmed off the end already
            last = len(seq_at) - 1
            seq_id = seq_at.pop()
            seq_at[hole] = seq_id
            self.index[seq_id] = hole
            moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))
            while seq_at and seq_at[-1] is None:
                seq_at.pop()
        update = None
        if self._removed or self._added or moved:
            update = BatchUpdate(len(seq_at), self._removed, self._added, moved)
            self._removed, self._added = [], []
        for proc in self.procs:
            proc.update_state(update)

    def bind(self, md: SamplingMetadata, row_seq_ids: Sequence[int]) -> SamplingMetadata:
        """`md` with the processors bound to its rows (row k samples sequence row_seq_ids[k];
        a fan-out's samples share its row)."""
        rows, indices, firsts, seen = [], [], [], set()
        for k, seq_id in enumerate(row_seq_ids):
            i = self.index.get(seq_id)
            if i is None:
                continue
            rows.append(k)
            indices.append(i)
            if i not in seen:
                seen.add(i)
                firsts.append((k, i))
        if not rows:
            return md
        return replace(md, custom=_BoundStep(self, rows, indices, firsts))


class _BoundStep:
    """The processors over one step's rows (SamplingMetadata.custom)."""

    def __init__(
        self,
        owner: CustomLogitsProcessors,
        rows: list[int],
        indices: list[int],
        firsts: list[tuple[int, int]],
    ) -> None:
        self.procs = owner.procs
        self.batch_size = len(owner.seq_at)
        self.rows, self.indices, self.firsts = rows, indices, firsts
        # the sampled rows are the batch, in index order: the processors take them as they are
        self.identity = indices == list(range(self.batch_size)) and rows == indices

    def run(self, x: torch.Tensor, argmax_invariant: bool) -> None:
        """Apply the processors of this kind to the bound rows of `x` [N, V], in place."""
        procs = [p for p in self.procs if p.is_argmax_invariant() == argmax_invariant]
        if not procs:
            return
        dev = x.device
        identity = self.identity and x.shape[0] == self.batch_size
        if identity:
            dense = x
        else:
            dense = x.new_zeros(self.batch_size, x.shape[1])
            src = torch.tensor([k for k, _ in self.firsts], device=dev)
            dst = torch.tensor([i for _, i in self.firsts], device=dev)
            dense[dst] = x[src]
        for proc in procs:
            dense = proc.apply(dense)
        if identity:
            if dense is not x:
                x.copy_(dense)
            return
        rows = torch.tensor(self.rows, device=dev)
        x[rows] = dense[torch.tensor(self.indices, device=dev)]
