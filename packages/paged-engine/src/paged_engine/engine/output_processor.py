"""Turns one step's logits into tokens, updates sequences and builds `RequestOutput`s.

Per sampled request (all its live sequences reached the end of their tokens this step):
- sampling: one sampler row per live sequence; on the first token of an n > 1 request the single
  prompt sequence gets `best_of` rows from the same logits and is forked (blocks shared, CoW
  later) into one sequence per sample;
- beam search: `BeamSearchState.step` picks the surviving (parent, token) pairs; parents with
  several children are forked, parents with none are freed;
then every new token goes through logprobs, detokenization and the stop checks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from paged_engine.sample.beam_search import BeamSearchState
from paged_engine.engine.detokenizer import IncrementalDetokenizer, find_stop, stop_holdback
from paged_engine.worker.model_runner import ModelOutput
from paged_engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from paged_engine.core.request import Request, Sequence, SequenceStatus
from paged_engine.sample.sampler import Sampler, SamplingRow, compute_prompt_logprobs, log_softmax_topk
from paged_engine.sampling_params import SamplingParams
from paged_engine.core.scheduler import Scheduler


@dataclass(slots=True)
class RequestState:
    """Output-side state the engine keeps per request (Request.state)."""

    generator: torch.Generator | None
    beam: BeamSearchState | None
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    num_samples: int  # sequences to generate (best_of for sampling, beam_width for beams)
    num_returned: int  # outputs returned (n)
    last_token_time: float | None = None
    final_only: bool = False  # build a RequestOutput only when the request finishes
    needs_history: bool = False  # penalties / min_tokens read the sampled tokens so far


_NO_TOKENS: list[int] = []


class OutputProcessor:
    def __init__(
        self,
        tokenizer,
        scheduler: Scheduler,
        *,
        max_model_len: int,
        eos_token_ids: set[int],
        device: torch.device,
    ) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.sampler = Sampler()
        self.generation_tokens_total = 0

    # ---- per step -------------------------------------------------------------------------------
    def process(self, model_out: ModelOutput) -> list[RequestOutput]:
        now = time.monotonic()
        touched: dict[str, Request] = {}
        for seq, logits, start in model_out.prompt_logits:
            self._add_prompt_logprobs(seq, logits, start)
        by_request: dict[str, list[int]] = {}
        for row, seq in enumerate(model_out.sample_seqs):
            by_request.setdefault(seq.request.request_id, []).append(row)
        rows: list[SamplingRow] = []
        row_index: list[int] = []  # logits row of each sampler row
        # (request, its sampled sequences, fan out: the first token of n > 1 from one row)
        sampling_targets: list[tuple[Request, list[Sequence], bool]] = []
        for rows_of_req in by_request.values():
            req = model_out.sample_seqs[rows_of_req[0]].request
            touched[req.request_id] = req
            state: RequestState = req.state
            if state.beam is not None:
                assert model_out.logits is not None
                self._beam_step(
                    req,
                    [model_out.sample_seqs[r] for r in rows_of_req],
                    model_out.logits[rows_of_req],
                )
                continue
            seqs = (
                [model_out.sample_seqs[rows_of_req[0]]]
                if len(rows_of_req) == 1
                else [model_out.sample_seqs[r] for r in rows_of_req]
            )
            fan_out = len(seqs) == 1 and seqs[0].num_output_tokens == 0 and state.num_samples > 1
            if fan_out:
                rows.extend(self._row(req, seqs[0]) for _ in range(state.num_samples))
                row_index.extend([rows_of_req[0]] * state.num_samples)
            else:
                rows.extend(self._row(req, s) for s in seqs)
                row_index.extend(rows_of_req)
            sampling_targets.append((req, seqs, fan_out))
        if rows:
            assert model_out.logits is not None
            logits = model_out.logits
            if len(row_index) != logits.shape[0] or row_index != list(range(len(row_index))):
                # fan-out (n > 1 first tokens) or beam rows removed: gather the sampler's rows
                idx = torch.tensor(row_index, dtype=torch.long, device=logits.device)
                logits = logits.index_select(0, idx)
            result = self.sampler(logits, rows)
            k = 0
            for req, seqs, fan_out in sampling_targets:
                if fan_out:
                    parent = seqs[0]
                    seqs = [parent] + [
                        self.scheduler.fork_seq(parent, index=i)
                        for i in range(1, req.state.num_samples)
                    ]
                for seq in seqs:
                    top = result.top_logprobs[k] if result.top_logprobs is not None else None
                    self._append(
                        seq,
                        result.sampled_token_ids[k],
                        result.sampled_logprobs[k],
                        result.sampled_ranks[k],
                        top,
                    )
                    k += 1
        outputs = []
        for req in touched.values():
            if req.first_token_time is None:
                req.first_token_time = now
            req.state.last_token_time = now
            # A request finished with its last live sequence (Scheduler.free_seq).
            if req.is_finished or not req.state.final_only:
                outputs.append(self.make_output(req))
        return outputs

    def _row(self, req: Request, seq: Sequence) -> SamplingRow:
        state: RequestState = req.state
        # Copying the output tokens is O(length): only for rows whose processing reads them.
        history = seq.output_token_ids if state.needs_history else _NO_TOKENS
        return SamplingRow(
            params=req.params,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=history,
            generator=state.generator,
            # Masked while below min_tokens; with ignore_eos, EOS is an ordinary token (vLLM).
            eos_token_id=None if req.params.ignore_eos else self.eos_token_ids,
        )

    # ---- tokens ---------------------------------------------------------------------------------
    def _append(
        self,
        seq: Sequence,
        token_id: int,
        logprob: float,
        rank: int | None,
        top: list[tuple[int, float]] | None,
    ) -> None:
        params: SamplingParams = seq.request.params
        seq.token_ids.append(token_id)
        seq.cumulative_logprob += logprob
        self.generation_tokens_total += 1
        if params.logprobs is not None:
            entry = {token_id: Logprob(logprob, rank, self._decode_one(token_id))}
            for tid, lp in (top or [])[: params.logprobs]:
                if tid not in entry:
                    entry[tid] = Logprob(lp, None, self._decode_one(tid))
            for r, (tid, _) in enumerate((top or [])[: params.logprobs], start=1):
                entry[tid].rank = r
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(entry)
        num_out = seq.num_output_tokens
        reached_min = num_out >= params.min_tokens
        stop_token = reached_min and (
            token_id in params.stop_token_ids
            or (not params.ignore_eos and token_id in self.eos_token_ids)
        )
        detok: IncrementalDetokenizer | None = seq.detokenizer
        if detok is not None and (not stop_token or params.include_stop_str_in_output):
            delta = detok.add_tokens([token_id])
            seq.output_text = detok.output_text
            if reached_min and params.stop and delta:
                hit = find_stop(
                    seq.output_text, len(delta), params.stop, params.include_stop_str_in_output
                )
                if hit is not None:
                    cut, stop_str = hit
                    seq.output_text = seq.output_text[:cut]
                    return self._finish_seq(seq, "stop", stop_str)
        if stop_token:
            reason = token_id if token_id in params.stop_token_ids else None
            return self._finish_seq(seq, "stop", reason)
        if params.max_tokens is not None and num_out >= params.max_tokens:
            return self._finish_seq(seq, "length", None)
        if seq.num_tokens >= self.max_model_len:
            return self._finish_seq(seq, "length", None)
        return None

    def _decode_one(self, token_id: int) -> str:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return backend.decode([token_id], skip_special_tokens=False)
        return self.tokenizer.decode([token_id])

    def _finish_seq(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        detok: IncrementalDetokenizer | None = seq.detokenizer
        if detok is not None and not isinstance(stop_reason, str):
            detok.finalize()  # flush an unfinished character held back for streaming
            seq.output_text = detok.output_text
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        status = (
            SequenceStatus.FINISHED_STOPPED if reason == "stop" else SequenceStatus.FINISHED_LENGTH
        )
        self.scheduler.free_seq(seq, status)

    # ---- beams ----------------------------------------------------------------------------------
    def _beam_step(self, req: Request, seqs: list[Sequence], logits: torch.Tensor) -> None:
        state: BeamSearchState = req.state.beam
        top_lp, top_ids = log_softmax_topk(logits, min(state.num_candidates, logits.shape[-1]))
        room = self.max_model_len - seqs[0].num_tokens
        scores = [s.cumulative_logprob for s in seqs]
        result = state.step(top_lp, top_ids, scores, [s.output_token_ids for s in seqs], room)
        if result.done:
            for seq in seqs:
                self.scheduler.free_seq(seq, SequenceStatus.FINISHED_STOPPED)
            return
        children: list[tuple[Sequence, int, float]] = []
        used: set[int] = set()
        for cand in result.running:
            parent = seqs[cand.parent]
            if cand.parent in used:
                child = self.scheduler.fork_seq(parent, index=len(req.seqs))
            else:
                used.add(cand.parent)
                child = parent
            children.append((child, cand.token_id, cand.cumulative_logprob))
        for row, seq in enumerate(seqs):
            if row not in used:
                self.scheduler.free_seq(seq, SequenceStatus.FINISHED_STOPPED)
        for seq, token_id, score in children:
            seq.token_ids.append(token_id)
            seq.cumulative_logprob = score
            self.generation_tokens_total += 1

    # ---- prompt logprobs ------------------------------------------------------------------------
    def _add_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor, start: int) -> None:
        req = seq.request
        state: RequestState = req.state
        k = req.params.prompt_logprobs
        if state.prompt_logprobs is None:
            state.prompt_logprobs = [None]  # position 0 has no predecessor
        # logits row j (position start + j) predicts prompt token start + j + 1. After a
        # preemption the prompt is recomputed: positions already covered are not added twice.
        start_row = max(start, len(state.prompt_logprobs) - 1)
        last = min(start + logits.shape[0], seq.num_prompt_tokens - 1)
        if last <= start_row:
            return
        logits = logits[start_row - start :]
        start = start_row
        targets = torch.tensor(seq.token_ids[start + 1 : last + 1], dtype=torch.long)
        entries = compute_prompt_logprobs(logits[: last - start], targets, k)
        for entry in entries:
            for tid, lp in entry.items():
                lp.decoded_token = self._decode_one(tid)
        state.prompt_logprobs.extend(entries)

    # ---- outputs --------------------------------------------------------------------------------
    def make_output(self, req: Request) -> RequestOutput:
        state: RequestState = req.state
        finished = req.is_finished
        if state.beam is not None:
            completions = self._beam_outputs(req, finished)
        else:
            seqs = sorted(req.seqs, key=lambda s: s.index)
            if finished and state.num_samples > state.num_returned:
                seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)
                seqs = seqs[: state.num_returned]
            stops = req.params.stop
            completions = [
                CompletionOutput(
                    index=i if finished and state.num_samples > state.num_returned else s.index,
                    text=_visible_text(s, stops),
                    token_ids=list(s.output_token_ids),
                    cumulative_logprob=s.cumulative_logprob
                    if req.params.logprobs is not None
                    else None,
                    # A snapshot, like token_ids: a streamed output must not grow afterwards.
                    logprobs=None if s.logprobs is None else s.logprobs.copy(),
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
                for i, s in enumerate(seqs)
            ]
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            last_token_time=state.last_token_time,
            finished_time=req.finished_time,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs,
            outputs=completions,
            finished=finished,
            metrics=metrics,
            num_cached_tokens=req.seqs[0].num_cached_tokens if req.seqs else 0,
        )

    def _beam_outputs(self, req: Request, finished: bool) -> list[CompletionOutput]:
        state: RequestState = req.state
        if finished:
            hyps = state.beam.best(state.num_returned)
            items = [(h.token_ids, h.cumulative_logprob, h.finish_reason) for h in hyps]
        else:
            items = [(s.output_token_ids, s.cumulative_logprob, None) for s in req.live_seqs()]
        return [
            CompletionOutput(
                index=i,
                text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                token_ids=list(tokens),
                cumulative_logprob=cum,
                logprobs=None,
                finish_reason=reason,
                stop_reason=None,
            )
            for i, (tokens, cum, reason) in enumerate(items)
        ]


def _visible_text(seq: Sequence, stops: list[str] | None) -> str:
    """Text safe to show now: while running, a tail that may still grow into a stop string is
    held back, so a streaming client never receives text that is later cut."""
    if not stops or seq.is_finished:
        return seq.output_text
    hold = stop_holdback(seq.output_text, stops)
    return seq.output_text[: len(seq.output_text) - hold] if hold else seq.output_text
