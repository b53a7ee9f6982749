"""A step's flat model inputs, built from the persistent batch (`ModelRunner.prepare`).

Per step one flat varlen batch, numpy on the host and one copy to the device:

    input_ids / positions / slot_mapping : [T]   every scheduled token of every sequence
    cu_seqlens_q                         : [S+1] sequence i owns rows [cu[i], cu[i+1])
    seq_lens                             : [S]   context length after this step
    block_tables                         : [S, width]  gathered from the device-resident table

A token the worker sampled itself is read on the device (`InputBatch.last_token`), so the step
after can run before the host has seen it; drafts and a rolled-back verify step's tokens are
host-known ids at their rows. The host arrays go up as one buffer whose views each start 16-byte
aligned (`pack_aligned`). Hybrid models' state rows advance here, and their backups are taken
before a verify step.

`InputPreparer` is a mixin of `ModelRunner` (worker/model_runner.py). vLLM v1:
`GPUModelRunner._prepare_inputs` over its `InputBatch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from paged_engine.attention import AttentionBackend, AttentionMetadata, HostLengths
from paged_engine.core.sched_output import SchedulerOutput
from paged_engine.models.llama import LayerAdditions
from paged_engine.worker.cross_attention import CrossBatch
from paged_engine.worker.image_embeds import LookupRows
from paged_engine.worker.input_batch import CachedSeq
from paged_engine.worker.rope_positions import rope_positions

if TYPE_CHECKING:
    from paged_engine.lora.manager import LoRAManager
    from paged_engine.multimodal.mrope import MropePositions
    from paged_engine.worker.cross_attention import CrossAttentionState
    from paged_engine.worker.image_embeds import ImageEmbedder
    from paged_engine.worker.input_batch import InputBatch
    from paged_engine.worker.key_ends import ImageSpans
    from paged_engine.worker.recurrent_state import RecurrentStatePool


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64 (the rope's; [3, T] over an image's M-RoPE run)
    attn_metadata: AttentionMetadata
    rows: np.ndarray  # [S] InputBatch row of each sequence
    cu: np.ndarray  # [S+1] host copy of cu_seqlens_q
    seq_lens: np.ndarray  # [S] host copy
    # [T, D] input embeddings when image placeholders run this step (the model then skips its
    # token embedding); None: the model embeds input_ids itself
    embeds: torch.Tensor | None = None
    # rows the decoder adds after its first layers (Qwen3-VL's deepstack), with `embeds`
    additions: LayerAdditions | None = None
    # prompt_embeds rows for the token embedding's output (with `embeds` None)
    lookup: LookupRows | None = None
    # an encoder-decoder model's cross-attention inputs (worker/cross_attention.py)
    cross: CrossBatch | None = None
    # [T] bool: the prompt rows a modality-routed decoder sends to its vision experts (ERNIE
    # 4.5 VL's `vision_token_ids`); None: none this step
    vision_rows: torch.Tensor | None = None


def pack_aligned(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    """1-D arrays in one buffer of their common dtype, each starting at a multiple of 16 bytes:
    (buffer, each array's first index). Triton specializes a kernel on whether each pointer
    argument is 16-byte aligned, so views at unaligned offsets (which moved with the step's
    token and sequence counts) built kernel variants on the first steps that happened to hit
    them (the H200's first prefill: 1.7 s of builds)."""
    dtype = np.result_type(*arrays)  # as np.concatenate would promote them
    step = max(1, 16 // dtype.itemsize)
    starts, end = [], 0
    for a in arrays:
        starts.append(end)
        end += -(-a.size // step) * step
    buf = np.empty(end, dtype=dtype)  # the gaps are never read
    for start, a in zip(starts, arrays):
        buf[start : start + a.size] = a
    return buf, starts


class InputPreparer:
    """`prepare` and the host -> device uploads (mixed into `ModelRunner`)."""

    # the ModelRunner's state it uses
    batch: InputBatch
    model: torch.nn.Module
    vision_token_ids: np.ndarray | None
    block_size: int
    device: torch.device
    backend: AttentionBackend
    lora: LoRAManager | None
    rope_tables: dict[int, MropePositions]
    image_spans: ImageSpans
    images: ImageEmbedder | None
    cross: CrossAttentionState | None
    states: RecurrentStatePool | None
    _pin: bool

    def prepare(self, sched: SchedulerOutput, cached: list[CachedSeq]) -> StepInputs:
        """Flat inputs of the batch; host work is numpy over rows, plus a Python slice per
        sequence that has host-known tokens to run (prefill chunks)."""
        batch, bs = self.batch, self.block_size
        num_seqs = len(cached)
        rows = np.fromiter(map(batch.row_of.__getitem__, sched.seq_ids), np.int64, num_seqs)
        starts = np.asarray(sched.start_positions, dtype=np.int64)
        num_new = np.asarray(sched.num_new_tokens, dtype=np.int64)
        seq_lens = starts + num_new
        cu = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(num_new, out=cu[1:])
        num_tokens = int(cu[-1])
        if num_tokens == num_seqs:  # decode-only: one row per sequence
            tok_rows, positions = rows, starts
        else:
            tok_rows = np.repeat(rows, num_new)
            positions = np.arange(num_tokens) + np.repeat(starts - cu[:-1], num_new)
        host_len = batch.num_host_tokens[rows]
        ids = np.zeros(num_tokens, dtype=np.int64)
        for i in np.flatnonzero(starts < host_len):  # positions the host knows
            start, a = int(starts[i]), int(cu[i])
            m = min(int(num_new[i]), int(host_len[i]) - start)
            ids[a : a + m] = cached[i].token_ids[start : start + m]
        from_device = positions >= batch.num_host_tokens[tok_rows]
        if sched.known_token_ids:  # generated tokens run again: the row's first positions
            for i, seq_id in enumerate(sched.seq_ids):
                known = sched.known_token_ids.get(seq_id)
                if known:
                    a = int(cu[i])
                    ids[a : a + len(known)] = known
                    from_device[a : a + len(known)] = False
        if sched.spec_token_ids:  # drafts: host-known tokens after a row's last token
            for i, seq_id in enumerate(sched.seq_ids):
                drafts = sched.spec_token_ids.get(seq_id)
                if drafts:
                    a = int(cu[i + 1]) - len(drafts)
                    ids[a : a + len(drafts)] = drafts
                    from_device[a : a + len(drafts)] = False
        if self.lora is not None:
            self.lora.set_mapping(tok_rows)
        slots = batch.block_table_np[tok_rows, positions // bs].astype(np.int64) * bs
        slots += positions % bs
        max_seqlen_k = int(seq_lens.max())
        width = -(-max_seqlen_k // bs)
        rope = None
        if self.rope_tables:
            rope = rope_positions(self.rope_tables, sched.seq_ids, starts, cu, positions)
        model_pos = positions if rope is None else rope.reshape(-1)
        slots_d, positions_d, ids_d, tok_rows_d, mask_d = self._upload(
            slots, model_pos, ids, tok_rows, from_device.astype(np.int64)
        )
        if rope is not None and rope.ndim == 2:
            positions_d = positions_d.view(3, num_tokens)
        seq_lens_d, cu_d = self._upload(seq_lens.astype(np.int32), cu.astype(np.int32))
        key_ends = self.image_spans.key_ends(sched.seq_ids, starts, num_new, cu, positions)
        key_ends_d = None if key_ends is None else self._upload(key_ends)[0]
        if from_device.all():
            input_ids = batch.last_token.index_select(0, tok_rows_d)
        elif from_device.any():
            last = batch.last_token.index_select(0, tok_rows_d)
            input_ids = torch.where(mask_d.bool(), last, ids_d)
        else:
            input_ids = ids_d
        tables_np = batch.block_table_np[rows, :width]
        if self.device.type == "cpu":
            block_tables = torch.from_numpy(tables_np)
        else:
            block_tables = batch.block_table[:, :width].index_select(0, self._to_dev(rows))
        meta = self.backend.build_metadata(
            slot_mapping=slots_d,
            block_tables=block_tables,
            cu_seqlens_q=cu_d,
            seq_lens=seq_lens_d,
            max_seqlen_q=int(num_new.max()),
            max_seqlen_k=max_seqlen_k,
            host=HostLengths(cu, seq_lens, tables_np, slots, key_ends),
            key_ends=key_ends_d,
        )
        if self.states is not None:
            state_rows = batch.state_slot[rows]
            if sched.spec_token_ids:  # verify steps absorb drafts that may be rejected
                drafting = [i for i, s in enumerate(sched.seq_ids) if s in sched.spec_token_ids]
                self.states.back_up(state_rows[drafting], starts[drafting])
            self.states.advance(state_rows, starts, num_new)
            meta.state_slots, has_state, meta.prompt_lens = self._upload(
                state_rows, (starts > 0).astype(np.int64), batch.num_prompt[rows].astype(np.int64)
            )
            meta.has_initial_state = has_state.bool()
        spliced = None if self.images is None else self.images.inputs_embeds(sched, cu, input_ids)
        embeds, additions, lookup = spliced if spliced is not None else (None, None, None)
        cross, vision_rows = None, None
        if self.cross is not None:
            cross = self.cross.step(sched.seq_ids, num_new, meta, starts)
        routed = self.vision_token_ids
        if routed is not None and routed.size:  # prompt tokens of those ids (host-known)
            mask = (positions < batch.num_prompt[tok_rows]) & np.isin(ids, routed)
            if mask.any():
                vision_rows = self._upload(mask.astype(np.int64))[0].bool()
        inputs = StepInputs(
            input_ids, positions_d, meta, rows, cu, seq_lens, embeds, additions, lookup, cross
        )
        inputs.vision_rows = vision_rows
        return inputs

    def _to_dev(self, values: np.ndarray | list) -> torch.Tensor:
        t = torch.from_numpy(np.asarray(values, dtype=np.int64))
        if self.device.type == "cpu":
            return t
        return (t.pin_memory() if self._pin else t).to(self.device, non_blocking=True)

    def _upload(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Host arrays of one dtype on the device: one buffer (pinned, one copy off the CPU)
        cut into views that each start 16-byte aligned. The CPU keeps the same layout, so the
        interpreter sees the pointers a GPU's kernels get (tests/compile_keys.py)."""
        buf, starts = pack_aligned(arrays)
        host = torch.from_numpy(buf)
        if self.device.type != "cpu":
            host = host.pin_memory().to(self.device, non_blocking=True)
        return [host[start : start + a.size] for start, a in zip(starts, arrays)]
