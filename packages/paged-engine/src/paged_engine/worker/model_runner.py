"""Runs one scheduled step on the device: persistent batch -> flat inputs -> forward -> sample.

Per step it builds one flat varlen batch (numpy on the host, one copy to the device):

    input_ids / positions / slot_mapping : [T]   every scheduled token of every sequence
    cu_seqlens_q                         : [S+1] sequence i owns rows [cu[i], cu[i+1])
    seq_lens                             : [S]   context length after this step
    block_tables                         : [S, width]  gathered from the device-resident table

A token the worker sampled itself is read on the device (`InputBatch.last_token`), so the step
after can run before the host has seen it. On GPUs, decode-only batches and verification
batches (k + 1 tokens in every row) replay a CUDA graph.
Results leave as an `AsyncRunnerOutput`: copies to pinned host memory that `get()` waits for.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from paged_engine.attention import AttentionBackend, AttentionMetadata, HostLengths
from paged_engine.config import EngineConfig
from paged_engine.core.sched_output import SchedulerOutput
from paged_engine.distributed.communication import (
    recv_tensor,
    send_object_async,
    send_tensor_async,
)
from paged_engine.distributed.parallel_state import get_parallel_state
from paged_engine.kv_transfer.block_io import KVBlockIO, build_block_io
from paged_engine.layers.batch_invariant import invariant_logsumexp
from paged_engine.lora.manager import LoRAManager
from paged_engine.models.llama import LayerAdditions
from paged_engine.multimodal.mrope import MropePositions
from paged_engine.sample.logits_processor import load_logits_processors
from paged_engine.sample.logprobs import gather_logprobs, log_softmax_topk, prompt_logprobs
from paged_engine.sample.metadata import PAD, with_token_bitmask
from paged_engine.sample.sampler import Sampler, sampling_race
from paged_engine.spec_decode.config import SpeculativeConfig
from paged_engine.spec_decode.draft_model import DraftModelRunner, DraftProposal
from paged_engine.spec_decode.rejection_sampler import verify
from paged_engine.worker.cache_engine import CacheEngine, num_cpu_blocks, resolve_kv_cache_dtype
from paged_engine.worker.cpu_compile import CompiledForward
from paged_engine.worker.cross_attention import (
    CrossAttentionState,
    CrossBatch,
    bound,
    cross_slot_rows,
    is_encoder_decoder,
)
from paged_engine.worker.cuda_graphs import CudaGraphRunner
from paged_engine.worker.image_embeds import ImageEmbedder, LookupRows, spliced_lookup
from paged_engine.worker.input_batch import CachedSeq, InputBatch
from paged_engine.worker.key_ends import ImageSpans
from paged_engine.worker.logits_processors import CustomLogitsProcessors
from paged_engine.worker.pooler import pool_hidden
from paged_engine.worker.recurrent_state import (
    RecurrentStatePool,
    is_hybrid,
    resolve_ssm_dtype,
    state_pools,
)
from paged_engine.worker.rope_positions import rope_positions
from paged_engine.worker.runner_output import AsyncRunnerOutput
from paged_engine.worker.sampling_inputs import SamplingInputs
from paged_engine.worker.stage_outputs import PendingStageOutput, StageOutputs

logger = logging.getLogger(__name__)


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


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        hf_config,
        device: torch.device,
        backend: AttentionBackend,
    ) -> None:
        self.config = config
        self.model = model
        self.hf_config = hf_config
        self.device = device
        self.backend = backend
        self.block_size = config.block_size
        assert config.max_model_len is not None
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        self.vocab_size = int(hf_config.vocab_size)
        self.cache: CacheEngine | None = None
        self.kv_transfer: KVBlockIO | None = None  # kv_transfer_config: loads / saves blocks
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, _model_dtype(model))
        self.graphs: CudaGraphRunner | None = None
        self.compiled: CompiledForward | None = None
        # LLM(logits_processors=...): the processors and their batch indices
        self.logits_procs: CustomLogitsProcessors | None = None
        if config.logits_processors:
            classes = load_logits_processors(config.logits_processors)
            self.logits_procs = CustomLogitsProcessors(classes, config, device)
        self.batch = InputBatch(
            config.max_num_seqs,
            self.max_blocks_per_seq,
            device,
            config.max_model_len,
            track_outputs=self.logits_procs is not None,
        )
        invariant = backend.name if config.batch_invariant else None
        # Speculative verification races with the sampler's torch noise (Sampler.noise): an
        # engine that verifies keeps one noise source for every row, so no race kernel there.
        race = None if config.speculative_config else sampling_race(backend.name, device)
        self.sampler = Sampler(config.seed, invariant_logsumexp(invariant), race)
        self.parallel = get_parallel_state()
        # What one pipeline stage hands the next: [T, hidden_size] (OPT projects only at the ends).
        self.stage_width = int(hf_config.hidden_size)
        # First stage of several: the steps whose sampled ids the last stage still owes.
        self.stage_outputs: StageOutputs | None = None
        if self.parallel.pp_size > 1 and self.parallel.is_first_stage:
            last = self.parallel.stage_rank(self.parallel.pp_size - 1)
            self.stage_outputs = StageOutputs(self.batch, last, self.parallel.pp_size, device)
        self._pin = device.type == "cuda"
        self.sampling = SamplingInputs(self.batch, device, self.vocab_size, self._to_dev)
        # speculative_config with a draft model: proposes each step's drafts (set by the worker).
        self.draft: DraftModelRunner | None = None
        # enable_lora: adapter slots and each row's slot (set by the worker; lora/manager.py).
        self.lora: LoRAManager | None = None
        # A checkpoint whose images run (multimodal/): their features at their placeholders
        # (set by the worker on the first pipeline stage; worker/image_embeds.py).
        self.images: ImageEmbedder | None = None
        # seq id -> its prompt's M-RoPE positions (Qwen-VL with images; every rank and stage)
        self.rope_tables: dict[int, MropePositions] = {}
        # Gemma 3: spans of images whose tokens attend both ways (every rank and stage)
        self.image_spans = ImageSpans()
        # Encoder-decoder models (Whisper, Mllama): each sequence's cross-attention K / V, in a
        # pool of slots allocated with the KV cache (worker/cross_attention.py)
        self.cross: CrossAttentionState | None = None
        if is_encoder_decoder(hf_config):
            rows = cross_slot_rows(config, hf_config)  # a clip's frames, or Mllama's images
            self.cross = CrossAttentionState(model, device, backend, self.block_size, rows)
        # Hybrid models: the linear-attention layers' state pools, a row per seat allocated before
        # the KV cache is sized, the prefix cache's snapshot rows added with the KV cache
        # (core/state_slots.py has the layout), plus a scratch row.
        self.states: RecurrentStatePool | None = None
        if is_hybrid(hf_config):
            dtype = _model_dtype(model)
            self.states = RecurrentStatePool(
                model,
                config.max_num_seqs,
                dtype,
                resolve_ssm_dtype(config.mamba_ssm_cache_dtype, dtype, hf_config),
                device,
                # speculative decoding: a backup row per seat, to undo a verify step's drafts
                num_backups=config.max_num_seqs if config.speculative_config else 0,
            )

    # ---- KV cache -------------------------------------------------------------------------------
    def init_kv_cache(self, num_blocks: int, num_state_snapshots: int = 0) -> None:
        if self.cross is not None:  # a slot a seat (max_num_seqs: fit_cross_slots)
            self.cross.allocate(self.config.max_num_seqs)
        if num_state_snapshots:
            assert self.states is not None
            self.states.resize(self.config.max_num_seqs + num_state_snapshots)
        cpu_blocks = num_cpu_blocks(
            self.hf_config,
            self.block_size,
            self.kv_cache_dtype,
            self.config.swap_space + self.config.cpu_offload_gib,
        )
        self.cache = CacheEngine(
            self.hf_config,
            num_blocks,
            self.block_size,
            dtype=self.kv_cache_dtype,
            device=self.device,
            backend=self.backend,
            num_cpu_blocks=cpu_blocks,
        )
        if self.config.kv_transfer_config is not None:  # block files <-> this rank's cache
            self.kv_transfer = build_block_io(self.config, self.cache)
        if self.draft is not None:  # the same blocks, a second set of tensors
            self.draft.init_cache(num_blocks, cpu_blocks)
        self.capture_graphs()
        # the sampler's race kernel, built now rather than on the first step that samples
        self.sampler.warm_up(self.vocab_size, self.device)
        if (
            self.device.type == "cpu"
            and self.config.compilation_level
            and not self._keeps_target_streams()
        ):
            self.compiled = CompiledForward(self)
            try:
                self.compiled.compile()
            except Exception as e:  # e.g. no C++ compiler for inductor's CPU code
                logger.warning("torch.compile failed, the model runs eagerly: %r", e)
                self.compiled = None

    def capture_graphs(self) -> None:
        """CUDA graphs of decode (and verification) steps where they can run: once the KV
        cache exists, and again after sleep mode gave back the memory they point at."""
        if (
            self.device.type == "cuda"
            and self.backend.cuda_graph_capturable
            and not self.config.enforce_eager
            and self.parallel.pp_size == 1  # a graph's input is token ids, not a stage's hidden
        ):
            # Speculation adds graphs for verification steps: k + 1 query tokens in every row.
            spec = self.config.speculative_config
            k = 0 if spec is None else SpeculativeConfig.from_dict(spec).num_speculative_tokens
            self.graphs = CudaGraphRunner(
                self, self.config.max_num_seqs, verify_len=k + 1 if k else None
            )
            self.graphs.capture()

    def _keeps_target_streams(self) -> bool:
        """A draft head that reads the target's features (EAGLE-3's layer streams, EAGLE-1's
        and MTP's final hidden states) takes them from an eager forward: no CPU torch.compile."""
        if self.draft is not None and self.draft.reads_target_features:
            logger.info(
                "speculative_config: torch.compile is off (the draft head reads the target's "
                "features from each forward)"
            )
            return True
        return False

    def kv_tensors(self) -> Iterator[torch.Tensor]:
        """What sleep mode's "kv_cache" tag frees: every layer's KV cache (the draft model's
        too), the recurrent-state pools and the cross-attention pool."""
        caches = [self.cache] + ([self.draft.cache] if self.draft is not None else [])
        for cache in caches:
            if cache is not None:
                yield from (t for pair in cache.kv_caches for t in pair)
        if self.states is not None:
            yield from (t for layer in self.states.layers for t in state_pools(layer))
        if self.cross is not None:
            yield from self.cross.tensors()

    # ---- one step -------------------------------------------------------------------------------
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
                procs.add(c.seq_id, c.params, c.token_ids[: c.num_prompt_tokens], c.output_ids)
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
        hidden_in = inputs.embeds  # the first stage's input embeddings when images run
        if not state.is_first_stage:
            shape = (inputs.input_ids.shape[0], self.stage_width)
            prev = state.stage_rank(state.pp_rank - 1)
            hidden_in = recv_tensor(shape, _model_dtype(self.model), self.device, prev)
        with layer_additions(self.model, inputs.additions), self._spliced_lookup(inputs):
            hidden = self.model(
                inputs.input_ids,
                inputs.positions,
                self.cache.kv_caches,
                inputs.attn_metadata,
                hidden_in,
            )
        if state.is_last_stage:
            out = self._sample(sched, cached, inputs, hidden)
            send_object_async(out.get(), state.stage_rank(0))
            return out
        send_tensor_async(hidden, state.stage_rank(state.pp_rank + 1))
        if not state.is_first_stage:
            return AsyncRunnerOutput(sched.step_id, [], None, None, [], None, [])
        assert self.stage_outputs is not None
        _, sample_no, sampled_ids, _ = self.sampling.plan(sched, cached)
        return self.stage_outputs.submit(sched.seq_ids, sampled_ids, sample_no)

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
        cross = None
        if self.cross is not None:
            cross = self.cross.step(sched.seq_ids, num_new, meta, starts)
        return StepInputs(
            input_ids, positions_d, meta, rows, cu, seq_lens, embeds, additions, lookup, cross
        )

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states [T, D]; a view of a graph's static output when a graph ran (valid until
        the next replay)."""
        assert self.cache is not None
        ids, pos, meta = inputs.input_ids, inputs.positions, inputs.attn_metadata
        if inputs.cross is not None:  # cross-attention to each sequence's encoder output: eager
            with bound(self.model, inputs.cross):
                return self.model(ids, pos, self.cache.kv_caches, meta)
        if inputs.embeds is not None:  # image features at their placeholders: eager
            with layer_additions(self.model, inputs.additions):
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
        if src.size and sched.spec_token_ids:
            rows = inputs.rows[src]
            track_history = bool(batch.tracks[rows].any())
            seq_ids, tokens, packed_lp, num_logprobs, flat, emitted = self._sample_drafts(
                sched, cached, inputs, hidden, src, sample_no, seq_ids, proposal
            )
        elif src.size:
            hidden_rows = self._to_dev(inputs.cu[src + 1] - 1)
            logits = self.compute_logits(hidden.index_select(0, hidden_rows))
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
        prompt = self._prompt_logprobs(sched, cached, inputs, hidden)
        pooled = (
            pool_hidden(batch, sched, cached, inputs, hidden, getattr(self.model, "classify", None))
            if batch.pooling.any()
            else []
        )
        handle = AsyncRunnerOutput(
            sched.step_id, seq_ids, tokens, packed_lp, num_logprobs, beam, prompt, pooled
        )
        if track_history:
            self.sampling.track_history(handle, cached, src, sample_no, flat, emitted)
        return handle

    def _sample_drafts(self, sched, cached, inputs, hidden, src, sample_no, seq_ids, proposal):
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

    def _prompt_logprobs(self, sched, cached, inputs, hidden):
        """(seq_id, start, k, packed rows) for sequences computing prompt logprobs this step."""
        out = []
        for i in np.flatnonzero(self.batch.prompt_logprobs[inputs.rows]).tolist():
            c = cached[i]
            start = sched.start_positions[i]
            last = min(start + sched.num_new_tokens[i], c.num_prompt_tokens - 1)
            if last <= start:
                continue
            lo, n = int(inputs.cu[i]), last - start
            targets = torch.tensor(c.token_ids[start + 1 : last + 1], dtype=torch.long)
            # A step may hold thousands of this prompt's rows: their logits ([rows, V] fp32, and
            # the packing's temporaries as large) are made a bounded slice at a time.
            rows = max(1, PROMPT_LOGPROBS_ELEMENTS // self.vocab_size)
            parts = [
                prompt_logprobs(
                    self.compute_logits(hidden[lo + a : lo + min(n, a + rows)]),
                    targets[a : a + rows],
                    c.prompt_logprobs,
                    self.sampler.logsumexp,
                )
                for a in range(0, n, rows)
            ]
            packed = parts[0] if len(parts) == 1 else torch.cat(parts)
            out.append((c.seq_id, start, c.prompt_logprobs, packed))
        return out


# Logits computed at once for prompt logprobs: 2^25 fp32 values (128 MiB; 220 rows of a
# 151,936-token vocabulary) whatever the step's token count.
PROMPT_LOGPROBS_ELEMENTS = 1 << 25


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype
