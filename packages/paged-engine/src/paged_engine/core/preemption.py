"""Preemption: a running request gives its device blocks back when a step needs them.

The victim (the running request that sorts last) returns to the waiting queue with every token
kept, either by recompute (its blocks are freed; a forked request, n > 1 or beams, re-shares its
common prefix when it is recomputed: token_plan.reshare_plan) or by swap (its blocks are copied
to the CPU pool and come back with `num_computed_tokens` intact). `_swaps` chooses by cost when
`preemption_mode` is None. `recompute` and `preempt_all` preempt between steps (a KV-transfer
load that failed; sleep mode).

`Preemption` is a mixin of `Scheduler` (core/scheduler.py); `schedule()` calls `_make_room`
when an allocation fails. vLLM v1: `Scheduler._preempt_request` and the victim loop in
`schedule()`; v1 preempts by recompute only (swapping was v0's `PreemptionMode.SWAP`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from paged_engine.core.request import Request, RequestStatus, Sequence, SequenceStatus
from paged_engine.core.token_plan import reshare_plan

if TYPE_CHECKING:
    from collections import deque

    from paged_engine.core.block_manager import BlockManager
    from paged_engine.core.state_slots import StateSlots

_WAITING = SequenceStatus.WAITING


class Preemption:
    """Preempting by recompute or swap, and re-sharing a recomputed fork (mixed into
    `Scheduler`)."""

    # the Scheduler's state these use (and its `_enqueue`, SeqLifecycle's `_release`)
    block_manager: BlockManager
    state_slots: StateSlots | None
    preemption_mode: str | None
    max_num_batched_tokens: int
    waiting: deque[Request]
    running: dict[Request, None]
    num_preemptions: int
    num_swap_preemptions: int
    _by_priority: bool
    _reshare: set[Request]
    _finished_seq_ids: list[int]

    def _swaps(self, seqs: list[Sequence]) -> bool:
        """Preempt by swap rather than recompute? Only with a CPU pool. By cost when
        preemption_mode is None: recomputing a request that fits in one step's token budget
        costs one prefill chunk and no transfer, so it recomputes; a longer one would hold the
        budget for several steps (and a forked one must rebuild its sharing), so it swaps:
        two copies of its blocks over the host link, one step to resume."""
        mode = self.preemption_mode
        if mode == "recompute" or self.block_manager.cpu is None:
            return False
        if mode == "swap" or len(seqs) > 1:
            return True
        return seqs[0].num_computed_tokens > self.max_num_batched_tokens

    def _preempt(self, req: Request, preempted: list[Request], *, allow_swap: bool = True) -> None:
        """Drop the request's device blocks, keep every token, back to the waiting head:
        swapped out to the CPU pool when `_swaps` says so and the pool has room (then its
        computed tokens stay computed), else for recompute. A pending token still arrives (its
        step was scheduled); the request is not readmitted before it has. A verify step in
        flight (async scheduling) recomputes: its drafts' slots are not known to be KV yet."""
        del self.running[req]
        seqs = req.live_seqs()
        swapped = (
            allow_swap
            and self._swaps(seqs)
            and not any(map(_verifying, seqs))
            and self.block_manager.swap_out(seqs)
        )
        for seq in seqs:
            if not swapped:
                self._release(seq)  # also resets num_computed_tokens to 0
            elif seq.in_worker:  # its row goes; it comes back in full with its new table
                seq.in_worker = False
                self._finished_seq_ids.append(seq.seq_id)
            seq.status = _WAITING
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self._by_priority:
            self._enqueue(req)
        else:
            self.waiting.appendleft(req)
        preempted.append(req)
        self.num_swap_preemptions += swapped
        # forked, or forking when its pending sample lands (async scheduling): recomputed as
        # one prompt shared again, not a copy per sequence (token_plan.reshare_plan)
        if (len(req.seqs) > 1 or req.fans_out) and not swapped:
            self._reshare.add(req)

    def recompute(self, req: Request) -> None:
        """Preempt a running request for recompute between steps (its KV is known to be
        stale: a KV-transfer load failed); it goes back to the head of the waiting queue."""
        if req in self.running:
            self._preempt(req, [], allow_swap=False)

    def preempt_all(self) -> None:
        """Preempt every running request for recompute (sleep mode discards the KV cache);
        they keep their order at the head of the waiting queue. No step may be in flight."""
        preempted: list[Request] = []
        for req in reversed(list(self.running)):
            self._preempt(req, preempted, allow_swap=False)

    def _reshare_plan(
        self, req: Request, seqs: list[Sequence], budget: int
    ) -> list[tuple[Sequence, int]] | None:
        if req not in self._reshare:
            return None
        return reshare_plan(self.block_manager, seqs, budget, self.state_slots)

    def _make_room(self, req: Request, seq: Sequence, n: int, preempted: list[Request]) -> bool:
        """Preempt from the tail of `running` until `seq` gets its blocks. False when `req`
        itself was the last one left to preempt (then it is preempted)."""
        while True:
            victim = next(reversed(self.running))
            # Itself: it may hold blocks allocated this pass (and copies): recompute.
            self._preempt(victim, preempted, allow_swap=victim is not req)
            if victim is req:
                return False
            if self.block_manager.allocate_slots(seq, n):
                return True


def _verifying(seq: Sequence) -> bool:
    """A verify step of `seq` is in flight: it computed past its known and pending tokens (its
    drafts), and only the step's result tells how many of them count."""
    return seq.num_pending > 0 and seq.num_computed_tokens >= seq.num_tokens
