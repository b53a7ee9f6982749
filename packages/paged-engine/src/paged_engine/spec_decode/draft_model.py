"""`DraftModelRunner`: a small draft model that proposes a step's drafts on the worker
(speculative_config={"model": ..., "num_speculative_tokens": k}).

The draft keeps its own paged KV cache: a second set of per-layer K/V tensors with the same number
of blocks and block size as the target's, indexed by the same block tables. The scheduler and
block manager never know it exists: every block a sequence holds holds both models' KV for the
same positions, and copy-on-write, swaps and frees apply to both caches alike.

One invariant per sequence, before a step: the draft cache holds positions [0, start - lag) of
every token the target has computed, where start is the step's first position and lag is 0 or
1. A step runs, per row of the batch (every row, speculating or not):

    pass 1   the draft runs [lag token] + the row's own new tokens (a prefill chunk, or the last
             token at position c); a drafting row samples draft 1 from the logits at c
    pass j   rows with >= j drafts run draft j-1 at position c + j - 1 and sample draft j

so the draft cache then holds [0, c + d) for a row with d drafts. The target accepts a <= d of
them and computes [0, c + 1 + a): the draft is behind only when a == d (draft d at c + d is
accepted but the draft never ran it). That token is the row's lag token, run first next step.
Positions past the accepted length hold rejected drafts and are overwritten later, exactly like
the target's. The lag is kept with its position: a sequence the worker drops and gets back
(swapped out and in, or recomputed with a prefix-cache hit) runs it first only if it resumes
right after it; one that recomputes that position anyway discards it.

One gap remains: a block whose last token is a lag token can be registered in the prefix cache
before the draft runs it (the sequence finishes or is preempted that step). A later sequence
that hits that block sees a stale draft KV entry at that one position: its drafts may be worse,
never its outputs (verification uses the draft's real q).

Draft tokens are drawn with the sampling settings of the row (temperature, top-k / top-p /
min-p, min_tokens; penalties count the row's earlier drafts as outputs), from the processed
draft distribution q, with noise independent of the verification's (seeded rows use a salted
seed): the rejection sampler needs q and the draft. With draft_sample_method="greedy" they are
its argmax instead, and the verification treats them as point masses (no q).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from paged_engine.attention import AttentionMetadata, HostLengths
from paged_engine.distributed.parallel_state import single_stage
from paged_engine.spec_decode.config import SpeculativeConfig
from paged_engine.worker.cache_engine import CacheEngine

if TYPE_CHECKING:
    from paged_engine.core.sched_output import SchedulerOutput
    from paged_engine.worker.input_batch import CachedSeq
    from paged_engine.worker.model_runner import ModelRunner, StepInputs

# XOR-ed into a seeded row's draw seed for its draft draw: the verification draws with the
# unsalted seed, and the two must be independent.
_DRAFT_SEED_SALT = 0x2545F4914F6CDD1D


@dataclass(slots=True)
class DraftProposal:
    tokens: dict[int, list[int]]  # seq id -> its drafts (host), as many as it was scheduled
    probs: Tensor | None  # [sum of drafts, V] float32 q per draft, None when every row is greedy
    offsets: dict[int, int]  # seq id -> the row of its first draft in `probs`


def store_draft(
    tokens: Tensor, probs: Tensor | None, j: int, rows: Tensor, tok: Tensor, q: Tensor | None
) -> Tensor | None:
    """Writes draft j (1-based) of the drafting rows `rows` into the step's tokens [D, k] and,
    when drafts are sampled, the distribution q each was drawn from into probs [D, k, V] (made
    on the first q). Returns probs."""
    tokens[:, j - 1].index_copy_(0, rows, tok)
    if q is not None:
        if probs is None:
            probs = q.new_zeros((*tokens.shape, q.shape[1]))
        probs[:, j - 1].index_copy_(0, rows, q)
    return probs


def write_drafts(runner: ModelRunner, inputs: StepInputs, dst: np.ndarray, drafts: Tensor) -> None:
    """Put `drafts` into the step's input ids at rows `dst` (their DRAFT_PLACEHOLDER slots)."""
    dst_d = runner._to_dev(dst)
    inputs.input_ids.index_copy_(0, dst_d, drafts)
    if inputs.embeds is not None:
        # A step that runs image rows carries its embeddings, made in `prepare` before the
        # drafts existed (their slots held DRAFT_PLACEHOLDER): the target must read the
        # drafts' own embeddings there.
        assert runner.images is not None
        embed = runner.images.embed_tokens
        rows = embed(drafts).to(inputs.embeds)
        if getattr(runner.images.audio_encoder, "adds_to_tokens", False):
            # Voxtral Realtime adds audio rows at generated positions too: keep them
            # (the slot holds embed(0) + audio, from the clamped placeholder)
            old = inputs.embeds.index_select(0, dst_d)
            rows = old - embed(torch.zeros_like(drafts)).to(old) + rows
        inputs.embeds.index_copy_(0, dst_d, rows)


