"""CPU-only continuous batching under a per-step token budget (vLLM v1 style, no phases).

One invariant per sequence: `num_computed_tokens` catches up with `num_tokens`. Each step a
sequence runs

    | computed | new: min(num_tokens - num_computed, budget left) | not this step |
    0    num_computed                                       num_tokens

so a long prompt spreads over several steps (chunked prefill) while decodes keep running.

Order: running requests first (admission order), then waiting requests FCFS while the token
budget, `max_num_seqs` (live sequences; a request not yet forked reserves `max_live_seqs`) and
free blocks allow. When blocks run out, the most recently admitted running request is
preempted and goes back to the head of the waiting queue, its tokens (outputs included) kept.
With `policy="priority"` (vLLM's) both queues are ordered by (priority, arrival_time) instead,
lower first: the waiting queue on insertion, the running one at the start of each step, so the
victim is the running request that sorts last and a preempted request goes back to its place
in the waiting queue. Preemption keeps the tokens either way:
by recompute (its blocks are freed; a forked request, n > 1 or beams, shares its common prefix
blocks again when it is recomputed) or by swap (its blocks are copied to the CPU pool and come
back, with `num_computed_tokens` intact, when it is readmitted). `preemption_mode` picks one;
None chooses per request by cost (`_swaps`). Without chunked prefill a request's work runs whole,
unless it could never fit one step (a multi-sequence recompute). A step that can schedule
nothing while requests remain (and no step is in flight) raises SchedulerStuckError (a
RuntimeError naming the request that cannot fit, when one alone is to blame) instead of
looping forever.

The output is plain data (`SchedulerOutput`): `num_computed_tokens` advances here, when a step
is scheduled, and a token the step will sample counts as pending (`Sequence.num_pending`) until
the engine core applies the step's result. So with async scheduling the next step is planned
while this one runs: a decode row simply runs the pending position (the worker feeds it the
token it sampled, on the device). Requests whose next step depends on the host seeing the last
result (beam search, the fan-out of n > 1) sit out while they have a pending token; a sequence
whose pending token finishes it for sure (max_tokens, max_model_len) is not scheduled again.

Lockstep: the live sequences of one request reach the end of their tokens in the same step
(they are sampled together). If the budget cannot finish all of them, each gets at most
`remaining - 1` tokens. A request is (re)admitted with all its live sequences or not at all.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable

from paged_engine.core.block_manager import BlockManager
from paged_engine.core.request import Request, RequestStatus, Sequence, SequenceStatus, next_seq_id
from paged_engine.core.sched_output import NewSeqData, SchedulerOutput
from paged_engine.core.state_slots import BlockKey, StateSlots
from paged_engine.core.token_plan import (
    plan_tokens,
    reshare_plan,
    whole_image_plan,
    whole_images,
)
from paged_engine.kv_transfer.connector import KVConnector
from paged_engine.multimodal.inputs import is_embeds_prompt
from paged_engine.spec_decode.planner import DraftPlanner

_RUNNING = SequenceStatus.RUNNING
_WAITING = SequenceStatus.WAITING


class SchedulerStuckError(RuntimeError):
    """No step can be scheduled. `request_ids`: the requests that cannot fit even with the
    whole pool to themselves (abort them and the rest can go on); [] when unknown."""

    def __init__(self, message: str, request_ids: list[str]):
        super().__init__(message)
        self.request_ids = request_ids


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
        draft_planner: DraftPlanner | None = None,
        preemption_mode: str | None = None,
        max_loras: int = 0,
        policy: str = "fcfs",
        state_slots: StateSlots | None = None,
        kv_connector: KVConnector | None = None,
    ) -> None:
        assert max_num_seqs > 0 and max_num_batched_tokens > 0 and max_model_len > 0
        assert policy in ("fcfs", "priority"), policy
        self.policy = policy
        self._by_priority = policy == "priority"
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: dict[Request, None] = {}  # insertion-ordered set: admission order
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.seqs: dict[int, Sequence] = {}  # every live sequence of those requests
        self.num_preemptions = 0  # total, for metrics
        self.num_swap_preemptions = 0  # of those, by swap
        self.preemption_mode = preemption_mode
        self._reshare: set[Request] = (
            set()
        )  # preempted forked requests (see token_plan.reshare_plan)
        self._finished_seq_ids: list[int] = []  # to drop from the worker with the next output
        self._next_step_id = 0
        # step id -> its sequences that may fill a block (for the prefix cache), until the
        # engine core applies its result
        self.step_seqs: dict[int, list[Sequence]] = {}
        # Speculative decoding: proposes drafts for decode rows (None: off); seq id -> this
        # step's drafts, from schedule() to _emit().
        self.draft_planner = draft_planner
        self._drafts: dict[int, list[int]] = {}
        # LoRA: distinct adapters among running requests (the worker has that many slots).
        self.max_loras = max_loras
        # Hybrid models: each live sequence's recurrent-state row (None: no such state).
        self.state_slots = state_slots
        # Pipeline micro-batching (engine_core.py): requests with a step in flight, which sit
        # out until its result is applied (each step's requests are disjoint).
        self.busy: set[Request] = set()
        # KV transfer (kv_transfer/connector.py): stored prompt blocks at admission (None: off)
        self.kv_connector = kv_connector

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
        for seq in req.live_seqs():
            self.seqs[seq.seq_id] = seq
        if self._by_priority:
            self._enqueue(req)
        else:
            self.waiting.append(req)

    def _enqueue(self, req: Request) -> None:
        """Priority policy: insert where (priority, arrival_time) sorts (after equal keys)."""
        waiting = self.waiting
        key = _priority_key(req)
        if not waiting or _priority_key(waiting[-1]) <= key:
            waiting.append(req)  # the common case: same priority, newest arrival
        else:
            waiting.insert(bisect.bisect_right(waiting, key, key=_priority_key), req)

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

    # ---- finishing and forking ---------------------------------------------------------------
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
        self.block_manager.fork(parent, child)
        slots = self.state_slots
        if slots is not None and parent.state_slot >= 0:  # its own row, a copy of the parent's
            child.state_slot = slots.allocate()
            slots.copy(parent.state_slot, child.state_slot)
        parent.request.seqs.append(child)
        self.seqs[child.seq_id] = child
        return child

    def resend(self, seq: Sequence) -> None:
        """The host changed the sequence's tokens behind the worker's back (a beam took another
        candidate): the worker drops its copy and gets it again in full when next scheduled."""
        if seq.in_worker:
            seq.in_worker = False
            self._finished_seq_ids.append(seq.seq_id)

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
        if len(req.seqs) > 1 and not swapped:
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

    def _waits(self, req: Request, seq: Sequence, budget: int) -> bool:
        """Speculation under async scheduling: a sequence of a multi-sequence request that
        would draft now (`DraftPlanner.due`) while its token is pending holds its request back
        a step. (A sibling whose verify step is in flight plans no tokens: plan_tokens.)"""
        assert self.draft_planner is not None
        return seq.num_pending > 0 and self.draft_planner.due(req, seq, budget - 1)

    def _finishes_when_pending_lands(self, req: Request, seq: Sequence) -> bool:
        """Its pending token ends it for sure: scheduling it again would be wasted work."""
        return seq.num_tokens >= self.max_model_len or (
            req.max_tokens is not None and seq.num_output_tokens >= req.max_tokens
        )

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        max_len = self.max_model_len
        bm = self.block_manager
        allocate = bm.allocate_slots
        planned: list[tuple[Sequence, int]] = []
        admitted: list[Request] = []  # from the waiting queue (running ones ran before)
        preempted: list[Request] = []
        num_seqs = 0  # live sequences of the requests still running after this pass
        planner = self.draft_planner
        if planner is not None:
            planner.next_step(len(self.running))

        # 1) Running requests, in admission order (priority order under that policy). Victims
        #    come off the tail, which this loop has not reached yet, so nothing already
        #    scheduled is ever preempted.
        if self._by_priority and len(self.running) > 1:
            self.running = dict.fromkeys(sorted(self.running, key=_priority_key))
        reqs, busy = list(self.running), self.busy
        if busy:  # pipeline micro-batching: a step of these is in flight; they keep their seats
            num_seqs += sum(self._seq_slots(r, r.live_seqs()) for r in reqs if r in busy)
            reqs = [r for r in reqs if r not in busy]
        for req in reqs:
            if req.status != _RUNNING:  # preempted as a victim earlier in this loop
                continue
            seqs = req.seqs
            if len(seqs) == 1:  # fast path, one live sequence (else the request is finished)
                seq = seqs[0]
                num_seqs += req.max_live_seqs  # seats reserved for its forks (_seq_slots)
                if seq.num_pending and (
                    req.needs_host_result or self._finishes_when_pending_lands(req, seq)
                ):
                    continue
                num_tokens = len(seq.token_ids) + seq.num_pending
                n = num_tokens - seq.num_computed_tokens
                if n > budget:
                    n = budget if self._may_split(n) else 0
                    if n and req.mm_inputs:  # a chunk: never ending inside a Gemma 3 image
                        n = whole_images(seq, n, budget)
                if seq.state_checkpoints:  # end this step where a state snapshot is due
                    n = min(n, seq.state_checkpoints[0] - seq.num_computed_tokens)
                if n > 0:
                    assert num_tokens <= max_len, "the engine finishes at max_model_len"
                    if planner is not None and n == 1:
                        if seq.num_pending and planner.due(req, seq, budget - 1):
                            continue  # it drafts once its token landed (planner.py)
                        # Drafts ride along only where their blocks are free: never preempt.
                        drafts = planner.drafts(req, seq, budget - 1)
                        if drafts and allocate(seq, 1 + len(drafts)):
                            n += len(drafts)
                            self._drafts[seq.seq_id] = drafts
                    if not allocate(seq, n) and not self._make_room(req, seq, n, preempted):
                        num_seqs -= req.max_live_seqs
                        continue  # req preempted itself
                    planned.append((seq, n))
                    budget -= n
                continue
            seqs = req.live_seqs()
            num_seqs += len(seqs)
            if req.num_pending and (
                req.needs_host_result
                or all(self._finishes_when_pending_lands(req, s) for s in seqs)
                or (planner is not None and any(self._waits(req, s, budget) for s in seqs))
            ):
                continue  # (lengths may differ: each sequence speculates on its own)
            plan = self._reshare_plan(req, seqs, budget)
            if plan is None:
                self._reshare.discard(req)  # running with its blocks: sharing is settled
                plan = plan_tokens(seqs, budget, self._may_split) if budget else []
            plan = whole_image_plan(plan, budget)
            if not all(
                allocate(seq, n) or self._make_room(req, seq, n, preempted) for seq, n in plan
            ):
                num_seqs -= len(seqs)
                continue  # req preempted itself
            if plan:
                budget -= sum(n for _, n in plan)
                if planner is not None:
                    plan, budget = self._with_drafts(req, plan, budget)
                planned += plan

        # 2) Waiting requests, FCFS; none after a preemption (they would only thrash), and none
        #    past a preempted request whose pending token has not landed yet. A request whose
        #    LoRA adapter would exceed max_loras adapters in the batch is passed over (it keeps
        #    its place) while later ones are admitted.
        adapters = self._running_adapters() if self.max_loras and self.waiting else None
        passed: list[Request] = []
        while self.waiting and budget and not preempted:
            req = self.waiting[0]
            if req.num_pending or (busy and req in busy):  # preempted with a step in flight
                break
            if (
                adapters is not None
                and req.lora_id
                and req.lora_id not in adapters
                and len(adapters) >= self.max_loras
            ):
                passed.append(self.waiting.popleft())
                continue
            seqs = req.live_seqs()
            slots = self._seq_slots(req, seqs)
            if num_seqs + slots > self.max_num_seqs:
                break
            if bm.is_swapped(seqs[0]):  # its KV waits in the CPU pool
                plan = whole_image_plan(plan_tokens(seqs, budget, self._may_split), budget)
                if not plan or not bm.swap_in(seqs, plan):
                    break
                self._admit(req, seqs)
                if adapters is not None and req.lora_id:
                    adapters.add(req.lora_id)
                num_seqs += slots
                planned += plan
                budget -= sum(n for _, n in plan)
                admitted.append(req)
                continue
            counted = req.use_prefix_cache and self._computed_blocks(seqs)
            plan = self._reshare_plan(req, seqs, budget)
            if plan is None:
                plan = plan_tokens(seqs, budget, self._may_split)
                if plan and seqs[0].state_checkpoints:  # one sequence (_computed_blocks)
                    seq, n = plan[0]
                    plan = [(seq, min(n, seq.state_checkpoints[0] - seq.num_computed_tokens))]
            plan = whole_image_plan(plan, budget)
            if not plan or not all(allocate(seq, n) for seq, n in plan):
                for seq in seqs:  # roll back: blocks taken and prefix-cache stats counted
                    if counted:
                        bm.undo_computed_blocks(seq)
                    else:
                        bm.free(seq)
                    self._release_state(seq)
                break
            self._admit(req, seqs)
            if adapters is not None and req.lora_id:
                adapters.add(req.lora_id)
            num_seqs += slots
            planned += plan
            budget -= sum(n for _, n in plan)
            admitted.append(req)
        if passed:
            self.waiting.extendleft(reversed(passed))

        if not planned and self.requests and not busy and not self._any_pending():
            # Nothing runs: the head of the queue cannot fit even alone, so it alone is named.
            culprits = [] if self.running or not self.waiting else [self.waiting[0].request_id]
            raise SchedulerStuckError(
                "scheduler cannot make progress: a request needs more KV blocks than the pool "
                "holds, or more tokens/sequences in one step than max_num_batched_tokens / "
                f"max_num_seqs allow ({len(self.running)} running, {len(self.waiting)} waiting)",
                culprits,
            )
        return self._emit(planned, admitted)

    def _computed_blocks(self, seqs: list[Sequence]) -> bool:
        """Admission's prefix-cache hit for each sequence (blocks taken, num_computed_tokens
        set). Returns whether the lookup counted in the cache's stats.

        A hybrid model resumes only at the deepest hit block with a state snapshot (the rest of
        the hit is computed again; its state comes from a copy of the snapshot), and sets the
        block boundaries where snapshots are wanted for the requests to come: where the KV hit
        ends (a shared prefix, e.g. a system prompt, that has no snapshot yet) and the last full
        block of its tokens (the next turn of a chat resumes there). A forked request recomputed
        after preemption takes no hit: `reshare_plan` shares its prefix."""
        bm, slots = self.block_manager, self.state_slots
        if slots is None:
            for seq in seqs:
                bm.get_computed_blocks(seq)
            if self.kv_connector is not None and len(seqs) == 1:  # (a fork reshares instead)
                self.kv_connector.match(bm, seqs[0])
            return True
        if len(seqs) > 1:
            return False
        seq = seqs[0]
        bs = bm.block_size
        num_hit = bm.get_computed_blocks(seq) // bs
        # (a model whose prompt tokens update the state their own way resumes in the prompt)
        num = num_hit if slots.past_prompt else min(num_hit, seq.num_prompt_tokens // bs)
        row = None
        while num and (row := slots.lookup(bm.block_key(seq, num - 1))) is None:
            num -= 1
        if num < num_hit:
            bm.drop_computed_blocks(seq, num)
        if row is not None:
            seq.state_slot = slots.allocate()
            slots.copy(row, seq.state_slot)
            slots.snapshot_hits += 1
        end = seq.num_tokens if slots.past_prompt else seq.num_prompt_tokens
        marks = {num_hit * bs, end // bs * bs}
        seq.state_checkpoints = sorted(m for m in marks if num * bs < m <= end)
        return True

    def _with_drafts(
        self, req: Request, plan: list[tuple[Sequence, int]], budget: int
    ) -> tuple[list[tuple[Sequence, int]], int]:
        """Drafts for the decode rows of a multi-sequence request (n > 1), each sequence on its
        own, where the budget and free blocks allow. Called once the plan's blocks are taken:
        no preemption can drop the request (and its drafts) after this. Returns (plan, budget)."""
        planner, allocate = self.draft_planner, self.block_manager.allocate_slots
        assert planner is not None
        out = []
        for seq, n in plan:
            # Only a row that runs exactly its last token: a decode (a pending one never drafts:
            # the request waited if it was due, `_waits`).
            if n == 1 and budget and seq.num_computed_tokens + 1 == seq.num_tokens:
                drafts = planner.drafts(req, seq, budget)
                if drafts and allocate(seq, 1 + len(drafts)):  # never preempts for drafts
                    self._drafts[seq.seq_id] = drafts
                    n += len(drafts)
                    budget -= len(drafts)
            out.append((seq, n))
        return out, budget

    def _running_adapters(self) -> set[int]:
        return {req.lora_id for req in self.running if req.lora_id}

    def _admit(self, req: Request, seqs: list[Sequence]) -> None:
        self.waiting.popleft()
        self.running[req] = None
        req.status = RequestStatus.RUNNING
        for seq in seqs:
            seq.status = _RUNNING

    def _any_pending(self) -> bool:
        return any(req.num_pending for req in self.requests.values())

    def _emit(
        self, planned: list[tuple[Sequence, int]], admitted: list[Request]
    ) -> SchedulerOutput:
        """The plain-data step: advances num_computed_tokens and marks sampled tokens pending.
        `admitted`: the requests this step admitted (their first schedule time, if unset)."""
        out = SchedulerOutput(step_id=self._next_step_id)
        self._next_step_id += 1
        out.finished_seq_ids, self._finished_seq_ids = self._finished_seq_ids, []
        now = None
        for req in admitted:
            if req.first_scheduled_time is None:
                now = self.clock() if now is None else now
                req.first_scheduled_time = now
        out.seq_ids = [seq.seq_id for seq, _ in planned]
        out.num_new_tokens = num_new = [n for _, n in planned]
        out.start_positions = [seq.num_computed_tokens for seq, _ in planned]
        sample_rows, updates, new_seqs = out.sample_rows, out.block_updates, out.new_seqs
        bm = self.block_manager
        bs, caching = bm.block_size, bm.enable_prefix_caching
        slots, drafts_of = self.state_slots, self._drafts
        if slots is not None:  # first: the snapshots this step takes run with the next
            out.state_copies = slots.take_copies(self._known_block_key)
        filled: list[Sequence] = []  # may fill a block this step (for the prefix cache)
        for row, (seq, n) in enumerate(planned):
            start = seq.num_computed_tokens
            end = seq.num_computed_tokens = start + n
            if caching and end // bs > seq.num_registered_blocks:
                filled.append(seq)
            if seq.replay_end:  # a rolled-back verify step's tokens run again
                out.known_token_ids[seq.seq_id] = seq.token_ids[start : min(end, seq.replay_end)]
                if end >= seq.replay_end:
                    seq.replay_end = 0
            drafts = drafts_of.pop(seq.seq_id, None) if drafts_of else None
            if drafts:  # the row runs its last token and the drafts, and samples from all
                out.spec_token_ids[seq.seq_id] = drafts
                end -= len(drafts)
            if end == len(seq.token_ids) + seq.num_pending:
                sample_rows.append(row)
                req = seq.request
                if req.max_live_seqs > 1 and req.fans_out:
                    out.num_samples[seq.seq_id] = req.max_live_seqs
                seq.num_pending += 1
            table = seq.block_ids
            if slots is not None:
                if seq.state_slot < 0:
                    assert start == 0, "a sequence with computed tokens and no recurrent state"
                    seq.state_slot = slots.allocate()
                marks, end = seq.state_checkpoints, seq.num_computed_tokens
                if marks and marks[0] <= end:
                    if marks[0] == end:
                        slots.snapshot(seq.state_slot, seq, end // bs - 1)
                    seq.state_checkpoints = [m for m in marks if m > end]
                elif (  # a block of generated tokens ends here: the decode snapshot
                    slots.max_held
                    and end % bs == 0
                    and end > seq.num_prompt_tokens
                    and not drafts
                    and seq.request.max_live_seqs == 1
                ):
                    slots.snapshot(seq.state_slot, seq, end // bs - 1, decode=True)
            if not seq.in_worker:
                new_seqs.append(self._new_seq_data(seq, start))
                seq.in_worker = True
                seq.num_synced_blocks = len(table)
            elif seq.num_synced_blocks < len(table):
                first = seq.num_synced_blocks
                updates.append((seq.seq_id, first, table[first:]))
                seq.num_synced_blocks = len(table)
        out.num_batched_tokens = sum(num_new)
        if self.kv_connector is not None:
            self.kv_connector.build_step(out, planned)
        out.blocks_to_copy = bm.take_blocks_to_copy()
        out.blocks_to_swap_out, out.blocks_to_swap_in = bm.take_swaps()
        self.step_seqs[out.step_id] = filled
        return out

    def _known_block_key(self, seq: Sequence, i: int) -> BlockKey | None:
        """The prefix-cache key of full block i, None while one of its tokens is pending."""
        if len(seq.token_ids) < (i + 1) * self.block_manager.block_size:
            return None
        return self.block_manager.block_key(seq, i)

    @staticmethod
    def _new_seq_data(seq: Sequence, start: int) -> NewSeqData:
        """`start`: its first position this step; images placed before it are not sent."""
        req = seq.request
        return NewSeqData(
            seq_id=seq.seq_id,
            index=seq.index,
            token_ids=list(seq.token_ids),
            num_prompt_tokens=seq.num_prompt_tokens,
            block_ids=list(seq.block_ids),
            params=req.params,
            beam_candidates=req.beam.num_candidates if req.beam is not None else 0,
            eos_token_ids=tuple(sorted(req.eos_token_ids)),
            lora_id=req.lora_id,
            lora_path=req.lora_path,
            state_slot=seq.state_slot,
            # (PaliGemma's images also while their two-way prefix has tokens to run)
            mm_inputs=tuple(m for m in req.mm_inputs if max(m.end, m.prefix_end) > start),
            mrope=req.mrope,
            embeds_prompt=is_embeds_prompt(req.mm_inputs),
        )


def _verifying(seq: Sequence) -> bool:
    """A verify step of `seq` is in flight: it computed past its known and pending tokens (its
    drafts), and only the step's result tells how many of them count."""
    return seq.num_pending > 0 and seq.num_computed_tokens >= seq.num_tokens


def _priority_key(req: Request) -> tuple[int, float]:
    return (req.priority, req.arrival_time)
