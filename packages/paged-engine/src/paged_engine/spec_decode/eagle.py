"""Heads that draft from the target's own features: `Eagle3Runner` (an EAGLE-3 head,
speculative_config={"method": "eagle3", "model": ..., "num_speculative_tokens": k}) and
`FinalHiddenRunner` (the target's multi-token-prediction layer, {"method": "mtp", ...}, or an
EAGLE-1 head, {"method": "eagle", "model": ...}).

A head (models/llama_eagle3.py, models/mtp.py, models/llama_eagle.py) runs at position p on
token p + 1 and a feature of position p: the target's (for EAGLE-3 the residual streams
entering three of its layers, which the target forward keeps in a `StreamCapture`; for MTP and
EAGLE-1 its final hidden state),
or at its own later passes the head's previous output. Its paged KV cache
is a second set of tensors indexed by the target's block tables, like a draft model's
(spec_decode/draft_model.py), so the scheduler and block manager never know it exists.

Per sequence, between steps, the runner keeps what the target computed last and the head has
not run yet: (p0, n, the target's tokens at [p0, p0 + n), their features). A step whose row
starts at c = p0 + n runs, per row:

    pass 1   positions [p0, c): tokens [p0 + 1, c] (the kept ones and the row's first token
             this step), the kept features; a drafting row (one own token at c) samples
             draft 1 from the logits at c - 1
    pass j   rows with >= j drafts run draft j-1 at position c + j - 2 on the head's own
             feature from pass j - 1, and sample draft j

A head whose rope has `mrope_section` turns position p by the target's M-RoPE position of p
(spec_decode/mrope_positions.py), as vLLM does for Qwen-VL targets.

So before a step the head's cache holds teacher-forced entries (target features) at [0, c)
and its own guesses at [c, c + k - 1), which the next step's pass 1 overwrites from c on: the
target accepted a <= d drafts and computed [c, c + 1 + a), which is what is kept. The last
token kept is always the target's own, so pass 1 never runs a feature for an unverified
position.

Rows with nothing kept (new in the worker with computed tokens it did not run: a prefix-cache
hit's first position, the siblings of an n > 1 fan-out, a sequence whose entry was dropped)
leave holes that later steps do not fill: drafts read stale entries there, which costs
acceptance, never correctness. A drafting row with nothing kept proposes its own token again
(a point mass: the verifier accepts it with the target's probability of that token).

EAGLE-3: the target's streams land in one buffer that lives as long as the engine
(`StreamCapture`), so CUDA graphs captured with it keep writing them on replay; the CPU's
torch.compile is off. MTP and EAGLE-1 read the forward's output, graphs or not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from paged_engine.models.llama import StreamCapture
from paged_engine.spec_decode.config import SpeculativeConfig
from paged_engine.spec_decode.draft_model import DraftModelRunner, DraftProposal, store_draft
from paged_engine.spec_decode.mrope_positions import target_rope_positions, uses_mrope

if TYPE_CHECKING:
    from paged_engine.core.sched_output import SchedulerOutput
    from paged_engine.worker.input_batch import CachedSeq
    from paged_engine.worker.model_runner import ModelRunner, StepInputs


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """cat(arange(s, s + n) for s, n in zip(starts, lens)), int64."""
    lens = np.asarray(lens, dtype=np.int64)
    firsts = np.cumsum(lens) - lens
    return np.repeat(np.asarray(starts, dtype=np.int64) - firsts, lens) + np.arange(lens.sum())


def _never_drafts(seq: CachedSeq) -> bool:
    return seq.beam_candidates > 0


class FeatureHeadRunner(DraftModelRunner):
    """The proposals of a head that reads the target's features (see the module docstring);
    a subclass says where a forward's features are (`target_features`)."""

    reads_target_features = True

    def __init__(self, model, hf_config, runner: ModelRunner) -> None:
        super().__init__(model, hf_config, runner)
        # seq id -> (p0, n, first row in _ids / _feat): the target's tokens and features at
        # [p0, p0 + n) that the head has not run
        self._kept: dict[int, tuple[int, int, int]] = {}
        self._ids: Tensor | None = None  # [S] int64
        self._feat: Tensor | None = None  # [S, F]
        self._accepted: dict[int, int] = {}  # this step's accepted drafts per drafting seq
        # a head with M-RoPE in its config (Qwen-VL targets' heads, Qwen3.5's MTP layer) runs
        # at the target's M-RoPE positions, as vLLM's EAGLE proposer feeds it
        self.mrope = uses_mrope(model)

    def target_features(self, num_tokens: int, hidden: Tensor) -> Tensor:
        """[num_tokens, F] of the forward that returned `hidden` (valid until the next one)."""
        raise NotImplementedError

    # ---- after the target's forward ------------------------------------------------------------
    def after_verify(self, seq_ids, num_drafts, num_accepted, drafts, positions) -> None:
        self._accepted = {
            s: a for s, d, a in zip(seq_ids, num_drafts.tolist(), num_accepted.tolist()) if d
        }

    def after_step(self, sched: SchedulerOutput, inputs: StepInputs, hidden: Tensor) -> None:
        """Keep each row's verified positions of this step (and, for sequences not in it,
        what they had); called after the step's sampling, before the next forward."""
        accepted, self._accepted = self._accepted, {}
        feat = self.target_features(int(inputs.input_ids.shape[0]), hidden)
        r = self.runner
        spec = sched.spec_token_ids
        seq_ids = sched.seq_ids
        num_drafts = np.asarray([len(spec.get(q, ())) for q in seq_ids], dtype=np.int64)
        n = np.asarray(sched.num_new_tokens, dtype=np.int64) - num_drafts
        n += np.asarray([accepted.get(q, 0) for q in seq_ids], dtype=np.int64)
        live = r.batch.seqs
        # Rows that never draft keep nothing (the head would run over them for nothing): beam
        # search (spec_decode/planner.py).
        never = np.asarray([_never_drafts(live[q]) for q in seq_ids], dtype=bool)
        n[never] = 0
        offsets = np.cumsum(n) - n
        src = _ranges(inputs.cu[:-1], n)
        in_step = set(seq_ids)
        kept = {
            q: (start, m, off)
            for q, start, m, off in zip(
                seq_ids, sched.start_positions, n.tolist(), offsets.tolist()
            )
            if m
        }
        carried = [(q, e) for q, e in self._kept.items() if q not in in_step and q in live]
        ids = inputs.input_ids.index_select(0, r._to_dev(src))
        feat = feat.index_select(0, r._to_dev(src))
        if carried:  # sequences not in this step keep what they had
            assert self._ids is not None and self._feat is not None
            old_off = np.asarray([e[2] for _, e in carried], dtype=np.int64)
            old_n = np.asarray([e[1] for _, e in carried], dtype=np.int64)
            at = int(src.size) + np.cumsum(old_n) - old_n
            for (q, (p0, m, _)), off in zip(carried, at.tolist()):
                kept[q] = (p0, m, off)
            old = r._to_dev(_ranges(old_off, old_n))
            ids = torch.cat([ids, self._ids.index_select(0, old)])
            feat = torch.cat([feat, self._feat.index_select(0, old)])
        self._kept, self._ids, self._feat = kept, ids, feat

    # ---- one step -------------------------------------------------------------------------------
    def propose(
        self, sched: SchedulerOutput, cached: list[CachedSeq], inputs: StepInputs
    ) -> DraftProposal:
        r = self.runner
        spec = sched.spec_token_ids
        num_new = np.asarray(sched.num_new_tokens, dtype=np.int64)
        num_drafts = np.asarray([len(spec.get(s, ())) for s in sched.seq_ids], dtype=np.int64)
        starts = np.asarray(sched.start_positions, dtype=np.int64)
        base = num_new - num_drafts

        # Pass 1 over each row's kept positions that end where its step starts: tokens
        # [p0 + 1, c) from the kept ids, token c from this step's, from cat(kept, this step's).
        kept_ids = self._ids
        entries = [self._kept.get(q) for q in sched.seq_ids]
        rows1 = np.asarray(
            [i for i, e in enumerate(entries) if e is not None and e[0] + e[1] == starts[i]],
            dtype=np.int64,
        )
        last_of: dict[int, int] = {}  # batch row -> its last pass-1 output row
        hidden = normed = None
        if rows1.size:
            assert kept_ids is not None and self._feat is not None
            p0, q_lens, off = np.asarray([entries[i] for i in rows1.tolist()], dtype=np.int64).T
            lasts = np.cumsum(q_lens) - 1
            id_src = _ranges(off + 1, q_lens)
            id_src[lasts] = int(kept_ids.shape[0]) + inputs.cu[rows1]
            source = torch.cat([kept_ids, inputs.input_ids])
            ids = source.index_select(0, r._to_dev(id_src))
            feature = self.model.combine(
                self._feat.index_select(0, r._to_dev(_ranges(off, q_lens)))
            )
            normed, hidden = self._forward_head(
                ids, feature, sched, inputs, rows1, q_lens, p0 + q_lens
            )
            last_of = dict(zip(rows1.tolist(), lasts.tolist()))
        drafting = np.flatnonzero(num_drafts)
        if drafting.size == 0:
            return DraftProposal({}, None, {})
        nd = num_drafts[drafting]
        k = int(nd.max())
        own = inputs.input_ids.index_select(0, r._to_dev(inputs.cu[drafting]))
        tokens = own.unsqueeze(1).repeat(1, k)  # rows without a pass 1 repeat their own token
        heads = np.asarray([i in last_of and base[i] == 1 for i in drafting.tolist()], dtype=bool)
        live = np.flatnonzero(heads)  # drafting rows (indices into `drafting`) the head serves
        c = starts[drafting]  # each drafting row's own token position
        probs: Tensor | None = None
        if live.size:
            assert normed is not None and hidden is not None
            last = r._to_dev([last_of[int(i)] for i in drafting[live]])
            normed, feature = normed.index_select(0, last), hidden.index_select(0, last)
            for j in range(1, k + 1):
                if j > 1:  # run draft j - 1 of the rows that want draft j
                    keep = nd[live] >= j
                    if not keep.any():
                        break
                    sub = r._to_dev(np.flatnonzero(keep))
                    live = live[keep]
                    prev = tokens[:, j - 2].index_select(0, r._to_dev(live))
                    normed, feature = self._forward_head(
                        prev,
                        feature.index_select(0, sub),
                        sched,
                        inputs,
                        drafting[live],
                        np.ones(live.size, dtype=np.int64),
                        c[live] + j - 1,
                    )
                logits = self.model.compute_logits(normed)
                live_d = r._to_dev(live)
                prior = tokens[:, : j - 1].index_select(0, live_d)
                tok, q = self._sample(logits, cached, drafting[live], inputs, c[live] + j, prior)
                probs = store_draft(tokens, probs, j, live_d, tok, q)
        fallback = np.flatnonzero(~heads)
        if fallback.size and probs is not None:
            # point masses on the repeated own token (without q the verifier assumes them)
            fb = r._to_dev(fallback)
            steps = torch.arange(k, device=r.device)
            probs[fb.unsqueeze(1), steps.unsqueeze(0), tokens[fb]] = 1.0
        return self._finish(sched, inputs, drafting, nd, base, tokens, probs)

    # ---- helpers --------------------------------------------------------------------------------
    def _forward_head(
        self,
        ids: Tensor,
        feature: Tensor,
        sched: SchedulerOutput,
        inputs: StepInputs,
        idx: np.ndarray,
        q_lens: np.ndarray,
        ends: np.ndarray,
    ) -> tuple[Tensor, Tensor]:
        """The head over `q_lens[i]` tokens of the step's sequence idx[i] ending at position
        ends[i] - 1: (normed, pre-norm) [T, D]. An M-RoPE head turns them by the target's own
        rope positions (mrope_positions.py) where a sequence has an M-RoPE table; only then is
        a per-sequence list of ids made (this runs every pass of every step)."""
        meta, positions = self._metadata(inputs.rows[idx], q_lens, ends)
        if self.mrope and self.runner.rope_tables:
            seq_ids = [sched.seq_ids[i] for i in idx.tolist()]
            positions = target_rope_positions(self.runner, seq_ids, q_lens, ends, positions)
        assert self.cache is not None
        return self.model(ids, positions, self.cache.kv_caches, meta, feature)


