"""Finishing and forking: what the scheduler frees and forks outside a step's plan.

A sequence finishes (eos, a stop id, a length limit, abort) and gives back its blocks and
recurrent-state row; its request finishes with its last live sequence and leaves the queues. A
fork (n > 1, a beam with several children) shares all of its parent's blocks. A sequence whose
tokens the host changed (a beam that took another candidate) is sent to the worker again.

`SeqLifecycle` is a mixin of `Scheduler` (core/scheduler.py); it works on the scheduler's
queues, block manager and state slots. vLLM v1 keeps the finishing in its `Scheduler` too
(`finish_requests`, `_free_request`); it has no forks (n > 1 fans out into separate requests in
front of the engine core, beam search runs outside the engine).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from paged_engine.core.request import Request, RequestStatus, Sequence, SequenceStatus, next_seq_id

if TYPE_CHECKING:
    from collections import deque
    from collections.abc import Callable

    from paged_engine.core.block_manager import BlockManager
    from paged_engine.core.state_slots import StateSlots
    from paged_engine.kv_transfer.connector import KVConnector
    from paged_engine.spec_decode.planner import DraftPlanner


class SeqLifecycle:
    """Finishing, aborting, forking and re-sending sequences (mixed into `Scheduler`)."""

    # the Scheduler's state these methods use
    block_manager: BlockManager
    state_slots: StateSlots | None
    kv_connector: KVConnector | None
    draft_planner: DraftPlanner | None
    clock: Callable[[], float]
    waiting: deque[Request]
    running: dict[Request, None]
    requests: dict[str, Request]
    seqs: dict[int, Sequence]
    _reshare: set[Request]
    _finished_seq_ids: list[int]

    def abort_request(self, request_id: str) -> bool:
        """Free everything the request holds, wherever it is. False if unknown or finished."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.finish_request(req, SequenceStatus.FINISHED_ABORTED)
        return True

    def _release(self, seq: Sequence) -> None:
        """Free the sequence's blocks (and recurrent state); the worker drops it with the next
        step."""
        self.block_manager.free(seq)
        self._release_state(seq)
        seq.replay_end = 0  # recomputed from position 0 with every token sent
        if seq.in_worker:
            seq.in_worker = False
            self._finished_seq_ids.append(seq.seq_id)

    def _release_state(self, seq: Sequence) -> None:
        if seq.state_slot >= 0:
            assert self.state_slots is not None
            self.state_slots.free(seq.state_slot)
            self.state_slots.release(seq)
            seq.state_slot = -1
        seq.state_checkpoints = []

    def free_seq(
        self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None = None
    ) -> None:
        """Finish one sequence and free its blocks. The request finishes with its last live
        sequence."""
        assert status.is_finished, "free_seq needs a finished status"
        seq.status = status
        if seq.finish_reason is None:
            seq.finish_reason = status.finish_reason
            seq.stop_reason = stop_reason
        seq.num_pending = 0  # a token still in flight for it is dropped when it lands
        self._release(seq)
        self.seqs.pop(seq.seq_id, None)
        req = seq.request
        if not req.is_finished and not req.live_seqs():
            self._finish(req)

    def finish_request(
        self, req: Request, status: SequenceStatus = SequenceStatus.FINISHED_STOPPED
    ) -> None:
        """Finish every live sequence with `status` and the request with it (beam search end,
        abort). Idempotent on a finished request."""
        if req.is_finished:
            return
        for seq in req.live_seqs():
            seq.status = status
            if seq.finish_reason is None:
                seq.finish_reason = status.finish_reason
            seq.num_pending = 0
            self._release(seq)
            self.seqs.pop(seq.seq_id, None)
        self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus | None = None) -> None:
        self._reshare.discard(req)
        if self.kv_connector is not None:
            self.kv_connector.forget(req)
        if self.draft_planner is not None:
            self.draft_planner.forget(req)
        if req.status == RequestStatus.RUNNING:
            del self.running[req]
        elif req in self.waiting:  # O(num_waiting), only for a request finished while waiting
            self.waiting.remove(req)
        if status is None:  # derived: LENGTH only if every sequence hit a length limit
            lengths = all(s.status == SequenceStatus.FINISHED_LENGTH for s in req.seqs)
            status = SequenceStatus.FINISHED_LENGTH if lengths else SequenceStatus.FINISHED_STOPPED
        req.status = status
        req.finished_time = self.clock()
        del self.requests[req.request_id]

    def fork_seq(self, parent: Sequence, *, index: int, new_seq_id: int | None = None) -> Sequence:
        """A child sharing all of the parent's blocks; appended to the request's seqs."""
        child = parent.fork(next_seq_id() if new_seq_id is None else new_seq_id, index)
        slots = self.state_slots
        if slots is not None and parent.state_slot >= 0:  # its own row, a copy of the parent's
            child.state_slot = slots.allocate()  # (first: raising here leaves nothing held)
            slots.copy(parent.state_slot, child.state_slot)
        self.block_manager.fork(parent, child)
        parent.request.seqs.append(child)
        self.seqs[child.seq_id] = child
        return child

    def resend(self, seq: Sequence) -> None:
        """The host changed the sequence's tokens behind the worker's back (a beam took another
        candidate): the worker drops its copy and gets it again in full when next scheduled."""
        if seq.in_worker:
            seq.in_worker = False
            self._finished_seq_ids.append(seq.seq_id)
