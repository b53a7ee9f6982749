"""`EngineCore`: the step, and the one owner of request state.

    step():  scheduler.schedule() -> executor.execute_model() -> handle.get() -> _apply()

`_apply` is the only place that changes requests after a step ran: it appends sampled tokens,
checks eos / stop token ids / max_tokens / max_model_len, forks (n > 1, beams), frees, and
registers newly full blocks in the prefix cache. What it learned leaves as `EngineCoreOutput`s.

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

Constrained requests (structured outputs, bad words; `Request.constraint`): a request whose
grammar is still compiling is held here, out of the scheduler, until it compiles. Each step the
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

import torch

from paged_engine.core.core_output import BeamHypothesis, EngineCoreOutput, SeqUpdate
from paged_engine.core.request import Request, Sequence, SequenceStatus
from paged_engine.core.sched_output import SchedulerOutput
from paged_engine.core.scheduler import Scheduler
from paged_engine.executor.base import Executor, RunnerOutputHandle
from paged_engine.worker.runner_output import ModelRunnerOutput

if TYPE_CHECKING:
    from paged_engine.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

_RUNNING = SequenceStatus.RUNNING
_STOPPED = SequenceStatus.FINISHED_STOPPED
_LENGTH = SequenceStatus.FINISHED_LENGTH
_REPETITION = SequenceStatus.FINISHED_REPETITION


class EngineCore:
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
        self.peak_used_blocks = 0
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
            if not req.constraint.ready:
                self._compiling.append(req)
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

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._compiling)

    def can_step(self) -> bool:
        """Whether step() has anything to do: held outputs, or requests while not paused."""
        return bool(self.held) or (not self.paused and self.has_unfinished_requests())

    # ---- pausing (sleep mode) -------------------------------------------------------------------
    def drain(self) -> None:
        """Apply every step in flight; their outputs are held for the next step()."""
        while self._in_flight:
            sched, handle = self._in_flight.popleft()
            self.held += self._apply(sched, handle.get())
        self.scheduler.busy.clear()  # (every step applied)
        self._busy_of.clear()

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

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Move requests whose grammar compiled to the scheduler (in arrival order); finish
        those whose grammar failed. With nothing else to run, wait for the first compile."""
        if not self.scheduler.has_unfinished_requests() and not self._in_flight:
            futures = [r.constraint.grammar for r in self._compiling]
            wait(futures, timeout=0.05, return_when=FIRST_COMPLETED)  # stay responsive
        failed: list[EngineCoreOutput] = []
        still: list[Request] = []
        for req in self._compiling:
            if not req.constraint.ready:
                still.append(req)
            elif (error := req.constraint.error()) is not None:
                logger.error("request %s: grammar failed to compile: %s", req.request_id, error)
                self._constrained.pop(req.request_id, None)
                update = SeqUpdate(0, [], finish_reason="abort")
                failed.append(EngineCoreOutput(req.request_id, [update], True))
            else:
                self.scheduler.add_request(req)
        self._compiling = still
        return failed

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
        if self._compiling and (failed := self._admit_compiled()):
            return failed
        if len(self._in_flight) < depth and self.scheduler.has_unfinished_requests():
            sched = self.scheduler.schedule()
            if self._constrained:
                self._fill_token_bitmask(sched)
            if sched.is_empty and not sched.has_block_work and not sched.finished_seq_ids:
                self.scheduler.step_seqs.pop(sched.step_id)
            else:
                self._in_flight.append((sched, self.executor.execute_model(sched)))
                submitted = not sched.is_empty
                if submitted and self.max_concurrent_batches > 1:
                    self._mark_busy(sched)
        if not self._in_flight or (submitted and len(self._in_flight) < depth):
            return []
        sched, handle = self._in_flight.popleft()
        if self._busy_of:
            self._unmark_busy(sched.step_id)
        return self._apply(sched, handle.get())

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

    def _fill_token_bitmask(self, sched: SchedulerOutput) -> None:
        live = self._constrained
        for rid in [rid for rid, req in live.items() if req.is_finished]:
            del live[rid]
        if live and sched.sample_rows:
            assert self.structured is not None
            self.structured.fill_bitmask(sched, live.values())

    def _apply(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        scheduler = self.scheduler
        live = scheduler.seqs
        outputs: dict[str, EngineCoreOutput] = {}
        ids, tokens, lp = out.sampled_seq_ids, out.sampled_token_ids, out.logprobs
        max_len = self.max_model_len
        num_appended = 0
        bm = scheduler.block_manager
        # Blocks this step filled, registered before the token loop can finish (and free) their
        # sequence, so that a finished sequence's last full block is cached too. Every token a
        # step fed is known to the host by now (a pending one landed with the step before).
        filled = scheduler.step_seqs.pop(sched.step_id)
        if out.invalid_block_ids or self._discard:  # (kv_transfer only)
            live = self._drop_failed_loads(sched, out, filled, live)
        for seq in filled:
            if seq.status == _RUNNING:
                bm.cache_full_blocks(seq)
        # Prompt logprobs first: the token loop may finish (and free) the sequence this step.
        for seq_id, chunk in out.prompt_logprobs.items():
            seq = live.get(seq_id)
            if seq is not None:
                req = seq.request
                o = outputs.get(req.request_id) or self._new_output(req, outputs)
                o.prompt_logprobs = chunk
        for seq_id, pooled in out.pooled.items():
            seq = live.get(seq_id)
            if seq is not None:
                req = seq.request
                (outputs.get(req.request_id) or self._new_output(req, outputs)).pooled = pooled
        spec = sched.spec_token_ids
        i, n = 0, len(ids)
        # One iteration per sampled sequence. The common one (one token, no grammar) is inlined:
        # this is the hot loop of the step.
        while i < n:
            seq_id = ids[i]
            j = i + 1
            while j < n and ids[j] == seq_id:  # a fan-out: k samples of one sequence
                j += 1
            seq = live.get(seq_id)
            if seq is None:  # finished (or aborted) after this step was scheduled
                i = j
                continue
            seq.num_pending -= 1
            req = seq.request
            rid = req.request_id
            o = outputs.get(rid)
            if o is None:  # _new_output, inlined
                o = outputs[rid] = EngineCoreOutput(rid, [])
                o.first_scheduled_time = req.first_scheduled_time
                first = req.seqs[0]  # (vLLM's count: local and external prefix hits)
                o.num_cached_tokens = first.num_cached_tokens + first.num_external_tokens
            if spec and seq_id in spec:  # speculative: tokens i..j-1 follow one another
                num_appended += self._apply_verified(seq, spec[seq_id], out, i, j, o)
            elif j - i > 1 or req.constraint is not None:
                num_appended += self._apply_samples(seq, out, i, j, o)
            else:
                token = tokens[i]
                # positional: keyword arguments cost half as much again, per sequence and step
                if lp is None:
                    update = SeqUpdate(seq.index, [token])
                else:
                    update = SeqUpdate(
                        seq.index, [token], [lp.logprobs[i]], [lp.ranks[i]], [lp.top[i]]
                    )
                o.seqs.append(update)
                token_ids = seq.token_ids
                token_ids.append(token)
                num_appended += 1
                num_out = len(token_ids) - seq.num_prompt_tokens
                # _finish_on_token's tests, inlined: most tokens end nothing
                if (
                    (
                        num_out >= req.min_tokens
                        and (token in req.stop_token_ids or token in req.eos_token_ids)
                    )
                    or (req.max_tokens is not None and num_out >= req.max_tokens)
                    or len(token_ids) >= max_len
                    or (req.repetition is not None and req.repetition.found(token_ids, num_out))
                ):
                    self._finish_on_token(seq, token, update, o)
            i = j
        self.generation_tokens_total += num_appended
        if out.beam_topk:
            beams: dict[Request, list[Sequence]] = {}
            for seq_id in out.beam_topk:
                seq = live.get(seq_id)
                if seq is not None:
                    seq.num_pending -= 1
                    beams.setdefault(seq.request, []).append(seq)
            for req, seqs in beams.items():
                o = outputs.get(req.request_id) or self._new_output(req, outputs)
                self._beam_step(req, seqs, out, o)
                o.finished = req.is_finished
        for seq in filled:  # and those that accepted drafts or an in-flight step complete
            if seq.status == _RUNNING:
                bm.cache_full_blocks(seq)
        used = bm.num_total_blocks - bm.num_free_blocks
        if used > self.peak_used_blocks:
            self.peak_used_blocks = used
        return list(outputs.values())

    def _drop_failed_loads(
        self,
        sched: SchedulerOutput,
        out: ModelRunnerOutput,
        filled: list[Sequence],
        live: dict[int, Sequence],
    ) -> dict[int, Sequence]:
        """kv_transfer: a sequence that read a block the worker could not load from storage
        ran on stale KV. It goes back to the waiting queue for recompute (before its blocks are
        registered in the prefix cache; its storage lookup then skips the block's key), and its
        results in this step, and in any step scheduled before it was sent back, are dropped.
        Returns `live` without the sequences whose results are dropped."""
        bad = set(out.invalid_block_ids)
        if bad:
            connector = self.scheduler.kv_connector
            if connector is not None:
                connector.load_failed([key for block, key in sched.kv_loads if block in bad])
            for seq in filled:
                if seq.status == _RUNNING and not bad.isdisjoint(seq.block_ids):
                    self._discard.add(seq.seq_id)
                    self.scheduler.recompute(seq.request)
        dropped = set(self._discard)
        landed = [sid for sid in out.sampled_seq_ids if sid in dropped]
        landed += [sid for sid in out.beam_topk if sid in dropped]
        for sid in landed:
            seq = live.get(sid)
            if seq is not None:
                seq.num_pending -= 1
        for sid in dropped:
            seq = live.get(sid)
            if seq is None or seq.num_pending <= 0:  # nothing more of it in flight
                self._discard.discard(sid)
        return {sid: seq for sid, seq in live.items() if sid not in dropped}

    def _apply_samples(
        self, seq: Sequence, out: ModelRunnerOutput, first: int, end: int, o: EngineCoreOutput
    ) -> int:
        """Tokens [first, end) of the flat output, each a sample from the sequence's logits: the
        first stays with `seq`, the others fork from it (n > 1); a grammar advances with each.
        Returns the tokens appended."""
        req, tokens, lp = seq.request, out.sampled_token_ids, out.logprobs
        constraint = req.constraint
        targets = [(seq, first, None)]
        if end - first > 1:
            forks = [self.scheduler.fork_seq(seq, index=k) for k in range(1, end - first)]
            targets += [(c, first + 1 + k, seq.index) for k, c in enumerate(forks)]
            if constraint is not None:
                constraint.fork(seq.seq_id, [c.seq_id for c in forks])
        for s, k, parent in targets:
            token = tokens[k]
            if lp is None:
                update = SeqUpdate(s.index, [token])
            else:
                update = SeqUpdate(s.index, [token], [lp.logprobs[k]], [lp.ranks[k]], [lp.top[k]])
            if parent is not None:
                update.fork_of = parent
            o.seqs.append(update)
            s.token_ids.append(token)
            complete = constraint is not None and constraint.accept(s.seq_id, token)
            self._finish_on_token(s, token, update, o, complete)
        return len(targets)

    def _finish_on_token(
        self,
        seq: Sequence,
        token: int,
        update: SeqUpdate,
        o: EngineCoreOutput,
        complete: bool = False,
    ) -> bool:
        """After `token` was appended: finish the sequence on eos or a stop id (from min_tokens
        on), max_tokens, max_model_len, a `complete` grammar (the grammar allows nothing more,
        or rejected the token) or a loop repetition_detection finds, in that order. True when
        it finished."""
        req = seq.request
        num_out = len(seq.token_ids) - seq.num_prompt_tokens
        if num_out >= req.min_tokens and (
            token in req.stop_token_ids or token in req.eos_token_ids
        ):
            reason = token if token in req.stop_token_ids else None
            update.finish_reason, update.stop_reason = "stop", reason
            self.scheduler.free_seq(seq, _STOPPED, reason)
        elif (req.max_tokens is not None and num_out >= req.max_tokens) or len(
            seq.token_ids
        ) >= self.max_model_len:
            update.finish_reason = "length"
            self.scheduler.free_seq(seq, _LENGTH)
        elif complete:
            update.finish_reason, update.grammar_end = "stop", True
            self.scheduler.free_seq(seq, _STOPPED)
        elif req.repetition is not None and req.repetition.found(seq.token_ids, num_out):
            update.finish_reason, update.stop_reason = "repetition", "repetition_detected"
            self.scheduler.free_seq(seq, _REPETITION, "repetition_detected")
        else:
            return False
        o.finished = req.status >= _STOPPED
        return True

    def _apply_verified(
        self,
        seq: Sequence,
        drafts: list[int],
        out: ModelRunnerOutput,
        first: int,
        end: int,
        o: EngineCoreOutput,
    ) -> int:
        """A speculative row emitted tokens [first, end) of the flat output: its accepted
        drafts, then one token of its own. Append them up to the first that finishes the
        sequence; give back the positions of rejected drafts (their KV is overwritten later,
        and no block holding them was registered in the prefix cache: that happens after this,
        from computed tokens only). Returns the tokens appended."""
        lp, tokens = out.logprobs, out.sampled_token_ids
        self.scheduler.draft_planner.feedback(seq, len(drafts), end - first - 1)
        update = SeqUpdate(seq.index, [])
        if lp is not None:
            update.logprobs, update.ranks, update.top = [], [], []
        o.seqs.append(update)
        appended = 0
        constraint = seq.request.constraint
        for k in range(first, end):
            token = tokens[k]
            seq.token_ids.append(token)
            update.new_token_ids.append(token)
            if lp is not None:
                update.logprobs.append(lp.logprobs[k])
                update.ranks.append(lp.ranks[k])
                update.top.append(lp.top[k])
            appended += 1
            complete = constraint is not None and constraint.accept(seq.seq_id, token)
            if self._finish_on_token(seq, token, update, o, complete):
                return appended
        if seq.status != _RUNNING:  # preempted while the step ran (async): recomputes
            return appended
        # Still running: computed = every token but the last (the next step's input); blocks
        # only past the drafts' positions go back (the worker's table is re-sent from there).
        seq.num_computed_tokens = len(seq.token_ids) - 1
        if appended <= len(drafts) and self.scheduler.state_slots is not None:
            # A draft was rejected: the worker put the recurrent state back to where the row
            # started (it had absorbed every draft); the accepted tokens run again next step.
            seq.replay_end = seq.num_computed_tokens
            seq.num_computed_tokens -= appended
        self.scheduler.block_manager.trim(seq, len(seq.token_ids))
        seq.num_synced_blocks = min(seq.num_synced_blocks, len(seq.block_ids))
        return appended

    @staticmethod
    def _new_output(req: Request, outputs: dict[str, EngineCoreOutput]) -> EngineCoreOutput:
        # Two fields set by name, not position (a field added to the class shifted them once);
        # keyword arguments would cost twice the time of this, per request and step.
        o = outputs[req.request_id] = EngineCoreOutput(req.request_id, [])
        o.first_scheduled_time = req.first_scheduled_time
        first = req.seqs[0]
        o.num_cached_tokens = first.num_cached_tokens + first.num_external_tokens
        return o

    def _beam_step(
        self, req: Request, seqs: list[Sequence], out: ModelRunnerOutput, o: EngineCoreOutput
    ) -> None:
        """Pick the surviving (parent, token) pairs of a beam request; fork parents with several
        children, free those with none. Survivors took a token the worker did not sample, so the
        worker gets them again in full."""
        state = req.beam
        seqs.sort(key=lambda s: req.seqs.index(s))  # the request's order (HF's beam order)
        top = [out.beam_topk[s.seq_id] for s in seqs]
        top_lp = torch.tensor([t[0] for t in top], dtype=torch.float32)
        top_ids = torch.tensor([t[1] for t in top], dtype=torch.long)
        room = self.max_model_len - seqs[0].num_tokens
        scores = [s.cumulative_logprob for s in seqs]
        traces = [s.beam_trace for s in seqs]
        generated = [s.output_token_ids for s in seqs]
        result = state.step(top_lp, top_ids, scores, generated, room, traces)
        if result.done:
            for seq in seqs:
                self.scheduler.free_seq(seq, _STOPPED)
            o.beams = [
                BeamHypothesis(h.token_ids, h.cumulative_logprob, h.finish_reason, h.trace)
                for h in state.finished
            ]
            return
        # Parents without a survivor go first: their blocks (and recurrent-state rows) are
        # free for the forks, so the request never holds more than its beam width.
        used = {cand.parent for cand in result.running}
        for row, seq in enumerate(seqs):
            if row not in used:
                self.scheduler.free_seq(seq, _STOPPED)
        children: list[tuple[Sequence, int, float]] = []
        kept: set[int] = set()
        for cand in result.running:
            parent = seqs[cand.parent]
            if cand.parent in kept:
                child = self.scheduler.fork_seq(parent, index=len(req.seqs))
            else:
                kept.add(cand.parent)
                child = parent
            children.append((child, cand.token_id, cand.cumulative_logprob))
        for (seq, token_id, score), cand in zip(children, result.running):
            seq.token_ids.append(token_id)
            seq.cumulative_logprob = score
            parent = cand.parent  # the candidates it chose from
            seq.beam_trace = (traces[parent], top[parent])
            self.scheduler.resend(seq)
            self.generation_tokens_total += 1
        o.beams = [
            BeamHypothesis(s.output_token_ids, s.cumulative_logprob, None, s.beam_trace)
            for s in req.live_seqs()
        ]
