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
nothing while requests remain (and no step is in flight), or in which a request preempts
itself with the whole pool to itself, raises SchedulerStuckError (a RuntimeError naming the
request that cannot fit, when one alone is to blame) instead of looping forever.

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

This file holds the queues and the step's plan (`schedule`: running requests, then admissions).
Its parts are mixins of `Scheduler`, one concept a file (vLLM v1 has them all in its one
`Scheduler`): seq_lifecycle.py (finishing, aborting, forking), preemption.py (recompute or swap,
re-sharing a recomputed fork), prefix_lookup.py (admission's prefix-cache / KV-connector hit,
hybrid snapshot resume), step_emit.py (the plan -> `SchedulerOutput`) and step_isolation.py
(after a failed step: its requests back to recompute, each run alone until it succeeds).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable

from paged_engine.core.block_manager import BlockManager
from paged_engine.core.preemption import Preemption
from paged_engine.core.preemption import _verifying as _verifying  # (re-exported: tests)
from paged_engine.core.prefix_lookup import PrefixLookup
from paged_engine.core.request import Request, RequestStatus, Sequence, SequenceStatus
from paged_engine.core.sched_output import SchedulerOutput
from paged_engine.core.seq_lifecycle import SeqLifecycle
from paged_engine.core.state_slots import StateSlots
from paged_engine.core.step_emit import PromptTokenSources, StepEmitter
from paged_engine.core.step_isolation import BatchCap, LoneSteps
from paged_engine.core.token_plan import plan_tokens, whole_image_plan, whole_images
from paged_engine.kv_transfer.connector import KVConnector
from paged_engine.spec_decode.planner import DraftPlanner

_RUNNING = SequenceStatus.RUNNING


class SchedulerStuckError(RuntimeError):
    """No step can be scheduled. `request_ids`: the requests that cannot fit even with the
    whole pool to themselves (abort them and the rest can go on); [] when unknown.
    `num_blocks`: the pool's allocatable blocks when it was raised."""

    def __init__(self, message: str, request_ids: list[str], num_blocks: int | None = None):
        super().__init__(message)
        self.request_ids = request_ids
        self.num_blocks = num_blocks

    def culprit_message(self) -> str:
        """What a named request's client is told (its `max_tokens` is the parameter to name)."""
        held = f" ({self.num_blocks} blocks)" if self.num_blocks else ""
        return (
            f"the request's sequences need more KV-cache blocks than the pool holds{held}; "
            "lower 'n' / 'best_of' or 'max_tokens'"
        )


