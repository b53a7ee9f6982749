"""Step-failure isolation: a step that raises fails the request to blame, not the whole batch.

When executing a step raises (anything but `EngineDeadError`: say one request's image makes
the encoder throw, or a model hook rejects its tokens), the engine core

1. discards every step in flight (async scheduling keeps two; each is waited for, its result
   dropped): every request of those steps goes back to the waiting queue for recompute, its
   known tokens kept, its pending tokens dropped, its blocks freed (nothing of the failed steps
   is applied or registered in the prefix cache), exactly as a recompute preemption leaves it;
2. marks those requests suspects: while any is left, each step runs the first suspect alone
   (`Scheduler._schedule_lone`), through its prefill chunks, until one of its steps samples (or
   pools); then it is cleared;
3. a suspect whose lone step fails again is the culprit: it is aborted and step() raises
   `RequestFailedError` naming it (the caller fails that request with the cause), while every
   other request goes on and produces what it would have produced (greedy and seeded draws
   depend only on tokens and positions).

A failure that is no request's fault and recurs only in big batches (an out-of-memory whenever
the batch is full) would cycle: batch fails, each request succeeds alone, the batch re-forms and
fails again. So a failure with no culprit (every suspect of it succeeded alone) that is followed
within `RECUR_WINDOW` steps by another fresh failure caps the batch (`BatchCap`):
`Scheduler.max_num_seqs` drops to half the sequences of the step that failed again (at least
1), with a warning naming the cap, and each further recurrence halves it again. Admission obeys
it (one request with more sequences than the cap is still admitted alone: a cap of 1 is the
lone run that succeeded), and once the suspects are cleared the running requests past it go
back to wait (`suspects_cleared`: each ran alone and stayed running). Tokens per step are not
capped (a suspect's lone steps ran the full token budget and succeeded). So such a failure
costs at most about log2(max_num_seqs) + 2 failed steps and each costs one lone run per
request; no request is lost, and greedy / seeded outputs stay those of a clean run. The cap
lifts (back to the configured max_num_seqs, logged) the first time it keeps a request out after
holding `CAP_HOLD_STEPS << lifts` steps (the hold doubles with each lift, so a failure that
comes back with the full batch costs a bounded number of failed steps per doubling period).

The host side of a step is isolated too. `schedule()` raising while it plans a step
(`_schedule_failed`): the lost plan's leftovers are dropped (an emitted step's `step_seqs`
entry, drafts) and every request it may have touched (the running ones, the waiting queue's
head, any waiting one holding device blocks: an admission cut short; one taken off the queue
is put back) recomputes as a suspect, as after a failed step; a suspect whose lone planning
raises (`Scheduler.lone_suspect`) is the culprit. Applying a step's results raising part way
(`_apply_failed`): what its requests emitted is unknown, so they fail (RequestFailedError);
the steps in flight after it are discarded and their other requests recompute.

`drain()` (pause, sleep, resetting the prefix cache) applies the steps in flight; one that
raises goes through the same isolation (`_step_failed(..., blame=False)`): its requests recompute
as suspects, but none is blamed while draining (no lone step ran): a culprit fails once
scheduling resumes and runs it alone. (A "wait" pause steps normally: engine/sleep_mode.py
raises the culprits' `RequestFailedError` once paused.) With tensor parallelism a step every
rank failed reaches here as with one process (executor/multiproc.py); others kill the engine.

With no suspect the hot path pays one falsy-set check a step (the cap costs nothing until it
keeps a request out: then ~0.1 us a step). Pipeline micro-batching (`max_concurrent_batches`
> 1) is refused: there a failure propagates and the caller fails the requests in flight, as
before. vLLM has no such isolation (an engine-core exception kills the
engine); this follows its preemption-by-recompute to put the requests back.

`StepIsolation` is a mixin of `EngineCore` (core/engine_core.py), `LoneSteps` one of
`Scheduler` (core/scheduler.py).
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from paged_engine.core.request import Request

if TYPE_CHECKING:
    from paged_engine.core.block_manager import BlockManager
    from paged_engine.core.core_output import EngineCoreOutput
    from paged_engine.core.sched_output import SchedulerOutput
    from paged_engine.core.scheduler import Scheduler
    from paged_engine.executor.base import RunnerOutputHandle
    from paged_engine.worker.runner_output import ModelRunnerOutput

logger = logging.getLogger(__name__)

RECUR_WINDOW = 1024  # steps: a fresh failure this soon after a blameless one ended recurs
CAP_HOLD_STEPS = 1024  # steps a batch cap holds before it may lift (doubled per lift)


class RequestFailedError(RuntimeError):
    """A step failed twice with these requests alone in it: they were aborted (every other
    request goes on). `cause`: what the step raised (also `__cause__`)."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"request(s) {', '.join(request_ids)} failed: {cause!r}")
        self.request_ids = request_ids
        self.cause = cause


