"""`EngineCore._apply`: one step's results change the requests (vLLM v1's
`Scheduler.update_from_output`).

The only place that changes requests after a step ran, in this order: blocks the step filled
are registered in the prefix cache (before a sequence can finish and free them), prompt
logprobs and pooled outputs are handed out, then one pass over the sampled sequences appends
their tokens and checks eos / stop token ids / max_tokens / max_model_len / a grammar's end /
repetition, in that order. The common row (one token, no grammar, no drafts) is inlined in that
loop, the hot loop of the step; a fan-out (n > 1) forks (`_apply_samples`), a speculative row
keeps its accepted drafts and gives back the rest (`_apply_verified`), and beam requests pick
their survivors after it (`_beam_step`). What it learned leaves as `EngineCoreOutput`s.

`StepApplier` is a mixin of `EngineCore` (core/engine_core.py), which owns the state it reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from paged_engine.core.core_output import BeamHypothesis, EngineCoreOutput, SeqUpdate
from paged_engine.core.request import Request, Sequence, SequenceStatus
from paged_engine.core.sched_output import SchedulerOutput
from paged_engine.worker.runner_output import ModelRunnerOutput

if TYPE_CHECKING:
    from paged_engine.core.scheduler import Scheduler

_RUNNING = SequenceStatus.RUNNING
_STOPPED = SequenceStatus.FINISHED_STOPPED
_LENGTH = SequenceStatus.FINISHED_LENGTH
_REPETITION = SequenceStatus.FINISHED_REPETITION


class StepApplier:
    """Applies a step's `ModelRunnerOutput` to the requests (mixed into `EngineCore`)."""

    # the EngineCore's state it uses
    scheduler: Scheduler
    max_model_len: int
    generation_tokens_total: int
    peak_used_blocks: int
    corrupted_requests: int  # requests a step's logits held a NaN for (counted once each)
    _discard: set[int]  # kv_transfer: sequences sent back to recompute (_drop_failed_loads)

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
        for seq_id in out.nan_seq_ids:  # (PAGED_COMPUTE_NANS_IN_LOGITS)
            seq = live.get(seq_id)
            if seq is not None and not seq.request.corrupted:
                seq.request.corrupted = True
                self.corrupted_requests += 1
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
                o.num_cached_tokens = req.num_cached_tokens
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
        o.num_cached_tokens = req.num_cached_tokens
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
