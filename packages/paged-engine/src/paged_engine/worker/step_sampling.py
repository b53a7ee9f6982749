"""Sampling a step's rows from the forward's hidden states (`ModelRunner._sample`).

Each sampled entry (a sequence's last row; a fan-out's k samples; beams apart) gets its logits,
its `SamplingMetadata` (cached across a decode loop where nothing depends on the position),
its grammar mask and custom logits processors, and the sampler's token, which is written into
`InputBatch.last_token` on the device for the next step. In a step where some rows carry drafts
every entry samples at its last 1 + d positions and the rejection sampler keeps what the
target's distribution allows (`_sample_drafts`; a hybrid model's rejected rows restore their
state). Beam rows get their top candidates, prompt rows their logprobs (`_prompt_logprobs`,
model_runner.py), pooling rows their pooled output; all leave as one `AsyncRunnerOutput`.

`StepSampling` is a mixin of `ModelRunner` (worker/model_runner.py). vLLM v1:
`GPUModelRunner._sample` and its rejection sampling for speculative decoding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from paged_engine.core.sched_output import SchedulerOutput
from paged_engine.sample.logprobs import gather_logprobs, log_softmax_topk
from paged_engine.sample.metadata import PAD, with_token_bitmask
from paged_engine.spec_decode.draft_model import DraftProposal
from paged_engine.spec_decode.rejection_sampler import verify
from paged_engine.worker.input_batch import CachedSeq
from paged_engine.worker.pooler import pool_hidden
from paged_engine.worker.runner_output import AsyncRunnerOutput
from paged_engine.worker.step_inputs import StepInputs

if TYPE_CHECKING:
    from paged_engine.sample.sampler import Sampler
    from paged_engine.spec_decode.draft_model import DraftModelRunner
    from paged_engine.worker.input_batch import InputBatch
    from paged_engine.worker.logits_processors import CustomLogitsProcessors
    from paged_engine.worker.recurrent_state import RecurrentStatePool
    from paged_engine.worker.sampling_inputs import SamplingInputs


class StepSampling:
    """`_sample`, `_sample_drafts`, `_set_last_token` (mixed into `ModelRunner`; they call its
    `compute_logits`, `_to_dev` and `_prompt_logprobs`)."""

    # the ModelRunner's state it uses
    batch: InputBatch
    device: torch.device
    model: torch.nn.Module
    sampler: Sampler
    sampling: SamplingInputs
    logits_procs: CustomLogitsProcessors | None
    draft: DraftModelRunner | None
    states: RecurrentStatePool | None
    count_nans: bool  # PAGED_COMPUTE_NANS_IN_LOGITS: flag the rows whose logits hold a NaN

    def _sample(
        self,
        sched: SchedulerOutput,
        cached: list[CachedSeq],
        inputs: StepInputs,
        hidden: torch.Tensor,
        proposal: DraftProposal | None = None,
    ) -> AsyncRunnerOutput:
        batch = self.batch
        src, sample_no, seq_ids, beam_idx = self.sampling.plan(sched, cached)
        tokens = packed_lp = None
        num_logprobs: list[int | None] = []
        track_history = False
        # each entry's first index in the flat output and its count (drafted rows emit several)
        flat = emitted = None
        nans: list[tuple[list[int], torch.Tensor]] | None = [] if self.count_nans else None
        if src.size and sched.spec_token_ids:
            rows = inputs.rows[src]
            track_history = bool(batch.tracks[rows].any())
            seq_ids, tokens, packed_lp, num_logprobs, flat, emitted = self._sample_drafts(
                sched, cached, inputs, hidden, src, sample_no, seq_ids, proposal, nans
            )
        elif src.size:
            hidden_rows = self._to_dev(inputs.cu[src + 1] - 1)
            logits = self.compute_logits(hidden.index_select(0, hidden_rows))
            if nans is not None:
                nans.append((seq_ids, logits.isnan().any(-1)))
            rows = inputs.rows[src]
            track_history = bool(batch.tracks[rows].any())
            out_pos = inputs.seq_lens[src] - batch.num_prompt[rows]  # outputs before this one
            md = self.sampling.cached_metadata(rows)
            if md is None:
                md = self.sampling.metadata(cached, src, rows, sample_no, out_pos)
            if sched.token_bitmask is not None:  # grammar masks change every step: not cached
                md = with_token_bitmask(md, sched.token_bitmask, seq_ids, self.device)
            if self.logits_procs is not None:
                md = self.logits_procs.bind(md, seq_ids)
            num_logprobs = md.num_logprobs
            result = self.sampler(logits, md)
            tokens, packed_lp = result.token_ids, result.logprobs
            self._set_last_token(rows, tokens, sample_no)
        beam = None
        if beam_idx:
            ks = [cached[i].beam_candidates for i in beam_idx]
            rows_d = self._to_dev(inputs.cu[np.asarray(beam_idx) + 1] - 1)
            beam_logits = self.compute_logits(hidden.index_select(0, rows_d))
            lps, ids = log_softmax_topk(beam_logits, max(ks), self.sampler.logsumexp)
            beam = ([cached[i].seq_id for i in beam_idx], ks, lps, ids)
            if nans is not None:
                nans.append((beam[0], beam_logits.isnan().any(-1)))
        prompt = self._prompt_logprobs(sched, cached, inputs, hidden)
        pooled = (
            pool_hidden(batch, sched, cached, inputs, hidden, getattr(self.model, "classify", None))
            if batch.pooling.any()
            else []
        )
        handle = AsyncRunnerOutput(
            sched.step_id, seq_ids, tokens, packed_lp, num_logprobs, beam, prompt, pooled, nans
        )
        if track_history:
            self.sampling.track_history(handle, cached, src, sample_no, flat, emitted)
        return handle

    def _sample_drafts(
        self, sched, cached, inputs, hidden, src, sample_no, seq_ids, proposal, nans=None
    ):
        """Sampling in a step where some rows carry drafts: each entry samples at its last
        1 + d positions (d its drafts, 0 for rows without) and the rejection sampler keeps what
        the target's distribution allows (q: the draft model's `proposal`, else point masses).
        Penalties judge draft j with drafts 0..j-1 among the outputs, as plain decoding would.
        Returns the flat output (a drafted row's emitted tokens in order), each entry's first
        index in it and its count."""
        batch = self.batch
        spec = sched.spec_token_ids if proposal is None else proposal.tokens
        num_drafts = np.asarray(
            [len(spec.get(s, ())) if not no else 0 for s, no in zip(seq_ids, sample_no.tolist())],
            dtype=np.int64,
        )
        reps = num_drafts + 1
        first_row = np.cumsum(reps) - reps  # each entry's first row in the expanded layout
        step = np.arange(int(reps.sum())) - np.repeat(first_row, reps)  # position within entry
        src_x, sample_no_x = np.repeat(src, reps), np.repeat(sample_no, reps)
        rows_x = inputs.rows[src_x]
        hidden_rows = np.repeat(inputs.cu[src + 1] - 1 - num_drafts, reps) + step
        out_pos = inputs.seq_lens[src] - batch.num_prompt[inputs.rows[src]] - num_drafts
        out_pos_x = np.repeat(out_pos, reps) + step
        seq_ids_x = [s for s, r in zip(seq_ids, reps.tolist()) for _ in range(r)]
        raw = self.compute_logits(hidden.index_select(0, self._to_dev(hidden_rows))).float()
        if nans is not None:  # (an entry's draft rows too)
            nans.append((seq_ids_x, raw.isnan().any(-1)))
        drafts_x = np.full(raw.shape[0], -1, dtype=np.int64)
        for e in np.flatnonzero(num_drafts).tolist():
            drafts_x[first_row[e] : first_row[e] + num_drafts[e]] = spec[seq_ids[e]]
        drafted = None
        if batch.history[rows_x].any():  # row `step` of an entry counts its drafts before it
            width = int(num_drafts.max())
            before = np.arange(width)[None, :] < step[:, None]
            cols = np.minimum(np.repeat(first_row, reps)[:, None] + np.arange(width), len(step) - 1)
            drafted = self._to_dev(np.where(before, drafts_x[cols], PAD))
        md = self.sampling.metadata(cached, src_x, rows_x, sample_no_x, out_pos_x, drafted)
        if sched.token_bitmask is not None:
            md = with_token_bitmask(md, sched.token_bitmask, seq_ids_x, self.device)
        processed = self.sampler.process_logits(raw, md)
        noise = None if md.all_greedy else self.sampler.noise(raw.shape, md, raw.device)
        greedy = None if md.all_greedy else md.greedy
        if greedy is None and not md.all_greedy:
            greedy = torch.zeros(raw.shape[0], dtype=torch.bool, device=raw.device)
        q = None
        if proposal is not None and proposal.probs is not None and noise is not None:
            # q rows in the expanded layout (bonus rows and rows without drafts stay 0).
            q_rows, q_src = [], []
            for e in np.flatnonzero(num_drafts).tolist():
                first, off = int(first_row[e]), proposal.offsets[seq_ids[e]]
                q_rows.extend(range(first, first + int(num_drafts[e])))
                q_src.extend(range(off, off + int(num_drafts[e])))
            q = processed.new_zeros(processed.shape)
            q.index_copy_(0, self._to_dev(q_rows), proposal.probs[self._to_dev(q_src)])
        result = verify(processed, self._to_dev(drafts_x), greedy, noise, num_drafts, q)
        if self.draft is not None:
            first_draft = inputs.seq_lens[src] - num_drafts  # each entry's first draft position
            self.draft.after_verify(seq_ids, num_drafts, result.num_accepted, spec, first_draft)
        if self.states is not None:  # a rejected draft: the state goes back to the row's start
            rejected = np.flatnonzero(result.num_accepted < num_drafts)
            if rejected.size:
                rows = batch.state_slot[inputs.rows[src[rejected]]]
                self.states.restore(rows)
        emitted = result.num_accepted + 1
        flat = np.cumsum(emitted) - emitted
        emit_rows = np.repeat(first_row, emitted) + (
            np.arange(int(emitted.sum())) - np.repeat(flat, emitted)
        )
        emit_d = self._to_dev(emit_rows)
        tokens = result.tokens.index_select(0, emit_d)
        packed = None
        if md.need_logprobs:
            packed = gather_logprobs(
                raw, result.tokens, md.max_num_logprobs, self.sampler.logsumexp, md.logprob_ids
            ).index_select(0, emit_d)
        num_logprobs = [md.num_logprobs[r] for r in emit_rows.tolist()] if md.num_logprobs else []
        last = result.tokens.index_select(0, self._to_dev(first_row + result.num_accepted))
        self._set_last_token(inputs.rows[src], last, sample_no)
        out_ids = [s for s, m in zip(seq_ids, emitted.tolist()) for _ in range(m)]
        return out_ids, tokens, packed, num_logprobs, flat, emitted

    def _set_last_token(self, rows: np.ndarray, tokens: torch.Tensor, sample_no: np.ndarray):
        """Each sampling row's next input token; a fan-out sequence keeps its first sample."""
        first = sample_no == 0
        if first.all():
            self.batch.last_token.index_copy_(0, self._to_dev(rows), tokens)
        else:
            keep = self._to_dev(np.flatnonzero(first))
            self.batch.last_token.index_copy_(0, self._to_dev(rows[first]), tokens[keep])
