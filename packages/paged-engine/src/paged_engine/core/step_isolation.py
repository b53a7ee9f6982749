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

With no suspect the hot path pays one falsy-set check a step. Pipeline micro-batching
(`max_concurrent_batches` > 1) is refused: there a failure propagates and the caller fails the
requests in flight, as before. vLLM has no such isolation (an engine-core exception kills the
engine); this follows its preemption-by-recompute to put the requests back.

`StepIsolation` is a mixin of `EngineCore` (core/engine_core.py), `LoneSteps` one of
`Scheduler` (core/scheduler.py).
"""

from __future__ import annotations

import logging
from collections import deque
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


class RequestFailedError(RuntimeError):
    """A step failed twice with these requests alone in it: they were aborted (every other
    request goes on). `cause`: what the step raised (also `__cause__`)."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"request(s) {', '.join(request_ids)} failed: {cause!r}")
        self.request_ids = request_ids
        self.cause = cause


class StepIsolation:
    """Recovering from a failed step (mixed into `EngineCore`)."""

    # the EngineCore's state it uses (and its abort_requests, _apply)
    scheduler: Scheduler
    max_concurrent_batches: int
    _in_flight: deque[tuple[SchedulerOutput, RunnerOutputHandle]]

    def _step_failed(self, error: Exception, failed: SchedulerOutput) -> list[EngineCoreOutput]:
        """`failed` raised `error`: discard every step in flight, send their requests back to
        recompute as suspects; raise RequestFailedError if a suspect failed alone again."""
        if self.max_concurrent_batches > 1:  # pipeline micro-batching: not isolated
            raise error
        from paged_engine.executor.base import EngineDeadError

        scheds = [failed]
        while self._in_flight:  # wait for each: the worker must be done with their blocks
            sched, handle = self._in_flight.popleft()
            try:
                handle.get()
            except EngineDeadError:
                raise
            except Exception:  # (it failed too, or read what the failed one wrote)
                pass
            scheds.append(sched)
        scheduler = self.scheduler
        involved: dict[Request, None] = {}
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
        suspects = scheduler.suspects
        culprits = [req.request_id for req in involved if req in suspects]
        if culprits:
            for req in involved:
                suspects.discard(req)
            self.abort_requests(culprits)  # type: ignore[attr-defined]
            logger.error("a step failed again with request(s) %s alone: failing them", culprits)
            raise RequestFailedError(culprits, error) from error
        suspects.update(involved)
        logger.warning(
            "a step failed (%r); its %d request(s) recompute, each alone until one of its steps "
            "succeeds",
            error,
            len(involved),
        )
        return []

    def _apply_lone(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Apply a step while suspects are left; one that sampled (or pooled) clears its
        request (collected first: the step may finish it)."""
        live = self.scheduler.seqs
        reqs = {live[s].request for s in sched.seq_ids if s in live}
        outputs = self._apply(sched, out)  # type: ignore[attr-defined]
        if out.sampled_seq_ids or out.beam_topk or out.pooled:
            self.scheduler.suspects.difference_update(reqs)
        return outputs


class LoneSteps:
    """Putting requests of a failed step back, and running suspects alone (mixed into
    `Scheduler`)."""

    # the Scheduler's state these use (and its schedule, _release, _preempt, _enqueue)
    running: dict[Request, None]
    waiting: deque[Request]
    requests: dict[str, Request]
    suspects: set[Request]
    block_manager: BlockManager
    _reshare: set[Request]
    _by_priority: bool

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
        try:
            return self.schedule()  # type: ignore[attr-defined]
        finally:  # merge back: the suspect moved between the queues at most once
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
