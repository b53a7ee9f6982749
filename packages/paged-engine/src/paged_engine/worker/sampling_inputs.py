"""What the sampler needs each step, read from the persistent batch (`InputBatch`).

- `plan`: one entry per token sampled this step (its batch index, sample number, sequence) and
  the beam rows.
- `metadata`: the entries' `SamplingMetadata`; a decode loop over an unchanged batch reuses the
  last one (`cached_metadata`) unless a setting depends on the position.
- Penalty rows read every output token: their histories are sliced from the batch's token
  mirror (`InputBatch.tokens_np`); a token sampled last step that the host has not seen yet is
  read from `InputBatch.last_token` on the device. `track_history` records which entries of a
  step's output are such tokens and `apply_history` appends them once they have landed.
- Speculative rows judge draft j with drafts 0..j-1 counted as outputs (`drafted`): the
  penalties then see the history plain decoding would have at that position. A verified step
  emits several tokens a row; the next step waits for them (it waited for the acceptance
  counts already), so a history is never more than one token behind.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from paged_engine.core.sched_output import SchedulerOutput
from paged_engine.sample.metadata import (
    PAD,
    SamplingMetadata,
    banned_tokens,
    build_sampling_metadata,
    draw_seed,
)
from paged_engine.worker.input_batch import CachedSeq, InputBatch
from paged_engine.worker.runner_output import AsyncRunnerOutput


class SamplingInputs:
    def __init__(
        self,
        batch: InputBatch,
        device: torch.device,
        vocab_size: int,
        to_dev: Callable[[np.ndarray | list], torch.Tensor],
    ) -> None:
        self.batch = batch
        self.device = device
        self.vocab_size = vocab_size
        self._to_dev = to_dev  # int64 host values on the device (pinned, non-blocking on CUDA)
        # Steps whose sampled ids the host-side histories (penalty rows) still need: (output,
        # [(seq id, first index, count)], whether the next step waits for them).
        self._history: deque[tuple[AsyncRunnerOutput, list[tuple[int, int, int]], bool]] = deque()
        self._md_cache: tuple[tuple[int, np.ndarray | None], SamplingMetadata | None] = (
            (-1, None),
            None,
        )

    def plan(self, sched: SchedulerOutput, cached: list[CachedSeq]):
        """(src, sample_no, seq_ids, beam_idx): one entry per token sampled this step, the batch
        index it comes from, its sample number and its sequence; and the beam rows."""
        batch = self.batch
        sample_idx = np.asarray(sched.sample_rows, dtype=np.int64)
        # One entry per sampled token: the batch index it comes from and its sample number.
        if sched.num_samples or (batch.num_beam_rows and sample_idx.size):
            entries = [
                (i, j)
                for i in sched.sample_rows
                if not cached[i].beam_candidates
                for j in range(sched.num_samples.get(cached[i].seq_id, 1))
            ]
            beam_idx = [i for i in sched.sample_rows if cached[i].beam_candidates]
        else:
            entries, beam_idx = None, []
        if entries is None:
            src = sample_idx
            sample_no = np.zeros(src.size, dtype=np.int64)
        else:
            src = np.asarray([i for i, _ in entries], dtype=np.int64)
            sample_no = np.asarray([j for _, j in entries], dtype=np.int64)
        if entries is None and src.size == len(cached):  # every row samples once
            seq_ids = sched.seq_ids
        else:
            seq_ids = [cached[i].seq_id for i in src.tolist()]
        return src, sample_no, seq_ids, beam_idx

    def cached_metadata(self, rows: np.ndarray) -> SamplingMetadata | None:
        """The last step's metadata when it samples the same rows of an unchanged batch and no
        setting depends on the position (seeds, min_tokens, penalties): a decode loop builds it
        once."""
        key, md = self._md_cache
        if md is not None and key[0] == self.batch.version and np.array_equal(key[1], rows):
            return md
        return None

    def metadata(
        self, cached, src, rows, sample_no, out_pos, drafted: torch.Tensor | None = None
    ) -> SamplingMetadata:
        """`drafted`: [len(src), E] int64 on the device, tokens each sampled row counts as
        outputs after its history (drafts before the position it judges), PAD-padded."""
        batch = self.batch
        seeds: list[tuple[int, int]] = []
        for k in np.flatnonzero(batch.seeded[rows]).tolist():
            c = cached[src[k]]
            index = int(sample_no[k]) or c.index  # a fan-out's sample j becomes index j
            seeds.append((k, draw_seed(c.seed, index, int(out_pos[k]))))
        banned: list[set[int]] = [set()] * src.size
        for k in np.flatnonzero(batch.min_tokens[rows] > out_pos).tolist():
            c = cached[src[k]]
            banned[k] = banned_tokens(c.params, int(out_pos[k]), c.eos_token_ids)
        history: list[tuple[list[int], list[int]] | None] = [None] * src.size
        prompt_history = output_history = None
        hist_rows = np.flatnonzero(batch.history[rows])
        if hist_rows.size:
            prompt_history, output_history = self._histories(cached, src, rows, hist_rows)
            if drafted is not None and drafted.shape[1]:  # PAD may sit anywhere in a row
                picked = drafted.index_select(0, self._to_dev(hist_rows))
                output_history = torch.cat([output_history, picked], dim=1)
        wants_lp = batch.logprobs[rows]
        rules = batch.token_rules[rows]  # allowed_token_ids / logit_bias rows
        md = build_sampling_metadata(
            device=self.device,
            vocab_size=self.vocab_size,
            temperature=batch.temperature[rows],
            top_k=batch.top_k[rows],
            top_p=batch.top_p[rows],
            min_p=batch.min_p[rows],
            repetition=batch.repetition[rows],
            frequency=batch.frequency[rows],
            presence=batch.presence[rows],
            history=history,
            banned=banned,
            seeds=seeds,
            num_logprobs=[cached[i].num_logprobs for i in src.tolist()] if wants_lp.any() else [],
            need_logprobs=bool(wants_lp.any()),
            output_history=output_history,
            prompt_history=prompt_history,
            token_rules=[(k, cached[src[k]].params) for k in np.flatnonzero(rules)],
            logprob_ids=_explicit(cached, src, wants_lp),
        )
        reusable = not (seeds or hist_rows.size or (batch.min_tokens[rows] > 0).any())
        self._md_cache = ((batch.version, rows.copy()), md if reusable else None)
        return md

    def _histories(self, cached, src, rows, hist_rows) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded (prompt ids, output ids) of the penalty rows, sliced from the batch's token
        mirror; an output the host has not seen yet is read from `last_token` on the device."""
        batch = self.batch
        toks = batch.tokens_np
        assert toks is not None, "penalty rows mirror their tokens"
        brows = rows[hist_rows]  # batch rows, in the order of the sampled rows
        n_prompt = batch.num_prompt[brows]
        known = batch.num_host_tokens[brows]  # len(token_ids) of each row
        total = np.fromiter((cached[src[k]].num_tokens for k in hist_rows), np.int64)
        missing = total - known
        assert ((missing == 0) | (missing == 1)).all(), "a penalty row is tokens behind"
        width_p = max(int(n_prompt.max()), 1)
        prompt = toks[brows, :width_p].astype(np.int64)
        prompt[np.arange(width_p) >= n_prompt[:, None]] = PAD
        out_len = total - n_prompt
        width_o = max(int(out_len.max()), 1)
        lo, hi = int(n_prompt.min()), int((n_prompt + width_o).max())
        window = toks[brows, lo : min(hi, toks.shape[1])]
        cols = np.minimum(n_prompt[:, None] - lo + np.arange(width_o), window.shape[1] - 1)
        outputs = np.take_along_axis(window, cols, axis=1).astype(np.int64)
        outputs[np.arange(width_o) >= out_len[:, None]] = PAD
        out = self._to_dev(outputs)
        pending = np.flatnonzero(missing)
        if pending.size:  # (history row, column, batch row) of tokens still on the device
            where = np.stack([pending, out_len[pending] - 1, brows[pending]])
            idx = self._to_dev(where)
            out[idx[0], idx[1]] = self.batch.last_token[idx[2]]
        return self._to_dev(prompt), out

    def track_history(self, handle, cached, src, sample_no, flat=None, emitted=None) -> None:
        """Penalty rows keep every output token on the host: apply this step's ids once they
        have landed (`apply_history`), and count them now. `flat`, `emitted`: each entry's
        first index in the step's output and how many tokens it emitted (speculative steps;
        else one each, at its own index)."""
        entries = []
        for k, i in enumerate(src.tolist()):
            c = cached[i]
            if c.needs_history and sample_no[k] == 0:
                m = 1 if emitted is None else int(emitted[k])
                c.num_tokens += m
                entries.append((c.seq_id, k if flat is None else int(flat[k]), m))
        if entries:
            wait = emitted is not None  # the next step reads them whole (see the docstring)
            self._history.append((handle, entries, wait))

    def apply_history(self, wait: bool = False) -> None:
        """Append landed sampled ids to their rows' host tokens (and output ids). Only the
        newest step may still be in flight, and only when it emitted one token a row (read
        from the device meanwhile); a speculative step's are waited for, and with `wait` every
        step's (custom logits processors read them all)."""
        batch = self.batch
        pending = self._history
        while pending and (wait or len(pending) > 1 or pending[0][2] or pending[0][0].ready()):
            handle, entries, _ = pending.popleft()
            ids = handle.token_ids()
            for seq_id, k, m in entries:
                c = batch.seqs.get(seq_id)
                if c is None:
                    continue
                new = ids[k : k + m][: c.num_tokens - len(c.token_ids)]
                if new:
                    start = len(c.token_ids)
                    c.token_ids.extend(new)
                    batch.num_host_tokens[c.row] = len(c.token_ids)
                    if batch.history[c.row]:
                        batch.mirror_tokens(c.row, new, start)
                    if c.output_ids is not None:
                        c.output_ids.extend(new)


def _explicit(
    cached: list[CachedSeq], src: np.ndarray, wants_lp: np.ndarray
) -> list[tuple[int, list[int]]]:
    """(sampled row, its logprob_token_ids) of the logprob rows that report explicit ids."""
    return [
        (k, ids)
        for k in np.flatnonzero(wants_lp).tolist()
        if (ids := cached[src[k]].params.logprob_token_ids)
    ]