@dataclass(slots=True)
class BatchCap:
    """The batch cap of recurring blameless failures (`Scheduler.batch_cap`); while one is in
    force `Scheduler.max_num_seqs` is lowered, `configured` keeps the engine's own."""

    configured: int  # max_num_seqs as configured
    lift_at: int = sys.maxsize  # step id from which the cap may lift (maxsize: no cap)
    lifts: int = 0
    cleared_at: int | None = None  # step id where the last failure's suspects all succeeded
    blamed: bool = False  # the last failure found a culprit


class StepIsolation:
    """Recovering from a failed step (mixed into `EngineCore`)."""

    # the EngineCore's state it uses (and its abort_requests, _apply)
    scheduler: Scheduler
    max_concurrent_batches: int
    _in_flight: deque[tuple[SchedulerOutput, RunnerOutputHandle]]

    def _step_failed(
        self,
        error: Exception,
        failed: SchedulerOutput | None,
        *,
        blame: bool = True,
        also: Iterable[Request] = (),
    ) -> list[EngineCoreOutput]:
        """`failed` raised `error` (None: `schedule()` raised while planning a step, which
        involves `also`, the requests it may have touched): discard every step in flight, send
        their requests back to recompute as suspects; raise RequestFailedError if a suspect
        failed alone again (unless not `blame`: drain() runs no lone step, the suspect stays
        one). A fresh failure soon after a blameless one caps the batch
        (`LoneSteps.cap_batch`)."""
        if self.max_concurrent_batches > 1:  # pipeline micro-batching: not isolated
            raise error
        scheduler = self.scheduler
        scheds = ([] if failed is None else [failed]) + self._discard_in_flight()
        involved: dict[Request, None] = dict.fromkeys(also)
        for sched in scheds:
            scheduler.step_seqs.pop(sched.step_id, None)  # nothing of it is cached
            for seq_id in sched.seq_ids:
                seq = scheduler.seqs.get(seq_id)
                if seq is not None:
                    involved[seq.request] = None
            # the worker drops these whether or not the failed step reached it (idempotent)
            scheduler._finished_seq_ids += sched.finished_seq_ids
            if sched.blocks_to_swap_out:  # a victim's copy to the CPU pool may not have run
                involved.update(dict.fromkeys(scheduler.swapped_requests()))
        if not involved:  # block work only: no request to blame
            raise error
        for req in involved:
            scheduler.discard_steps(req)
        suspects, cap = scheduler.suspects, scheduler.batch_cap
        if failed is None:  # a planning failure: only the suspect it planned alone is to blame
            lone = scheduler.lone_suspect
            culprits = [] if lone is None or lone.is_finished else [lone.request_id]
        else:
            culprits = [req.request_id for req in involved if req in suspects]
        scheduler.lone_suspect = None
        if culprits and blame:
            cap.blamed = True
            suspects.difference_update(involved)
            self.abort_requests(culprits)  # type: ignore[attr-defined]
            logger.error("a step failed again with request(s) %s alone: failing them", culprits)
            raise RequestFailedError(culprits, error) from error
        if not suspects:  # a fresh failure (a suspect only ever runs alone)
            step_id = scheduler._next_step_id if failed is None else failed.step_id
            recurs = cap.cleared_at is not None and step_id - cap.cleared_at <= RECUR_WINDOW
            cap.cleared_at, cap.blamed = None, False
            if recurs:
                width = len({seq_id for sched in scheds for seq_id in sched.seq_ids})
                scheduler.cap_batch(max(width, len(involved)), error)
        suspects.update(involved)
        logger.warning(
            "a step failed (%r); its %d request(s) recompute, each alone until one of its steps "
            "succeeds",
            error,
            len(involved),
        )
        return []

    def _schedule_failed(self, error: Exception) -> list[EngineCoreOutput]:
        """`scheduler.schedule()` raised: the step it planned is lost, and any request it may
        have touched (every running one, any it took off the waiting queue) recomputes as a
        suspect, as after a failed step; one that fails planning alone is blamed."""
        scheduler = self.scheduler
        in_flight = {sched.step_id for sched, _ in self._in_flight}
        for step_id in [i for i in scheduler.step_seqs if i not in in_flight]:
            del scheduler.step_seqs[step_id]  # emitted, then the planning raised
        scheduler._drafts.clear()  # the lost plan's drafts (an emitted step took its own)
        queued = {**scheduler.running, **dict.fromkeys(scheduler.waiting)}
        stranded = [r for r in scheduler.requests.values() if r not in queued]
        for req in stranded:  # taken off the waiting queue, not yet running: put back
            scheduler.waiting.appendleft(req)
        is_swapped = scheduler.block_manager.is_swapped
        admitting = [  # the queue's head, and any waiting request with device blocks: an
            r  # admission cut short
            for i, r in enumerate(scheduler.waiting)
            if i == 0 or any(s.block_ids and not is_swapped(s) for s in r.live_seqs())
        ]
        return self._step_failed(error, None, also=[*scheduler.running, *admitting])

    def _apply_failed(self, error: Exception, sched: SchedulerOutput) -> list[EngineCoreOutput]:
        """Applying `sched`'s results raised part way: what its requests emitted is unknown,
        so they fail (RequestFailedError); the steps in flight after it are discarded and their
        other requests recompute, every other request goes on."""
        scheduler = self.scheduler
        scheduler.step_seqs.pop(sched.step_id, None)
        live = scheduler.seqs
        failed = {live[s].request: None for s in sched.seq_ids if s in live}
        later = self._discard_in_flight()
        for step in later:
            scheduler.step_seqs.pop(step.step_id, None)
            scheduler._finished_seq_ids += step.finished_seq_ids
            for seq_id in step.seq_ids:
                seq = live.get(seq_id)
                if seq is not None and seq.request not in failed:
                    scheduler.discard_steps(seq.request)
        scheduler._finished_seq_ids += sched.finished_seq_ids
        culprits = [req.request_id for req in failed if not req.is_finished]
        scheduler.suspects.difference_update(failed)
        self.abort_requests(culprits)  # type: ignore[attr-defined]
        logger.error("applying a step's results failed (%r): failing %s", error, culprits)
        if not culprits:
            return []
        raise RequestFailedError(culprits, error) from error

    def _discard_in_flight(self) -> list[SchedulerOutput]:
        """Wait for every step in flight (the worker must be done with their blocks) and drop
        its results; return their schedules."""
        from paged_engine.executor.base import EngineDeadError

        scheds = []
        while self._in_flight:
            sched, handle = self._in_flight.popleft()
            try:
                handle.get()
            except EngineDeadError:
                raise
            except Exception:  # (it failed too, or read what the failed one wrote)
                pass
            scheds.append(sched)
        return scheds

    def _apply_lone(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Apply a step while suspects are left; one that sampled (or pooled) clears its
        request (collected first: the step may finish it)."""
        live = self.scheduler.seqs
        reqs = {live[s].request for s in sched.seq_ids if s in live}
        outputs = self._apply(sched, out)  # type: ignore[attr-defined]
        if out.sampled_seq_ids or out.beam_topk or out.pooled:
            scheduler = self.scheduler
            scheduler.suspects.difference_update(reqs)
            if not scheduler.suspects:
                scheduler.suspects_cleared(sched.step_id)
        return outputs


class LoneSteps:
    """Putting requests of a failed step back, and running suspects alone (mixed into
    `Scheduler`)."""

    # the Scheduler's state these use (and its schedule, _release, _preempt, _enqueue)
    running: dict[Request, None]
    waiting: deque[Request]
    requests: dict[str, Request]
    suspects: set[Request]
    batch_cap: BatchCap
    max_num_seqs: int
    block_manager: BlockManager
    _reshare: set[Request]
    _by_priority: bool
    _next_step_id: int
    lone_suspect: Request | None  # the suspect `schedule()` is planning alone, if any
    seats_held: int  # seats of the requests outside a lone run (0 otherwise)
    adapters_held: set[int]  # and their LoRA adapters

    def cap_batch(self, width: int, error: Exception) -> None:
        """A blameless failure recurred in a step of `width` sequences: admit at most half as
        many per step (at least 1) for the next `CAP_HOLD_STEPS << lifts` steps."""
        cap = self.batch_cap
        self.max_num_seqs = max(1, min(width, self.max_num_seqs) // 2)
        hold = CAP_HOLD_STEPS << min(cap.lifts, 16)
        cap.lift_at = self._next_step_id + hold
        logger.warning(
            "a step of %d sequence(s) failed again (%r) though each of its requests succeeded "
            "alone: capping steps at %d sequence(s) (max_num_seqs=%d) for at least %d steps",
            width,
            error,
            self.max_num_seqs,
            cap.configured,
            hold,
        )

    def suspects_cleared(self, step_id: int) -> None:
        """The last suspect succeeded alone (in step `step_id`): unless one was blamed, the
        failure had no culprit. Under a batch cap, the running requests past it (each ran alone
        and stays running) go back to wait, recompute: the cap binds admission only."""
        cap = self.batch_cap
        if not cap.blamed:
            cap.cleared_at = step_id
        if self.max_num_seqs == cap.configured:
            return
        seats, over = 0, []
        for req in self.running:  # admission order: the latest go
            slots = self._seq_slots(req, req.live_seqs())  # type: ignore[attr-defined]
            if seats and seats + slots > self.max_num_seqs:
                over.append(req)
            else:
                seats += slots
        for req in reversed(over):  # (each to the head of the queue: FCFS kept)
            self._preempt(req, [], allow_swap=False)  # type: ignore[attr-defined]

    def _cap_lifted(self, seats: int) -> bool:
        """Admission is full: lift a batch cap that has held its steps. Whether `seats` (the
        step's with the next request) now fit (no cap, or one still held: False)."""
        cap = self.batch_cap
        if self._next_step_id < cap.lift_at:
            return False
        cap.lift_at, cap.lifts = sys.maxsize, cap.lifts + 1
        logger.warning(
            "lifting the batch cap of %d sequence(s) after %d steps: max_num_seqs=%d again",
            self.max_num_seqs,
            CAP_HOLD_STEPS << min(cap.lifts - 1, 16),
            cap.configured,
        )
        self.max_num_seqs = cap.configured
        return seats <= self.max_num_seqs

    def discard_steps(self, req: Request) -> None:
        """Its steps in flight were discarded: their pending tokens never land, and what they
        computed is not KV (so a swapped-out copy is stale too): back to recompute."""
        for seq in req.live_seqs():
            seq.num_pending = 0
        if req in self.running:
            self._preempt(req, [], allow_swap=False)  # type: ignore[attr-defined]
        else:  # preempted with a step in flight
            for seq in req.live_seqs():
                self._release(seq)  # type: ignore[attr-defined]
            if len(req.seqs) > 1:
                self._reshare.add(req)

    def swapped_requests(self) -> list[Request]:
        """Waiting requests whose KV sits in the CPU pool (swap preemption)."""
        is_swapped = self.block_manager.is_swapped
        return [r for r in self.waiting if is_swapped(r.live_seqs()[0])]

    def _schedule_lone(self) -> SchedulerOutput:
        """This step runs the first suspect (running, else waiting) and nothing else."""
        suspect = next((r for r in self.running if r in self.suspects), None)
        if suspect is None:
            suspect = next((r for r in self.waiting if r in self.suspects), None)
        if suspect is None:  # the suspects finished (aborted) meanwhile
            self.suspects.clear()
            return self.schedule()  # type: ignore[attr-defined]
        from paged_engine.core.scheduler import SchedulerStuckError

        self.lone_suspect = suspect  # (to blame if planning it raises: _step_failed)
        try:
            return self._run_alone(suspect)
        except SchedulerStuckError:  # the others hold the blocks it needs: they recompute
            others = [r for r in self.running if r is not suspect and not r.num_pending]
            if not others:
                raise
            for req in reversed(others):
                self._preempt(req, [], allow_swap=False)  # type: ignore[attr-defined]
            return self._run_alone(suspect)

    def _run_alone(self, suspect: Request) -> SchedulerOutput:
        """`schedule()` with the suspect as the only request in the queues."""
        running, waiting, suspects = self.running, self.waiting, self.suspects
        was_running = suspect in running
        self.running = {suspect: None} if was_running else {}
        self.waiting = deque() if was_running else deque([suspect])
        self.suspects = set()  # (schedule() plans normally, this once)
        # the seats (and recurrent-state rows) and LoRA adapters the others running hold:
        # admission counts them (a suspect that does not fit beside them gets them preempted:
        # _schedule_lone)
        others = [r for r in running if r is not suspect]
        seats = self._seq_slots  # type: ignore[attr-defined]
        self.seats_held = sum(seats(r, r.live_seqs()) for r in others)
        self.adapters_held = {r.lora_id for r in others if r.lora_id}  # (max_loras)
        try:
            return self.schedule()  # type: ignore[attr-defined]
        finally:  # merge back: the suspect moved between the queues at most once
            self.seats_held = 0
            self.adapters_held = set()
            now_running = suspect in self.running
            self.running, self.waiting, self.suspects = running, waiting, suspects
            if now_running and not was_running:  # admitted (admission order: last)
                waiting.remove(suspect)
                running[suspect] = None
            elif was_running and not now_running:  # it preempted itself
                del running[suspect]
                if self._by_priority:
                    self._enqueue(suspect)  # type: ignore[attr-defined]
                else:
                    waiting.appendleft(suspect)