class Eagle3Runner(FeatureHeadRunner):
    """An EAGLE-3 head over the streams entering the target's layers `layer_ids`."""

    def __init__(self, model, hf_config, runner: ModelRunner, layer_ids: tuple[int, ...]) -> None:
        super().__init__(model, hf_config, runner)
        inner = getattr(runner.model, "model", None)
        if not hasattr(type(inner), "stream_capture"):  # a stack run by run_layers that keeps it
            arch = ", ".join(getattr(runner.hf_config, "architectures", None) or ["?"])
            raise ValueError(
                f"speculative_config.method 'eagle3' needs a target built on the Llama decoder "
                f"stack (Llama, Qwen2/3, Mistral, Mixtral, gpt-oss, Llama 4 and kin) or "
                f"DeepSeek's; {arch} is not"
            )
        self.layer_ids = layer_ids
        # Every target forward (eager or a CUDA graph's replay) leaves its streams here.
        cfg = runner.config
        assert cfg.speculative_config is not None
        k = SpeculativeConfig.from_dict(cfg.speculative_config).num_speculative_tokens
        rows = max(
            int(cfg.max_num_batched_tokens or 0),
            int(cfg.max_model_len or 0),
            cfg.max_num_seqs * (k + 1),
        )
        self.capture = StreamCapture(layer_ids, rows)
        inner.stream_capture = self.capture

    def target_features(self, num_tokens: int, hidden: Tensor) -> Tensor:
        return self.capture.features(num_tokens)


class FinalHiddenRunner(FeatureHeadRunner):
    """A head over the target's final hidden states (the forward's output): the target's own
    MTP layer, or an EAGLE-1 head."""

    def target_features(self, num_tokens: int, hidden: Tensor) -> Tensor:
        return hidden[:num_tokens]
