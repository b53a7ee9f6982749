"""One step on the device: `ModelRunner.execute_model` and the forward it runs.

    execute_model:  finished / new sequences in and out of the persistent batch -> block
                    table deltas -> block swaps and copies, state row copies, KV loads ->
                    prepare (step_inputs.py) -> [draft propose] -> forward -> KV saves ->
                    _sample (step_sampling.py) -> [draft after_step]

`forward` picks how the model runs: a CUDA graph (decode and verification batches), the CPU
compiled forward, or eager (cross-attention, image features, prompt_embeds rows, M-RoPE /
two-way image rows). Under pipeline parallelism each stage runs its share (`_execute_stage`):
hidden states pass from stage to stage, and the last stage's sampled ids go back to the first.
A worker-side proposer runs on the last stage, whose drafts go to the first stage before the
step's forward (worker/stage_outputs.py). A hybrid model's stages that do not sample restore the
state rows of a rejected draft at the sequence's next step (`RecurrentStatePool.roll_back`).

`StepExecution` is a mixin of `ModelRunner` (worker/model_runner.py). vLLM v1:
`GPUModelRunner.execute_model` (`_update_states`, the forward, the pipeline hand-off).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from paged_engine.core.sched_output import SchedulerOutput
from paged_engine.distributed.communication import (
    recv_tensor,
    send_object_async,
    send_tensor_async,
)
from paged_engine.models.llama import LayerAdditions
from paged_engine.spec_decode.draft_model import write_stage_drafts
from paged_engine.spec_decode.planner import DRAFT_PLACEHOLDER
from paged_engine.worker.cross_attention import bound
from paged_engine.worker.image_embeds import spliced_lookup
from paged_engine.worker.input_batch import CachedSeq
from paged_engine.worker.runner_output import AsyncRunnerOutput
from paged_engine.worker.stage_outputs import PendingStageOutput
from paged_engine.worker.step_inputs import StepInputs

if TYPE_CHECKING:
    from paged_engine.distributed.parallel_state import ParallelState
    from paged_engine.kv_transfer.block_io import KVBlockIO
    from paged_engine.lora.manager import LoRAManager
    from paged_engine.multimodal.mrope import MropePositions
    from paged_engine.spec_decode.draft_model import DraftModelRunner
    from paged_engine.worker.cache_engine import CacheEngine
    from paged_engine.worker.cpu_compile import CompiledForward
    from paged_engine.worker.cross_attention import CrossAttentionState
    from paged_engine.worker.cuda_graphs import CudaGraphRunner
    from paged_engine.worker.image_embeds import ImageEmbedder
    from paged_engine.worker.input_batch import InputBatch
    from paged_engine.worker.key_ends import ImageSpans
    from paged_engine.worker.logits_processors import CustomLogitsProcessors
    from paged_engine.worker.recurrent_state import RecurrentStatePool
    from paged_engine.worker.sampling_inputs import SamplingInputs
    from paged_engine.worker.stage_outputs import StageOutputs


@contextmanager
def layer_additions(model: nn.Module, additions: LayerAdditions | None) -> Iterator[None]:
    """The decoder adds `additions` after its first layers for one forward (its LlamaModel
    reads `layer_additions`)."""
    if additions is None:
        yield
        return
    inner = model.model  # type: ignore[union-attr]
    inner.layer_additions = additions
    try:
        yield
    finally:
        inner.layer_additions = None


@contextmanager
def vision_rows(model: nn.Module, rows: torch.Tensor | None) -> Iterator[None]:
    """The model routes `rows` to its vision experts for one forward (ERNIE 4.5 VL reads
    `vision_rows`)."""
    if rows is None:
        yield
        return
    model.vision_rows = rows  # type: ignore[assignment]
    try:
        yield
    finally:
        model.vision_rows = None  # type: ignore[assignment]


class StepExecution:
    """`execute_model`, the pipeline stage's share, `forward`, `compute_logits` (mixed into
    `ModelRunner`; they call its `prepare` and `_sample`)."""

    # the ModelRunner's state it uses
    model: nn.Module
    device: torch.device
    stage_width: int
    cache: CacheEngine | None
    kv_transfer: KVBlockIO | None
    graphs: CudaGraphRunner | None
    compiled: CompiledForward | None
    parallel: ParallelState
    stage_outputs: StageOutputs | None
    batch: InputBatch
    sampling: SamplingInputs
    logits_procs: CustomLogitsProcessors | None
    draft: DraftModelRunner | None
    lora: LoRAManager | None
    images: ImageEmbedder | None
    cross: CrossAttentionState | None
    states: RecurrentStatePool | None
    rope_tables: dict[int, MropePositions]
    image_spans: ImageSpans

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> AsyncRunnerOutput:
        assert self.cache is not None, "init_kv_cache() first"
        procs = self.logits_procs
        self.sampling.apply_history(wait=procs is not None)
        batch = self.batch
        draft = self.draft
        lora = self.lora
        for seq_id in sched.finished_seq_ids:
            if procs is not None:
                procs.remove(seq_id)
            if lora is not None and seq_id in batch.seqs:
                c = batch.seqs[seq_id]
                lora.release(c.row, c.lora_id)
            batch.remove(seq_id)
            self.rope_tables.pop(seq_id, None)
            self.image_spans.remove(seq_id)
            if self.images is not None:
                self.images.remove(seq_id)
            if self.cross is not None:
                self.cross.remove(seq_id)
        for data in sched.new_seqs:
            c = batch.add(data)
            if data.mrope is not None:
                self.rope_tables[data.seq_id] = data.mrope
            if data.mm_inputs:
                self.image_spans.add(data.seq_id, data.mm_inputs)
            if self.images is not None:
                self.images.add(data.seq_id, data.mm_inputs)
            if self.cross is not None:
                self.cross.add(data.seq_id, data.mm_inputs)
            if lora is not None:
                lora.acquire(c.row, data.lora_id, data.lora_path)
            if procs is not None and c.output_ids is not None:
                # an embedded prompt's positions hold placeholders, no token ids: None, as vLLM
                prompt = None if data.embeds_prompt else c.token_ids[: c.num_prompt_tokens]
                procs.add(c.seq_id, c.params, prompt, c.output_ids)
        if procs is not None:
            procs.update()
        batch.update_blocks(sched.block_updates)
        caches = [self.cache] if draft is None else [self.cache, draft.cache]
        for cache in caches:
            if sched.blocks_to_swap_out:  # first: later swaps, copies and writes may reuse them
                cache.swap_out(sched.blocks_to_swap_out)
            if sched.blocks_to_swap_in:
                cache.swap_in(sched.blocks_to_swap_in)
            if sched.blocks_to_copy:
                cache.copy_blocks(sched.blocks_to_copy)
        if sched.known_token_ids and self.states is not None and not self.parallel.is_last_stage:
            self._roll_back_states(sched)  # before the copies: a snapshot may read those seats
        if sched.state_copies:
            assert self.states is not None
            self.states.copy_rows(sched.state_copies)
        invalid: list[int] = []
        if self.kv_transfer is not None:  # stored blocks counted as computed: filled now
            invalid = self.kv_transfer.load(sched)
        cached = list(map(batch.seqs.__getitem__, sched.seq_ids))
        if not cached:
            return AsyncRunnerOutput(sched.step_id, [], None, None, [], None, [])
        if self.stage_outputs is not None:  # the sampled ids this step's rows read
            self.stage_outputs.before_step(sched.seq_ids)
        inputs = self.prepare(sched, cached)
        if self.parallel.pp_size > 1:
            return self._execute_stage(sched, cached, inputs)
        proposal = None if draft is None else draft.propose(sched, cached, inputs)
        hidden = self.forward(inputs)
        if self.kv_transfer is not None:  # the step's full prompt blocks, to storage
            stale: set[int] = set()
            if invalid:  # a row that read a block no file filled wrote stale KV: not saved
                tables = [batch.block_table_np[c.row].tolist() for c in cached]
                stale = {b for t in tables if not set(invalid).isdisjoint(t) for b in t}
            self.kv_transfer.save(sched, stale)
        out = self._sample(sched, cached, inputs, hidden, proposal)
        out.invalid_block_ids = invalid
        if draft is not None:
            draft.after_step(sched, inputs, hidden)  # a head keeps the forward's features
        return out

    def _roll_back_states(self, sched: SchedulerOutput) -> None:
        """A stage that did not sample: restore the state rows of the sequences the engine core
        rolled back after a rejected draft (they replay `known_token_ids` from their verify
        step's start; the last stage restored them when it sampled)."""
        assert self.states is not None
        batch, known = self.batch, sched.known_token_ids
        replays = [i for i, s in enumerate(sched.seq_ids) if s in known]
        rows = [batch.seqs[sched.seq_ids[i]].row for i in replays]
        starts = np.asarray([sched.start_positions[i] for i in replays], dtype=np.int64)
        self.states.roll_back(batch.state_slot[rows], starts)

    def _execute_stage(
        self, sched: SchedulerOutput, cached: list[CachedSeq], inputs: StepInputs
    ) -> AsyncRunnerOutput | PendingStageOutput:
        """This pipeline stage's share of a step. Hidden states pass from stage to stage
        between ranks of the same TP rank; the last stage samples and sends its output to its
        first-stage peer, which takes the sampled ids as its next input tokens (rank 0 also
        hands the output to the engine core) when it receives them: sends never wait for the
        peer, so the first stage may run the next step meanwhile (`StageOutputs`). Middle
        stages return an empty output."""
        assert self.cache is not None
        state = self.parallel
        draft = self.draft  # a worker-side proposer: held by the last stage only
        proposal = None
        if draft is not None:  # before the forward: the first stage waits for these drafts
            proposal = draft.propose(sched, cached, inputs)
            if _proposes(sched):
                send_object_async(proposal.tokens, state.stage_rank(0))
        elif state.is_first_stage and _proposes(sched):
            assert self.stage_outputs is not None
            write_stage_drafts(self, sched, inputs, self.stage_outputs.receive_drafts())
        hidden_in = inputs.embeds  # the first stage's input embeddings when images run
        if not state.is_first_stage:
            shape = (inputs.input_ids.shape[0], self.stage_width)
            prev = state.stage_rank(state.pp_rank - 1)
            hidden_in = recv_tensor(shape, _model_dtype(self.model), self.device, prev)
        with (
            layer_additions(self.model, inputs.additions),
            self._spliced_lookup(inputs),
            vision_rows(self.model, inputs.vision_rows),
        ):
            hidden = self.model(
                inputs.input_ids,
                inputs.positions,
                self.cache.kv_caches,
                inputs.attn_metadata,
                hidden_in,
            )
        if state.is_last_stage:
            out = self._sample(sched, cached, inputs, hidden, proposal)
            send_object_async(out.get(), state.stage_rank(0))
            if draft is not None:
                draft.after_step(sched, inputs, hidden)  # a head keeps the forward's features
            return out
        send_tensor_async(hidden, state.stage_rank(state.pp_rank + 1))
        if not state.is_first_stage:
            return AsyncRunnerOutput(sched.step_id, [], None, None, [], None, [])
        assert self.stage_outputs is not None
        _, sample_no, sampled_ids, _ = self.sampling.plan(sched, cached)
        drafted = frozenset(s for s, d in sched.spec_token_ids.items() if d)
        return self.stage_outputs.submit(sched.seq_ids, sampled_ids, sample_no, drafted)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states [T, D]; a view of a graph's static output when a graph ran (valid until
        the next replay)."""
        assert self.cache is not None
        ids, pos, meta = inputs.input_ids, inputs.positions, inputs.attn_metadata
        if inputs.cross is not None:  # cross-attention to each sequence's encoder output: eager
            with bound(self.model, inputs.cross):
                return self.model(ids, pos, self.cache.kv_caches, meta)
        if inputs.embeds is not None or inputs.vision_rows is not None:
            # image features at their placeholders, rows routed by modality: eager
            additions = layer_additions(self.model, inputs.additions)
            with additions, vision_rows(self.model, inputs.vision_rows):
                return self.model(ids, pos, self.cache.kv_caches, meta, inputs.embeds)
        if inputs.lookup is not None:  # prompt_embeds rows: eager
            with self._spliced_lookup(inputs):
                return self.model(ids, pos, self.cache.kv_caches, meta)
        if pos.dim() == 2 or meta.key_ends is not None:  # an image's M-RoPE / two-way rows: eager
            return self.model(ids, pos, self.cache.kv_caches, meta)
        if self.graphs is not None and self.graphs.can_run(meta, ids.shape[0]):
            return self.graphs.run(ids, pos, meta)
        if self.compiled is not None:
            return self.compiled.run(ids, pos, meta)
        return self.model(ids, pos, self.cache.kv_caches, meta)

    def _spliced_lookup(self, inputs: StepInputs) -> AbstractContextManager[None]:
        """The step's prompt_embeds rows in the token embedding's output while open."""
        return spliced_lookup(None if self.images is None else self.images.lookup, inputs.lookup)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        if self.compiled is not None:
            return self.compiled.compute_logits(hidden)
        return self.model.compute_logits(hidden)


def _proposes(sched: SchedulerOutput) -> bool:
    """Whether the step's drafts are a worker-side proposer's (placeholders until it runs)."""
    return any(d and d[0] == DRAFT_PLACEHOLDER for d in sched.spec_token_ids.values())


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype
