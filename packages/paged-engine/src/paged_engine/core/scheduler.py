"""CPU-only continuous batching under a per-step token budget (vLLM v1 style, no phases).

One invariant per sequence: `num_computed_tokens` catches up with `num_tokens`. Each step a
sequence runs

    | computed | new: min(num_tokens - num_computed, budget left) | not this step |
    0    num_computed                                       num_tokens

so a long prompt spreads over several steps (chunked prefill) while decodes keep running.

Order: running requests first (admission order), then waiting requests FCFS while the token
budget, `max_num_seqs` (live sequences; a request not yet forked reserves `max_live_seqs`) and
free blocks allow. When blocks run out, the most recently admitted running request is
preempted by recompute: its blocks are freed, its tokens (outputs included) kept, and it goes
back to the head of the waiting queue (a forked request, n > 1 or beams, shares its common
prefix blocks again when it is recomputed). Without chunked prefill a request's work runs whole,
unless it could never fit one step (a multi-sequence recompute). A step that can schedule
nothing while requests remain raises RuntimeError instead of looping forever.

Lockstep: the live sequences of one request reach the end of their tokens in the same step
(they are sampled together). If the budget cannot finish all of them, each gets at most
`remaining - 1` tokens. A request is (re)admitted with all its live sequences or not at all.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from paged_engine.core.block_manager import BlockManager, BlockManagerStats
from paged_engine.core.request import Request, RequestStatus, Sequence, SequenceStatus, next_seq_id

_RUNNING = SequenceStatus.RUNNING
_WAITING = SequenceStatus.WAITING


class ScheduledSeq(NamedTuple):
    seq: Sequence
    num_new_tokens: int  # runs token_ids[num_computed : num_computed + num_new_tokens]


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) CoW
    num_batched_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    scheduled_requests: list[Request] = field(default_factory=list)  # each once, in order

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert max_num_seqs > 0 and max_num_batched_tokens > 0 and max_model_len > 0
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: dict[Request, None] = {}  # insertion-ordered set: admission order
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.num_preemptions = 0  # total, for metrics
        self._reshare: set[Request] = set()  # preempted forked requests (see _reshare_plan)

    # ---- queues ------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id!r}"
        assert req.status == RequestStatus.WAITING and req.live_seqs()
        for seq in req.live_seqs():
            assert seq.num_tokens <= self.max_model_len, "prompt longer than max_model_len"
        if req.max_live_seqs > self.max_num_seqs:
            raise ValueError(
                f"request {req.request_id!r} needs {req.max_live_seqs} sequences at once, "
                f"more than max_num_seqs={self.max_num_seqs}"
            )
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running_seqs(self) -> int:
        """Live sequences of running requests (not counting seats reserved for forks)."""
        return sum(len(req.live_seqs()) for req in self.running)

    def running_seqs(self) -> list[Sequence]:
        return [seq for req in self.running for seq in req.live_seqs()]

    def kv_stats(self) -> BlockManagerStats:
        """Block stats with slot waste measured over the running sequences."""
        return self.block_manager.stats(self.running_seqs())

    # ---- finishing ---------------------------------------------------------------------------
    def abort_request(self, request_id: str) -> bool:
        """Free everything the request holds, wherever it is. False if unknown or finished."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.finish_request(req, SequenceStatus.FINISHED_ABORTED)
        return True

    def free_seq(self, seq: Sequence, status: SequenceStatus | None = None) -> None:
        """The output processor finished `seq` (status set here or before): free its blocks.
        The request finishes when its last live sequence does."""
        if status is not None:
            seq.status = status
        assert seq.is_finished, "free_seq needs a finished status"
        if seq.finish_reason is None:
            seq.finish_reason = seq.status.finish_reason
        self.block_manager.free(seq)
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
            self.block_manager.free(seq)
        self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus | None = None) -> None:
        self._reshare.discard(req)
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
        self.block_manager.fork(parent, child)
        parent.request.seqs.append(child)
        return child

    # ---- one step ----------------------------------------------------------------------------
    @staticmethod
    def _seq_slots(req: Request, live: list[Sequence]) -> int:
        """Seats of max_num_seqs a request takes: its live seqs, or before its first fork the
        number it will fork into (so n > 1 / beams never overshoot max_num_seqs)."""
        return max(req.max_live_seqs, 1) if len(req.seqs) == 1 else len(live)

    def _may_split(self, num_tokens: int) -> bool:
        """Without chunked prefill, work that fits one empty step waits for one; work that could
        never fit (a multi-sequence request recomputed after preemption) is still split."""
        return self.enable_chunked_prefill or num_tokens > self.max_num_batched_tokens

    def _plan(self, seqs: list[Sequence], budget: int) -> list[tuple[Sequence, int]]:
        """Tokens per sequence of one request under `budget`; [] when nothing can run."""
        if len(seqs) == 1:
            seq = seqs[0]
            n = seq.num_tokens - seq.num_computed_tokens
            if n > budget:
                if not self._may_split(n):
                    return []
                n = budget
            return [(seq, n)] if n > 0 else []
        remaining = [s.num_tokens - s.num_computed_tokens for s in seqs]
        total = sum(remaining)
        if total <= budget:
            return [(s, r) for s, r in zip(seqs, remaining) if r > 0]
        if not self._may_split(total):
            return []
        # Lockstep: nobody may reach the end this step; each gets at most remaining - 1.
        plan = []
        for s, r in zip(seqs, remaining):
            n = min(r - 1, budget)
            if n > 0:
                plan.append((s, n))
                budget -= n
        return plan

    def _reshare_plan(
        self, req: Request, seqs: list[Sequence], budget: int
    ) -> list[tuple[Sequence, int]] | None:
        """A forked request (n > 1, beams) recomputed after preemption: the first sequence
        computes the common prefix alone, then the others share its full blocks as after the
        fork (recomputing each copy could need more blocks than the request ever held).
        Returns the first sequence's part while the others wait for it, None once shared
        (or nothing to share: e.g. prefix-cache hits already cover it)."""
        first, bm = seqs[0], self.block_manager
        bs = bm.block_size
        target = 0  # tokens the first sequence must have computed before the others share
        for seq in seqs[1:]:
            common = 0
            for a, b in zip(first.token_ids, seq.token_ids):
                if a != b:
                    break
                common += 1
            num_blocks = min(common, seq.num_tokens - 1) // bs  # the last token always runs
            if num_blocks <= len(seq.block_ids):
                continue
            if first.num_computed_tokens >= num_blocks * bs:
                bm.share_prefix(first, seq, num_blocks)
            else:
                target = max(target, num_blocks * bs)
        if not target:
            return None
        n = min(target - first.num_computed_tokens, budget)
        return [(first, n)] if n > 0 else []

    def _preempt(self, req: Request, preempted: list[Request]) -> None:
        """Recompute preemption: drop all blocks, keep every token, back to the waiting head."""
        del self.running[req]
        for seq in req.live_seqs():
            self.block_manager.free(seq)  # also resets num_computed_tokens to 0
            seq.status = _WAITING
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        preempted.append(req)
        if len(req.seqs) > 1:
            self._reshare.add(req)

    def _make_room(self, req: Request, seq: Sequence, n: int, preempted: list[Request]) -> bool:
        """Preempt from the tail of `running` until `seq` gets its blocks. False when `req`
        itself was the last one left to preempt (then it is preempted)."""
        while True:
            victim = next(reversed(self.running))
            self._preempt(victim, preempted)
            if victim is req:
                return False
            if self.block_manager.allocate_slots(seq, n):
                return True

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        max_len = self.max_model_len
        bm = self.block_manager
        allocate = bm.allocate_slots
        out = SchedulerOutput()
        scheduled, scheduled_reqs, preempted = out.scheduled, out.scheduled_requests, out.preempted
        num_seqs = 0  # live sequences of the requests still running after this pass

        # 1) Running requests, in admission order. Victims come off the tail, which this loop
        #    has not reached yet, so nothing already scheduled is ever preempted.
        for req in list(self.running):
            if req.status != _RUNNING:  # preempted as a victim earlier in this loop
                continue
            seqs = req.seqs
            if len(seqs) == 1:  # fast path, one live sequence (else the request is finished)
                seq = seqs[0]
                n = len(seq.token_ids) - seq.num_computed_tokens
                if n > budget:
                    n = budget if self._may_split(n) else 0
                if n > 0:
                    assert len(seq.token_ids) <= max_len, "the engine finishes at max_model_len"
                    if not allocate(seq, n) and not self._make_room(req, seq, n, preempted):
                        continue  # req preempted itself
                    scheduled.append(ScheduledSeq(seq, n))
                    budget -= n
                    scheduled_reqs.append(req)
                num_seqs += req.max_live_seqs  # seats reserved for its forks (_seq_slots)
                continue
            seqs = req.live_seqs()
            plan = self._reshare_plan(req, seqs, budget) if req in self._reshare else None
            if plan is None:
                self._reshare.discard(req)  # running with its blocks: sharing is settled
                plan = self._plan(seqs, budget) if budget else []
            if not all(
                allocate(seq, n) or self._make_room(req, seq, n, preempted) for seq, n in plan
            ):
                continue  # req preempted itself
            num_seqs += len(seqs)
            if plan:
                for seq, n in plan:
                    scheduled.append(ScheduledSeq(seq, n))
                    budget -= n
                scheduled_reqs.append(req)

        # 2) Waiting requests, FCFS; none after a preemption (they would only thrash).
        while self.waiting and budget and not preempted:
            req = self.waiting[0]
            seqs = req.live_seqs()
            slots = self._seq_slots(req, seqs)
            if num_seqs + slots > self.max_num_seqs:
                break
            if req.use_prefix_cache:
                for seq in seqs:
                    bm.get_computed_blocks(seq)
            plan = self._reshare_plan(req, seqs, budget) if req in self._reshare else None
            if plan is None:
                plan = self._plan(seqs, budget)
            if not plan or not all(allocate(seq, n) for seq, n in plan):
                for seq in seqs:  # roll back: blocks taken and prefix-cache stats counted
                    if req.use_prefix_cache:
                        bm.undo_computed_blocks(seq)
                    else:
                        bm.free(seq)
                break
            self.waiting.popleft()
            self.running[req] = None
            req.status = RequestStatus.RUNNING
            for seq in seqs:
                seq.status = _RUNNING
            num_seqs += slots
            for seq, n in plan:
                scheduled.append(ScheduledSeq(seq, n))
                budget -= n
            scheduled_reqs.append(req)

        if not scheduled and self.requests:
            raise RuntimeError(
                "scheduler cannot make progress: a request needs more KV blocks than the pool "
                "holds, or more tokens/sequences in one step than max_num_batched_tokens / "
                f"max_num_seqs allow ({len(self.running)} running, {len(self.waiting)} waiting)"
            )
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        out.blocks_to_copy = bm.take_blocks_to_copy()
        return out

    def update_after_step(self, out: SchedulerOutput) -> None:
        """The step ran: advance num_computed_tokens, register newly full blocks."""
        now = None
        for req in out.scheduled_requests:
            if req.first_scheduled_time is None:
                now = self.clock() if now is None else now
                req.first_scheduled_time = now
        bm = self.block_manager
        bs = bm.block_size
        caching = bm.enable_prefix_caching
        for seq, n in out.scheduled:
            if seq.status != _RUNNING:  # finished or aborted since schedule()
                continue
            seq.num_computed_tokens += n
            if caching and seq.num_computed_tokens // bs > seq.num_registered_blocks:
                bm.cache_full_blocks(seq)