class Scheduler(SeqLifecycle, Preemption, PrefixLookup, StepEmitter, LoneSteps):
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
        self.prompt_sources = PromptTokenSources()  # at first scheduling, for metrics
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
        # waiting requests the last schedule passed over because their LoRA adapter would have
        # exceeded max_loras (vLLM's `deferred` waiting reason; the rest wait for capacity)
        self.num_passed_for_adapters = 0
        # Hybrid models: each live sequence's recurrent-state row (None: no such state).
        self.state_slots = state_slots
        # Pipeline micro-batching (engine_core.py): requests with a step in flight, which sit
        # out until its result is applied (each step's requests are disjoint).
        self.busy: set[Request] = set()
        # KV transfer (kv_transfer/connector.py): stored prompt blocks at admission (None: off)
        self.kv_connector = kv_connector
        # Requests of a failed step, each run alone until one of its steps succeeds
        # (core/step_isolation.py); empty but after a failure.
        self.suspects: set[Request] = set()
        self.lone_suspect: Request | None = None  # the one a `schedule()` plans alone
        self.seats_held = 0  # seats of the running requests a lone run leaves out
        self.adapters_held: set[int] = set()  # and their LoRA adapters
        # A failure no request is to blame for that recurs lowers max_num_seqs (step_isolation.py)
        self.batch_cap = BatchCap(max_num_seqs)

    # ---- queues ------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id!r}"
        assert req.status == RequestStatus.WAITING and req.live_seqs()
        for seq in req.live_seqs():
            assert seq.num_tokens <= self.max_model_len, "prompt longer than max_model_len"
        if req.max_live_seqs > self.batch_cap.configured:
            raise ValueError(
                f"request {req.request_id!r} needs {req.max_live_seqs} sequences at once, "
                f"more than max_num_seqs={self.batch_cap.configured}"
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

    def has_worker_frees(self) -> bool:
        """Whether finished sequences wait to be dropped from the worker (their rows, penalty
        histories, LoRA slots): sent with the next step, an empty one once nothing runs."""
        return bool(self._finished_seq_ids)

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
        if self.suspects:  # after a failed step only (core/step_isolation.py)
            self.lone_suspect = None
            return self._schedule_lone()
        budget = self.max_num_batched_tokens
        max_len = self.max_model_len
        bm = self.block_manager
        allocate = bm.allocate_slots
        planned: list[tuple[Sequence, int]] = []
        admitted: list[Request] = []  # from the waiting queue (running ones ran before)
        preempted: list[Request] = []
        hopeless: Request | None = None  # preempted itself with the whole pool to itself
        num_seqs = self.seats_held  # live sequences of the requests still running after this pass
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
                    # Drafts ride on a decode row only (a one-token prompt chunk cut at a
                    # state checkpoint runs the prompt's next tokens after it, not drafts).
                    if planner is not None and num_tokens - seq.num_computed_tokens == 1:
                        if seq.num_pending and planner.due(req, seq, budget - 1):
                            continue  # it drafts once its token landed (planner.py)
                        # Drafts ride along only where their blocks are free: never preempt.
                        drafts = planner.drafts(req, seq, budget - 1)
                        if drafts and allocate(seq, 1 + len(drafts)):
                            n += len(drafts)
                            self._drafts[seq.seq_id] = drafts
                    if not allocate(seq, n) and not self._make_room(req, seq, n, preempted):
                        num_seqs -= req.max_live_seqs
                        if hopeless is None and self._outgrew_pool(req):
                            hopeless = req
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
                if hopeless is None and self._outgrew_pool(req):
                    hopeless = req
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
            # (under a batch cap, alone it is admitted anyway: it succeeded alone)
            if (
                num_seqs + slots > self.max_num_seqs
                and num_seqs
                and not self._cap_lifted(num_seqs + slots)
            ):
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
        self.num_passed_for_adapters = len(passed)
        if passed:
            self.waiting.extendleft(reversed(passed))

        if hopeless is not None:
            # Apart from the test below, which pipeline micro-batching can keep from ever
            # firing: requests admitted while this one's step was in flight take the blocks it
            # needs next; it preempts them mid-flight, then itself, is readmitted for a chunk
            # that fits, and so on. (Nothing ran: it headed `running`, a preemption admits none.)
            assert not planned
            culprits = [hopeless.request_id]
        elif not planned and self.requests and not busy and not self._any_pending():
            # Nothing runs: the head of the queue cannot fit even alone, so it alone is named.
            culprits = [] if self.running or not self.waiting else [self.waiting[0].request_id]
        else:
            return self._emit(planned, admitted)
        raise SchedulerStuckError(
            "scheduler cannot make progress: a request needs more KV blocks than the pool "
            "holds, or more tokens/sequences in one step than max_num_batched_tokens / "
            f"max_num_seqs allow ({len(self.running)} running, {len(self.waiting)} waiting)",
            culprits,
            self.block_manager.num_total_blocks,
        )

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
        held = {req.lora_id for req in self.running if req.lora_id}
        return held | self.adapters_held if self.adapters_held else held

    def _admit(self, req: Request, seqs: list[Sequence]) -> None:
        self.waiting.popleft()
        self.running[req] = None
        req.status = RequestStatus.RUNNING
        for seq in seqs:
            seq.status = _RUNNING

    def _outgrew_pool(self, req: Request) -> bool:
        """`req` just preempted itself: did it fail with every block of the pool its own (no
        other request running, all blocks free now)? Its sequences keep their tokens, so it
        can never fit: it is to blame."""
        pool = self.block_manager.pool
        return not self.running and pool.num_free_blocks == pool.num_blocks - 1

    def _any_pending(self) -> bool:
        return any(req.num_pending for req in self.requests.values())


def _priority_key(req: Request) -> tuple[int, float]:
    return (req.priority, req.arrival_time)