def write_stage_drafts(
    runner: ModelRunner, sched: SchedulerOutput, inputs: StepInputs, drafts: dict[int, list[int]]
) -> None:
    """The first pipeline stage's share of a proposal the last stage made (`tokens` of its
    `DraftProposal`): each drafting row's drafts at the end of its tokens."""
    dst, flat = [], []
    for i, seq_id in enumerate(sched.seq_ids):
        d = drafts.get(seq_id)
        if d:
            end = int(inputs.cu[i + 1])
            dst.append(np.arange(end - len(d), end, dtype=np.int64))
            flat.extend(d)
    if flat:
        tokens = torch.tensor(flat, dtype=torch.int64).to(runner.device)
        write_drafts(runner, inputs, np.concatenate(dst), tokens)


class DraftModelRunner:
    # Whether the proposer reads the target's features (spec_decode/eagle.py's heads): their
    # forward then runs uncompiled on CPU.
    reads_target_features = False

    def __init__(self, model: torch.nn.Module, hf_config, runner: ModelRunner) -> None:
        self.model = model
        self.hf_config = hf_config
        self.runner = runner  # the target's runner: batch, backend, sampler, device
        self.dtype = next(model.parameters()).dtype
        self.cache: CacheEngine | None = None
        # draft_sample_method="greedy": drafts are the argmax of the processed draft logits,
        # verified as point masses (no q)
        spec = runner.config.speculative_config
        self.greedy_drafts = spec is not None and SpeculativeConfig.from_dict(spec).greedy_drafts
        # seq id -> (token, position): an accepted token the draft has not run yet.
        self._lag: dict[int, tuple[int, int]] = {}
        self._max_lag_entries = 4 * runner.config.max_num_seqs

    # ---- cache ----------------------------------------------------------------------------------
    def bytes_per_block(self, block_size: int) -> int:
        with single_stage():  # every layer: the last pipeline stage runs the draft whole
            return CacheEngine.bytes_per_block(self.hf_config, block_size, self.dtype)

    def init_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Same block count (and CPU pool) as the target's cache, in the draft's dtype."""
        r = self.runner
        with single_stage():
            self.cache = CacheEngine(
                self.hf_config,
                num_blocks,
                r.block_size,
                dtype=self.dtype,
                device=r.device,
                backend=r.backend,
                num_cpu_blocks=num_cpu_blocks,
            )

    # ---- one step -------------------------------------------------------------------------------
    def propose(
        self, sched: SchedulerOutput, cached: list[CachedSeq], inputs: StepInputs
    ) -> DraftProposal:
        """Run the draft over the step (pass 1, every row) and its drafting rows (passes 2..k);
        write the drafts into `inputs.input_ids` at their positions and return them."""
        r = self.runner
        spec = sched.spec_token_ids
        num_new = np.asarray(sched.num_new_tokens, dtype=np.int64)
        num_drafts = np.asarray([len(spec.get(s, ())) for s in sched.seq_ids], dtype=np.int64)
        base = num_new - num_drafts  # the row's own tokens (a prefill chunk or its last token)
        starts = np.asarray(sched.start_positions, dtype=np.int64)
        lag_tokens: list[int | None] = []
        for seq_id, start in zip(sched.seq_ids, sched.start_positions):
            entry = self._lag.pop(seq_id, None)
            lag_tokens.append(entry[0] if entry is not None and entry[1] == start - 1 else None)
        lag = np.asarray([t is not None for t in lag_tokens], dtype=np.int64)

        # Pass 1: [lag token] + the row's own tokens, gathered from cat(target ids, lag tokens).
        total = int(inputs.cu[-1])
        parts: list[np.ndarray] = []
        num_lag = 0
        for i in range(len(cached)):
            if lag[i]:
                parts.append(np.asarray([total + num_lag], dtype=np.int64))
                num_lag += 1
            a = int(inputs.cu[i])
            parts.append(np.arange(a, a + int(base[i]), dtype=np.int64))
        source = inputs.input_ids
        extra = [t for t in lag_tokens if t is not None]
        if extra:
            source = torch.cat([source, r._to_dev(extra)])
        ids = source.index_select(0, r._to_dev(np.concatenate(parts)))
        q_lens, ends = base + lag, starts + base
        hidden = self._forward(ids, inputs.rows, q_lens, ends)

        drafting = np.flatnonzero(num_drafts)  # batch indices of the rows that draft
        if drafting.size == 0:
            return DraftProposal({}, None, {})
        nd = num_drafts[drafting]
        c = ends[drafting] - 1  # position of each drafting row's last token
        last = np.cumsum(q_lens)[drafting] - 1  # its row in pass 1's output
        logits = self.model.compute_logits(hidden.index_select(0, r._to_dev(last)))
        k = int(nd.max())
        tokens = torch.zeros((drafting.size, k), dtype=torch.int64, device=r.device)
        probs: Tensor | None = None
        live = np.arange(drafting.size)  # drafting rows still drafting at pass j
        for j in range(1, k + 1):
            if j > 1:  # run draft j-1 of the rows that want draft j
                live = live[nd[live] >= j]
                live_d = r._to_dev(live)
                prev = tokens[:, j - 2].index_select(0, live_d)
                ones = np.ones(live.size, dtype=np.int64)
                hidden = self._forward(prev, inputs.rows[drafting[live]], ones, c[live] + j)
                logits = self.model.compute_logits(hidden)
            else:
                live_d = r._to_dev(live)
            prior = tokens[:, : j - 1].index_select(0, live_d)
            positions = c[live] + j
            tok, q = self._sample(logits.float(), cached, drafting[live], inputs, positions, prior)
            probs = store_draft(tokens, probs, j, live_d, tok, q)

        return self._finish(sched, inputs, drafting, nd, base, tokens, probs)

    def after_verify(
        self,
        seq_ids: list[int],
        num_drafts: np.ndarray,
        num_accepted: np.ndarray,
        drafts: dict[int, list[int]],
        positions: np.ndarray,
    ) -> None:
        """Rows whose every draft was accepted: their last draft is next step's lag token.
        `positions`: each entry's first draft position."""
        lag = self._lag
        counts = zip(num_drafts.tolist(), num_accepted.tolist(), positions.tolist())
        for seq_id, (d, a, pos) in zip(seq_ids, counts):
            if d and a == d:
                lag[seq_id] = (drafts[seq_id][-1], pos + d - 1)
        if len(lag) > self._max_lag_entries:  # finished sequences' entries, oldest first
            live = self.runner.batch.seqs
            for seq_id in [s for s in lag if s not in live][: len(lag) // 2]:
                del lag[seq_id]

    def after_step(self, sched: SchedulerOutput, inputs: StepInputs, hidden: Tensor) -> None:
        """Called after each step's sampling (a draft model keeps nothing of the target's)."""

    # ---- helpers --------------------------------------------------------------------------------
    def _finish(self, sched, inputs, drafting, nd, base, tokens, probs) -> DraftProposal:
        """Write the drafts [D, k] of the drafting rows into the step's input ids (draft j of
        batch row i at cu[i] + base[i] + j - 1) and return them row-major over (drafting row,
        draft j): the target's layout of draft rows."""
        r = self.runner
        k = tokens.shape[1]
        mask = np.arange(k)[None, :] < nd[:, None]
        flat = r._to_dev(np.flatnonzero(mask.ravel()))
        drafts = tokens.reshape(-1).index_select(0, flat)
        dst = np.concatenate(
            [inputs.cu[i] + base[i] + np.arange(d) for i, d in zip(drafting.tolist(), nd.tolist())]
        )
        write_drafts(r, inputs, dst, drafts)
        host = drafts.tolist()
        out: dict[int, list[int]] = {}
        offsets: dict[int, int] = {}
        at = 0
        for i, d in zip(drafting.tolist(), nd.tolist()):
            seq_id = sched.seq_ids[i]
            out[seq_id], offsets[seq_id] = host[at : at + d], at
            at += d
        if probs is not None:
            probs = probs.reshape(-1, probs.shape[2]).index_select(0, flat)
        return DraftProposal(out, probs, offsets)

    def _forward(self, ids: Tensor, rows: np.ndarray, q_lens: np.ndarray, ends: np.ndarray):
        """The draft over `q_lens[i]` tokens of batch row rows[i] ending at position ends[i] - 1
        (through the target's block tables, into the draft's cache). Returns hidden [T, D]."""
        meta, positions = self._metadata(rows, q_lens, ends)
        assert self.cache is not None
        return self.model(ids, positions, self.cache.kv_caches, meta)

    def _metadata(
        self, rows: np.ndarray, q_lens: np.ndarray, ends: np.ndarray
    ) -> tuple[AttentionMetadata, Tensor]:
        """Attention metadata and positions of `_forward`'s tokens."""
        r, bs = self.runner, self.runner.block_size
        batch = r.batch
        cu = np.zeros(rows.size + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        num_tokens = int(cu[-1])
        positions = np.arange(num_tokens) + np.repeat(ends - q_lens - cu[:-1], q_lens)
        tok_rows = np.repeat(rows, q_lens)
        slots = batch.block_table_np[tok_rows, positions // bs].astype(np.int64) * bs
        slots += positions % bs
        max_k = int(ends.max())
        width = -(-max_k // bs)
        tables_np = batch.block_table_np[rows, :width]
        if r.device.type == "cpu":
            block_tables = torch.from_numpy(tables_np)
        else:
            block_tables = batch.block_table[:, :width].index_select(0, r._to_dev(rows))
        slots_d, positions_d = r._upload(slots, positions)
        seq_lens_d, cu_d = r._upload(ends.astype(np.int32), cu.astype(np.int32))
        meta: AttentionMetadata = r.backend.build_metadata(
            slot_mapping=slots_d,
            block_tables=block_tables,
            cu_seqlens_q=cu_d,
            seq_lens=seq_lens_d,
            max_seqlen_q=int(q_lens.max()),
            max_seqlen_k=max_k,
            host=HostLengths(cu, ends, tables_np, slots),
        )
        return meta, positions_d

    def _sample(
        self, raw: Tensor, cached, src: np.ndarray, inputs, positions: np.ndarray, prior: Tensor
    ):
        """Draft tokens [R] and, unless every row is greedy, q [R, V] (the processed draft
        distribution they were drawn from) for batch indices `src` at `positions`; `prior`
        [R, j - 1]: the drafts before these, which penalties count as outputs."""
        r = self.runner
        rows = inputs.rows[src]
        out_pos = positions - r.batch.num_prompt[rows]
        drafted = prior if r.batch.history[rows].any() else None
        md = r.sampling.metadata(cached, src, rows, np.zeros(src.size, np.int64), out_pos, drafted)
        x = r.sampler.process_logits(raw, md)
        if md.all_greedy or self.greedy_drafts:
            return x.max(dim=-1).indices, None
        if md.seeds:
            md = dataclasses.replace(md, seeds=[(k, s ^ _DRAFT_SEED_SALT) for k, s in md.seeds])
        q = x.softmax(dim=-1)
        tokens = (q / r.sampler.noise(x.shape, md, x.device)).max(dim=-1).indices
        if md.greedy is not None:
            tokens = torch.where(md.greedy, x.max(dim=-1).indices, tokens)
        return tokens, q
