"""`InputBatch`: the worker's persistent per-sequence state, one row per live sequence.

A sequence gets a row when it first arrives (`NewSeqData`) and keeps it until the scheduler
drops it. Per row, preallocated and updated in place:

    block_table [rows, max_blocks] int32 (device)  by deltas; 0 = the null block
    last_token  [rows] int64 (device)              the last token the worker sampled for it
    temperature / top_k / top_p / min_p / penalties / min_tokens (host numpy)
    num_host_tokens [rows] (host numpy)             tokens the worker knows on the host
    tokens_np [rows, max_model_len] (host numpy)    penalty rows' known tokens (lazily)

Position p of a sequence holds token_ids[p] when p < num_host_tokens, else the token the worker
sampled last (last_token): at most one position is ever in that state, because a sequence with
an unknown token runs exactly that one position next (see core/request.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from paged_engine.core.sched_output import NewSeqData
from paged_engine.sample.metadata import PAD


@dataclass(slots=True, eq=False)
class CachedSeq:
    seq_id: int
    row: int
    index: int
    num_prompt_tokens: int
    token_ids: list[int]  # known on the host; grows only for history rows (penalties)
    params: Any
    beam_candidates: int
    eos_token_ids: tuple[int, ...]
    seed: int | None
    num_logprobs: int | None  # top columns its logprobs take (SamplingParams.num_top_logprobs)
    prompt_logprobs: int | None
    needs_history: bool  # its tokens are kept on the host (penalties, custom logits processors)
    lora_id: int = 0  # its LoRA adapter (0: none)
    num_tokens: int = 0  # host tokens + tokens sampled since (tracked for history rows)
    # its output ids, the live list custom logits processors were given (None without them)
    output_ids: list[int] | None = None


class InputBatch:
    def __init__(
        self,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        max_model_len: int | None = None,
        track_outputs: bool = False,
    ) -> None:
        self.capacity = max_num_seqs
        # custom logits processors read every sampling row's output ids (CachedSeq.output_ids)
        self.track_outputs = track_outputs
        self.device = device
        # Penalty rows' tokens, mirrored from CachedSeq.token_ids so a step reads its histories
        # as array slices instead of converting Python lists (O(length) of Python a row and
        # step). Allocated with the first penalty row; only the pages rows write become memory.
        self.max_model_len = max_model_len
        self.tokens_np: np.ndarray | None = None
        self.seqs: dict[int, CachedSeq] = {}
        self.row_of: dict[int, int] = {}  # seq id -> row
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        # The host copy computes slot mappings; on CPU the device table is a view of it.
        self.block_table_np = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int32)
        if device.type == "cpu":
            self.block_table = torch.from_numpy(self.block_table_np)
        else:
            self.block_table = torch.zeros(
                (max_num_seqs, max_blocks_per_seq), dtype=torch.int32, device=device
            )
        self.version = 0  # bumped whenever the set of rows or their settings change
        self.last_token = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.num_host_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.temperature = np.ones(max_num_seqs)
        self.top_k = np.zeros(max_num_seqs, dtype=np.int64)
        self.top_p = np.ones(max_num_seqs)
        self.min_p = np.zeros(max_num_seqs)
        self.repetition = np.ones(max_num_seqs)
        self.frequency = np.zeros(max_num_seqs)
        self.presence = np.zeros(max_num_seqs)
        self.min_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_prompt = np.zeros(max_num_seqs, dtype=np.int64)
        self.state_slot = np.full(max_num_seqs, -1, dtype=np.int64)  # hybrid models' state row
        # Rare per-row features, as flags so a step finds its few rows without a Python loop.
        self.history = np.zeros(max_num_seqs, dtype=bool)  # penalties read output tokens
        self.tracks = np.zeros(max_num_seqs, dtype=bool)  # CachedSeq.needs_history
        self.seeded = np.zeros(max_num_seqs, dtype=bool)
        self.logprobs = np.zeros(max_num_seqs, dtype=bool)  # report or rank by logprobs
        self.beam = np.zeros(max_num_seqs, dtype=bool)
        self.prompt_logprobs = np.zeros(max_num_seqs, dtype=bool)
        self.pooling = np.zeros(max_num_seqs, dtype=bool)  # embedding requests (pooler.py)
        self.token_rules = np.zeros(max_num_seqs, dtype=bool)  # allowed_token_ids / logit_bias
        self.num_beam_rows = 0

    def __len__(self) -> int:
        return len(self.seqs)

    def row_flags(self) -> tuple[np.ndarray, ...]:
        """The per-row feature flags: all False on a free row."""
        return (
            self.history,
            self.tracks,
            self.seeded,
            self.logprobs,
            self.beam,
            self.prompt_logprobs,
            self.pooling,
            self.token_rules,
        )

    def remove(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return
        del self.row_of[seq_id]
        self._free_rows.append(seq.row)
        # add() sets every flag again, but a whole-batch test (`pooling.any()`) reads free rows
        # too: a finished embedding request's flag kept the pooler on every later step
        for flags in self.row_flags():
            flags[seq.row] = False
        self.version += 1
        self.num_beam_rows -= seq.beam_candidates > 0

    def add(self, data: NewSeqData) -> CachedSeq:
        assert data.seq_id not in self.seqs, f"sequence {data.seq_id} added twice"
        assert self._free_rows, f"more than max_num_seqs={self.capacity} live sequences"
        row = self._free_rows.pop()
        p = data.params
        beam = data.beam_candidates > 0
        history = not beam and (
            p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        )
        outputs = None
        if self.track_outputs and not beam and not hasattr(p, "pooling_type"):
            outputs = list(data.token_ids[data.num_prompt_tokens :])
        seq = CachedSeq(
            seq_id=data.seq_id,
            row=row,
            index=data.index,
            num_prompt_tokens=data.num_prompt_tokens,
            token_ids=data.token_ids,
            params=p,
            beam_candidates=data.beam_candidates,
            eos_token_ids=data.eos_token_ids,
            seed=None if beam else p.seed,
            num_logprobs=None if beam else p.num_top_logprobs,
            prompt_logprobs=None if beam else p.prompt_logprobs,
            needs_history=history or outputs is not None,
            num_tokens=len(data.token_ids),
            lora_id=data.lora_id,
            output_ids=outputs,
        )
        self.seqs[data.seq_id] = seq
        self.row_of[data.seq_id] = row
        self.version += 1
        self.num_beam_rows += beam
        self.num_host_tokens[row] = len(data.token_ids)
        self.num_prompt[row] = data.num_prompt_tokens
        self.state_slot[row] = data.state_slot
        self.history[row] = history
        self.tracks[row] = seq.needs_history
        if history:
            self.mirror_tokens(row, data.token_ids)
            if data.embeds_prompt:  # placeholders: no token a penalty counts
                assert self.tokens_np is not None
                self.tokens_np[row, : data.num_prompt_tokens] = PAD
        self.seeded[row] = seq.seed is not None and not p.is_greedy
        self.logprobs[row] = not beam and (p.logprobs is not None or (p.best_of or 0) > p.n)
        self.beam[row] = beam
        self.prompt_logprobs[row] = seq.prompt_logprobs is not None and data.index == 0
        self.pooling[row] = hasattr(p, "pooling_type")
        self.token_rules[row] = not beam and bool(p.allowed_token_ids or p.logit_bias)
        if beam:  # beams rank raw logprobs: no sampling settings apply
            self.temperature[row], self.top_k[row], self.top_p[row], self.min_p[row] = 0, 0, 1, 0
            self.repetition[row], self.frequency[row], self.presence[row] = 1, 0, 0
            self.min_tokens[row] = 0
        else:
            self.temperature[row] = p.temperature
            self.top_k[row] = p.top_k
            self.top_p[row] = p.top_p
            self.min_p[row] = p.min_p
            self.repetition[row] = p.repetition_penalty
            self.frequency[row] = p.frequency_penalty
            self.presence[row] = p.presence_penalty
            self.min_tokens[row] = p.min_tokens
        table = self.block_table_np[row]
        table[:] = 0  # a previous occupant's entries must not linger
        table[: len(data.block_ids)] = data.block_ids
        if self.device.type != "cpu":
            self.block_table[row].copy_(torch.from_numpy(table), non_blocking=False)
        return seq

    def mirror_tokens(self, row: int, token_ids: list[int], start: int = 0) -> None:
        """Write token_ids at positions [start, start + len) of the row's token mirror."""
        if self.tokens_np is None:
            # without max_model_len: what the block table can address at the largest block size
            width = self.max_model_len or self.block_table_np.shape[1] * 256
            self.tokens_np = np.zeros((self.capacity, width), dtype=np.int32)
        self.tokens_np[row, start : start + len(token_ids)] = token_ids

    def update_blocks(self, updates: list[tuple[int, int, list[int]]]) -> None:
        """Apply (seq_id, first index, block ids) deltas in one scatter."""
        if not updates:
            return
        rows: list[int] = []
        cols: list[int] = []
        ids: list[int] = []
        for seq_id, first, block_ids in updates:
            row = self.seqs[seq_id].row
            rows += [row] * len(block_ids)
            cols += range(first, first + len(block_ids))
            ids += block_ids
        self.block_table_np[rows, cols] = ids
        if self.device.type == "cpu":
            return
        packed = torch.tensor([rows, cols, ids], dtype=torch.int64).pin_memory()
        packed = packed.to(self.device, non_blocking=True)
        self.block_table[packed[0], packed[1]] = packed[2].to(torch.int32)
