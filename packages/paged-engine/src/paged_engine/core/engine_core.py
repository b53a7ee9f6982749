"""`EngineCore`: the step, and the one owner of request state.

    step():  scheduler.schedule() -> executor.execute_model() -> handle.get() -> _apply()

`_apply` is the only place that changes requests after a step ran: it appends sampled tokens,
checks eos / stop token ids / max_tokens / max_model_len, forks (n > 1, beams), frees, and
registers newly full blocks in the prefix cache. What it learned leaves as `EngineCoreOutput`s.
It and its helpers live in core/step_apply.py (`StepApplier`, a mixin of `EngineCore`); this
file has request intake (grammars compiling held back), the step loop with its steps in flight,
and pausing.

With async scheduling up to two steps are in flight: step N+1 is scheduled and submitted before
step N's result is applied (its sampled tokens count as pending; the worker feeds them to step
N+1 on the device), so the host work of one step hides behind the device work of the other.
Without it, each step is applied before the next is scheduled. Outputs are identical either way:
a token sampled for a sequence that finished meanwhile is dropped, and every seeded draw depends
only on (seed, sample index, position). With speculative decoding a row that would draft
waits for its pending token (n-gram drafts continue the host's tokens; a verify step's length
is known only once it landed: spec_decode/planner.py), so speculating rows step synchronously
while the others overlap; a request preempted with a verify step in flight recomputes.

Pipeline micro-batching (the executor's `max_concurrent_batches` > 1: pipeline parallelism) is
another reason to keep steps in flight, up to one per stage: while the later stages run step N
the first runs step N+1. It needs no pending tokens: the steps' requests are disjoint (a request
with a step in flight is `Scheduler.busy` and sits out until its result is applied), so each
request steps exactly as it would synchronously; only which requests share a step differs.

A step that raises (not `EngineDeadError`) is isolated (core/step_isolation.py): the steps in
flight are discarded, their requests recompute, each alone, and only one that fails alone again
is aborted (step() raises `RequestFailedError` naming it); not under micro-batching. So is a
step that raises while `drain()` applies it (pausing), and so are `schedule()` and `_apply`
raising (the host side of a step).

Constrained requests (structured outputs, bad words; `Request.constraint`): a request whose
grammar is still compiling is held here, out of the scheduler, until it compiles (one whose
grammar fails to compile is dropped: step() raises `RequestFailedError` naming it). Each step the
core fills the token bitmask of the constrained sequences it scheduled to sample
(`SchedulerOutput.token_bitmask`), and `_apply` advances their matchers with exactly the tokens
it appends (a fork copies its parent's matcher first). A matcher that says the output is
complete finishes its sequence with "stop". Such requests wait for their token before they are
scheduled again (`Request.needs_host_result`), so a mask always sees every earlier token. With
n-gram speculation they draft only tokens their constraint allows, and each draft position's
mask is filled with the drafts before it accepted (then rolled back); `_apply_verified`
advances the matcher with the tokens the verification kept.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import FIRST_COMPLETED, wait
from typing import TYPE_CHECKING

from paged_engine.core.core_output import BeamHypothesis, EngineCoreOutput, SeqUpdate
from paged_engine.core.request import Request, SequenceStatus
from paged_engine.core.sched_output import SchedulerOutput
from paged_engine.core.scheduler import Scheduler, SchedulerStuckError
from paged_engine.core.step_apply import StepApplier
from paged_engine.core.step_isolation import RequestFailedError, StepIsolation
from paged_engine.engine.request_latency import ITERATION_TOKENS_BUCKETS, Histogram
from paged_engine.executor.base import EngineDeadError, Executor, RunnerOutputHandle
from paged_engine.worker.runner_output import counts_nans_in_logits

if TYPE_CHECKING:
    from paged_engine.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

_STOPPED = SequenceStatus.FINISHED_STOPPED


class EngineCore(StepApplier, StepIsolation):
    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        *,
        max_model_len: int,
        async_scheduling: bool = False,
        structured: StructuredOutputManager | None = None,
    ) -> None:
        self.scheduler = scheduler
        self._stepping = threading.Lock()  # held through step(): one stepping thread at a time
        self.structured = structured
        self._compiling: list[Request] = []  # constrained, grammar not compiled yet (FCFS)
        self._constrained: dict[str, Request] = {}  # unfinished requests with a constraint
        self.executor = executor
        self.max_model_len = max_model_len
        self.async_scheduling = async_scheduling
        self._in_flight: deque[tuple[SchedulerOutput, RunnerOutputHandle]] = deque()
        # Pipeline micro-batching: steps in flight at most (1: off; async scheduling keeps its
        # own two), and each step's requests (busy until it is applied).
        self.max_concurrent_batches = (
            1 if async_scheduling else getattr(executor, "max_concurrent_batches", 1)
        )
        self._busy_of: dict[int, list[Request]] = {}
        # kv_transfer: sequences sent back to recompute after a failed load, whose tokens from
        # steps scheduled before it are dropped as they land (`_drop_failed_loads`)
        self._discard: set[int] = set()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # vLLM's corrupted_requests: the runner flags NaN logits only where this is set
        self.counts_nans = counts_nans_in_logits()
        self.corrupted_requests = 0
        self.peak_used_blocks = 0
        # tokens each submitted step runs (prompt chunks, decode tokens, drafts): vLLM's
        # iteration_tokens_total; observed on the engine thread, read on others
        self.iteration_tokens = Histogram(
            "iteration_tokens_total", "Tokens per engine step.", ITERATION_TOKENS_BUCKETS
        )
        # Sleep mode / pause_generation: nothing is scheduled (requests wait). `held`: outputs
        # made outside a step (the steps a pause drained, requests it aborted), which the next
        # step() returns first.
        self.paused = False
        self.held: list[EngineCoreOutput] = []

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.prompt_tokens_total += req.num_prompt_tokens
        if req.constraint is not None:
            self._constrained[req.request_id] = req
            if not req.constraint.ready or req.constraint.error() is not None:
                self._compiling.append(req)  # (a failed grammar fails at the next step)
                return
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.scheduler.abort_request(rid)
            self._constrained.pop(rid, None)
        if self._compiling:
            ids = set(request_ids)
            self._compiling = [r for r in self._compiling if r.request_id not in ids]

    def finish_seqs(self, stops: list[tuple[str, int, str]]) -> None:
        """The output stage saw stop strings: (request id, sequence index, stop string)."""
        for rid, index, stop in stops:
            req = self.scheduler.get_request(rid)
            if req is None:
                continue
            for seq in req.live_seqs():
                if seq.index == index:
                    seq.finish_reason = "stop"
                    self.scheduler.free_seq(seq, _STOPPED, stop)
        if self._constrained:
            self._forget_finished()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._compiling)

    def can_step(self) -> bool:
        """Whether step() has anything to do: held outputs, or while not paused requests, a
        step in flight (async scheduling's last, run past its requests' end) or sequences the
        worker still holds. The last two make an idle engine let go of every request."""
        if self.held:
            return True
        if self.paused:
            return False
        sched = self.scheduler
        return self.has_unfinished_requests() or bool(self._in_flight) or sched.has_worker_frees()

    # ---- pausing (sleep mode) -------------------------------------------------------------------
    def drain(self) -> list[RequestFailedError]:
        """Apply every step in flight; their outputs are held for the next step(). One that
        raises is isolated like a step's failure, none blamed yet (core/step_isolation.py);
        one whose results fail to apply fails its requests: returned, for the caller to raise
        once it is done (pausing)."""
        failed: list[RequestFailedError] = []
        while self._in_flight:
            sched, handle = self._in_flight.popleft()
            try:
                out = handle.get()
            except EngineDeadError:
                raise
            except Exception as e:  # its requests (and the later steps') recompute as suspects
                self._step_failed(e, sched, blame=False)
                break
            apply = self._apply_lone if self.scheduler.suspects else self._apply
            try:
                self.held += apply(sched, out)
            except Exception as e:  # (discards the later steps in flight too)
                try:
                    self._apply_failed(e, sched)
                except RequestFailedError as culprits:
                    failed.append(culprits)
        self.scheduler.busy.clear()  # (every step applied)
        self._busy_of.clear()
        return failed

    def abort_all(self) -> None:
        """Finish every unfinished request with "abort" (its tokens so far stay its output);
        the outputs saying so are held for the next step(). Drain first."""
        assert not self._in_flight, "drain() before abort_all()"
        reqs = list(self.scheduler.requests.values()) + self._compiling
        for req in reqs:
            o = EngineCoreOutput(req.request_id, [], True)
            if req.beam is not None:  # the finished hypotheses, then the live beams
                o.beams = [
                    BeamHypothesis(h.token_ids, h.cumulative_logprob, h.finish_reason, h.trace)
                    for h in req.beam.finished
                ] + [
                    BeamHypothesis(s.output_token_ids, s.cumulative_logprob, "abort", s.beam_trace)
                    for s in req.live_seqs()
                ]
            else:
                o.seqs = [SeqUpdate(s.index, [], finish_reason="abort") for s in req.live_seqs()]
            self.held.append(o)
        self.abort_requests([req.request_id for req in reqs])

    def preempt_all(self) -> None:
        """Every running request back to the waiting queue, its KV blocks freed (recomputed
        when it runs again). Drain first."""
        assert not self._in_flight, "drain() before preempt_all()"
        self.scheduler.preempt_all()

    @property
    def num_compiling(self) -> int:
        """Requests held while their grammar compiles (they count as waiting)."""
        return len(self._compiling)

    def check_health(self) -> None:
        """EngineDeadError if a worker rank is gone (`Executor.check_health`)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self._in_flight.clear()
        if self.structured is not None:
            self.structured.shutdown()
        self.executor.shutdown()

    def _admit_compiled(self) -> None:
        """Move requests whose grammar compiled to the scheduler (in arrival order). One whose
        grammar failed to compile (what validation on add could not see) is dropped and
        RequestFailedError raised naming it, its compile error the cause (a ValueError: the
        server answers 400), one such request per step. With nothing else to run, wait for the
        first compile."""
        if not self.scheduler.has_unfinished_requests() and not self._in_flight:
            futures = [r.constraint.grammar for r in self._compiling]
            wait(futures, timeout=0.05, return_when=FIRST_COMPLETED)  # stay responsive
        failed: Request | None = None
        still: list[Request] = []
        for req in self._compiling:
            if not req.constraint.ready:
                still.append(req)
            elif req.constraint.error() is not None:
                if failed is None:
                    failed = req
                else:
                    still.append(req)  # failed too: fails at the next step, with its own cause
            else:
                self.scheduler.add_request(req)
        self._compiling = still
        if failed is not None:
            rid = failed.request_id
            self._constrained.pop(rid, None)
            cause = failed.constraint.grammar.exception()
            logger.error("request %s: grammar failed to compile: %s", rid, cause)
            raise RequestFailedError([rid], cause) from cause

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Run one step; return what the oldest finished step produced ([] while the first of
        two async steps is still in flight, or when there is nothing to do or paused).
        RuntimeError when another thread is inside a step of this engine: the scheduler and
        block pool are one thread's at a time (a server's loop, or LLM.generate; not both)."""
        if not self._stepping.acquire(blocking=False):
            raise RuntimeError(
                "this engine is already running a step on another thread: one caller steps an "
                "engine at a time (a server's engine loop, or LLM.generate, not both at once)"
            )
        try:
            return self._step()
        finally:
            self._stepping.release()

    def _step(self) -> list[EngineCoreOutput]:
        if self.held or self.paused:
            held, self.held = self.held, []
            return held
        depth = 2 if self.async_scheduling else self.max_concurrent_batches
        submitted = False
        if self._compiling:
            self._admit_compiled()
        scheduler = self.scheduler
        if len(self._in_flight) < depth and (
            scheduler.has_unfinished_requests() or scheduler.has_worker_frees()
        ):
            try:
                sched = scheduler.schedule()
            except (SchedulerStuckError, EngineDeadError):
                raise
            except Exception as e:
                return self._schedule_failed(e)
            try:
                if self._constrained:
                    self._fill_token_bitmask(sched)
                if sched.is_empty and not sched.has_block_work and not sched.finished_seq_ids:
                    self.scheduler.step_seqs.pop(sched.step_id)
                else:
                    self._in_flight.append((sched, self.executor.execute_model(sched)))
                    submitted = not sched.is_empty
                    if submitted:
                        self.iteration_tokens.observe(sched.num_batched_tokens)
                    if submitted and self.max_concurrent_batches > 1:
                        self._mark_busy(sched)
            except EngineDeadError:
                raise
            except Exception as e:  # (no cost on the hot path: 3.11's try is free)
                return self._step_failed(e, sched)
        if not self._in_flight or (submitted and len(self._in_flight) < depth):
            return []
        sched, handle = self._in_flight.popleft()
        if self._busy_of:
            self._unmark_busy(sched.step_id)
        try:
            out = handle.get()
        except EngineDeadError:
            raise
        except Exception as e:
            return self._step_failed(e, sched)
        try:
            if self.scheduler.suspects:  # (one check a step: none but after a failed step)
                return self._apply_lone(sched, out)
            return self._apply(sched, out)
        except RequestFailedError:
            raise
        except Exception as e:
            return self._apply_failed(e, sched)

    def _mark_busy(self, sched: SchedulerOutput) -> None:
        """Micro-batching: the step's requests sit out until it is applied."""
        live = self.scheduler.seqs
        reqs = list({live[seq_id].request: None for seq_id in sched.seq_ids})
        self._busy_of[sched.step_id] = reqs
        self.scheduler.busy.update(reqs)

    def _unmark_busy(self, step_id: int) -> None:
        reqs = self._busy_of.pop(step_id, None)
        if reqs:
            self.scheduler.busy.difference_update(reqs)

    def _forget_finished(self) -> None:
        """Drop finished requests from `_constrained`, at each step's bitmask (an idle engine
        still runs the step that frees their sequences) and after stop strings."""
        live = self._constrained
        for rid in [rid for rid, req in live.items() if req.is_finished]:
            del live[rid]

    def _fill_token_bitmask(self, sched: SchedulerOutput) -> None:
        self._forget_finished()
        live = self._constrained
        if live and sched.sample_rows:
            assert self.structured is not None
            self.structured.fill_bitmask(sched, live.values())
