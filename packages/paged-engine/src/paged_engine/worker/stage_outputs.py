"""`StageOutputs`: the first pipeline stage's steps whose result the last stage still owes.

The last stage samples and sends each step's `ModelRunnerOutput` to its first-stage peer (the
same TP rank), which writes the sampled ids into `InputBatch.last_token` (the next input of
those sequences: a drafted row's last emitted token, the one after its accepted drafts) and, on
rank 0, hands the output to the engine core. With micro-batching the
first stage does not wait for it: it runs step N+1 while the later stages run step N, and
receives step N's result when it is asked for (`PendingStageOutput.get`, the engine core's
FIFO), or, on a rank the core does not read, before a step that needs it:

    pending: | received by rank 0 (ranks > 0 lag) | in flight at the core (< pp_size) |
             oldest                                                              newest

A worker-side proposer (a draft model, an EAGLE-1 head, an MTP layer) runs on the last stage,
which holds the target's features; it sends a step's drafts before that step's forward, and the
first stage writes them into its input ids (`receive_drafts`). Such a step waits for every older
step's output: its drafts come after them.

Invariants: receives happen in submission order (the last stage sends in that order, one pair
of ranks, one FIFO); a step's sequences are written by sequence id at receive time, so a row
freed or reused meanwhile (an abort, a preemption) is skipped, never overwritten.

`StageSends` (every stage): the async sends of those messages stay queued until a wait (gloo's
send work completes only there); it frees the ones a later step proves received, so each rank
holds a few steps' worth however long the engine runs.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np
import torch

from paged_engine.distributed.communication import recv_object, release_sends, sends_mark
from paged_engine.worker.runner_output import ModelRunnerOutput

if TYPE_CHECKING:
    from paged_engine.worker.input_batch import InputBatch


class PendingStageOutput:
    """One step's handle on the first stage; `get()` receives it (and every older one)."""

    __slots__ = ("_owner", "drafted", "flat", "next_ids", "result", "seq_ids")

    def __init__(
        self,
        owner: StageOutputs,
        seq_ids: frozenset[int],
        next_ids: list[int],
        flat: list[int],
        drafted: frozenset[int] = frozenset(),
    ) -> None:
        self._owner = owner
        self.seq_ids = seq_ids  # every sequence the step ran
        self.next_ids = next_ids  # sequences whose next input is the sample at flat[i]
        # sequences whose row carried drafts: they emit 1 + accepted tokens, known only at
        # receive time (flat is then unused)
        self.drafted = drafted
        self.flat = flat
        self.result: ModelRunnerOutput | None = None

    def ready(self) -> bool:
        return self.result is not None

    def get(self) -> ModelRunnerOutput:
        if self.result is None:
            self._owner.receive_through(self)
        assert self.result is not None
        return self.result


class StageOutputs:
    def __init__(self, batch: InputBatch, src_rank: int, pp_size: int, device) -> None:
        self.batch = batch
        self.src_rank = src_rank  # the last stage's rank with this TP rank
        self.pp_size = pp_size
        self.device = device
        self.pending: deque[PendingStageOutput] = deque()

    def submit(
        self,
        seq_ids: list[int],
        sampled_seq_ids: list[int],
        sample_no: np.ndarray,
        drafted: frozenset[int] = frozenset(),
    ) -> PendingStageOutput:
        """A step whose hidden states went to the next stage. `sampled_seq_ids` / `sample_no`:
        one entry per sample (`SamplingInputs.plan`); a fan-out keeps its first sample.
        `drafted`: the sequences whose rows carry drafts (never a fan-out's)."""
        flat = np.flatnonzero(sample_no == 0).tolist()
        next_ids = [sampled_seq_ids[k] for k in flat]
        handle = PendingStageOutput(self, frozenset(seq_ids), next_ids, flat, drafted)
        self.pending.append(handle)
        return handle

    def before_step(self, seq_ids: list[int]) -> None:
        """Receive what a step about to run needs: every output that runs one of its sequences,
        and all but the newest pp_size - 1 (the core has collected those: its FIFO holds at most
        pp_size steps). On rank 0 neither waits: the core collected them already."""
        pending = self.pending
        if not pending:
            return
        last = None
        for h in pending:
            if not h.seq_ids.isdisjoint(seq_ids):
                last = h
        if last is not None:
            self.receive_through(last)
        while len(pending) > self.pp_size - 1:
            self._receive_oldest()

    def receive_drafts(self) -> dict[int, list[int]]:
        """The drafts the last stage proposed for the step about to run (a worker-side
        proposer's, seq id -> drafts). The last stage sends them before that step's forward and
        after every older step's output, so those outputs are received first."""
        self.drain()
        return recv_object(self.src_rank)

    def receive_through(self, handle: PendingStageOutput) -> None:
        while handle.result is None:
            self._receive_oldest()

    def drain(self) -> None:
        """Receive everything still owed (before leaving: the last stage waits for its sends)."""
        while self.pending:
            self._receive_oldest()

    def _receive_oldest(self) -> None:
        h = self.pending.popleft()
        result: ModelRunnerOutput = recv_object(self.src_rank)
        h.result = result
        seqs, tokens = self.batch.seqs, result.sampled_token_ids
        flat = h.flat
        if h.drafted:  # the output lists each entry's emitted tokens in turn
            first: dict[int, int] = {}
            last: dict[int, int] = {}
            for i, s in enumerate(result.sampled_seq_ids):
                first.setdefault(s, i)
                last[s] = i
            flat = [last[s] if s in h.drafted else first[s] for s in h.next_ids]
        rows, ids = [], []
        for seq_id, k in zip(h.next_ids, flat):
            c = seqs.get(seq_id)
            if c is not None:  # else finished or dropped since the step ran
                rows.append(c.row)
                ids.append(tokens[k])
        if rows:
            index = torch.tensor(rows, dtype=torch.long).to(self.device)
            values = torch.tensor(ids, dtype=torch.int64).to(self.device)
            self.batch.last_token.index_copy_(0, index, values)


class StageSends:
    """Drops this rank's async pipeline sends (its step broadcasts, hidden states, the last
    stage's outputs and drafts) once a later step proves their peers took them.

    When a step N that ran sequences ends on a rank, every rank's sends up to the end of the
    step N - pp_size were received: the first stage's `before_step(N)` took the last stage's
    output of that step (it leaves at most pp_size - 1 steps owed), sent after the last stage
    had every broadcast and hidden state of it, and each later stage ran N on hidden states
    the first stage sent after that. One more step is kept as a margin: the sends of at most
    pp_size + 1 steps stay held, whatever the run's length.
    """

    def __init__(self, pp_size: int) -> None:
        self.marks: deque[int] = deque(maxlen=pp_size + 2)  # sends_mark() after recent steps

    def step_done(self) -> None:
        """After each step that ran sequences, on every rank (each sees the same steps)."""
        marks = self.marks
        marks.append(sends_mark())
        if len(marks) == marks.maxlen:
            release_sends(marks[0])


def drain_stage_outputs(worker) -> None:
    """A first-stage rank about to leave: receive every output still owed to it (the last
    stage's sends wait until they are taken)."""
    outputs = getattr(getattr(worker, "model_runner", None), "stage_outputs", None)
    if outputs is not None:
        outputs.drain()
