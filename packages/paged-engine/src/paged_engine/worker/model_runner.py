"""`ModelRunner`: one device's model, KV cache and per-step machinery.

    execute_model (step_execution.py): the persistent batch updated by the step's deltas ->
        prepare (step_inputs.py): flat varlen inputs, one aligned upload ->
        forward (step_execution.py): a CUDA graph, the CPU compiled forward, or eager ->
        _sample (step_sampling.py): sampled ids, verified drafts, beams, prompt logprobs ->
    `AsyncRunnerOutput`: copies to pinned host memory that `get()` waits for.

This file builds the runner (batch, sampler, multimodal / encoder-decoder / hybrid state),
allocates the KV cache with what hangs on it (`init_kv_cache`: CUDA graphs, the compiled CPU
forward, the sampler's race kernel), lists what sleep mode frees (`kv_tensors`), and computes
prompt logprobs in bounded slices (`PROMPT_LOGPROBS_ELEMENTS`, which the memory profiler sizes
against). The step's parts are mixins, one concept a file. vLLM v1: `GPUModelRunner`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import torch

from paged_engine.attention import AttentionBackend
from paged_engine.config import EngineConfig
from paged_engine.distributed.parallel_state import get_parallel_state
from paged_engine.kv_transfer.block_io import KVBlockIO, build_block_io
from paged_engine.layers.batch_invariant import invariant_logsumexp
from paged_engine.lora.manager import LoRAManager
from paged_engine.multimodal.mrope import MropePositions
from paged_engine.sample.logits_processor import load_logits_processors
from paged_engine.sample.logprobs import prompt_logprobs
from paged_engine.sample.sampler import Sampler, sampling_race
from paged_engine.spec_decode.config import SpeculativeConfig
from paged_engine.spec_decode.draft_model import DraftModelRunner
from paged_engine.worker.cache_engine import CacheEngine, num_cpu_blocks, resolve_kv_cache_dtype
from paged_engine.worker.cpu_compile import CompiledForward
from paged_engine.worker.cross_attention import (
    CrossAttentionState,
    cross_slot_rows,
    is_encoder_decoder,
)
from paged_engine.worker.cuda_graphs import CudaGraphRunner
from paged_engine.worker.image_embeds import ImageEmbedder
from paged_engine.worker.input_batch import InputBatch
from paged_engine.worker.key_ends import ImageSpans
from paged_engine.worker.logits_processors import CustomLogitsProcessors
from paged_engine.worker.recurrent_state import (
    RecurrentStatePool,
    is_hybrid,
    resolve_ssm_dtype,
    state_pools,
)
from paged_engine.worker.runner_output import counts_nans_in_logits
from paged_engine.worker.sampling_inputs import SamplingInputs
from paged_engine.worker.stage_outputs import StageOutputs
from paged_engine.worker.step_execution import StepExecution, _model_dtype
from paged_engine.worker.step_inputs import InputPreparer, StepInputs, pack_aligned
from paged_engine.worker.step_sampling import StepSampling

__all__ = ["PROMPT_LOGPROBS_ELEMENTS", "ModelRunner", "StepInputs", "pack_aligned"]

logger = logging.getLogger(__name__)


class ModelRunner(StepExecution, InputPreparer, StepSampling):
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
        # token ids a modality-routed decoder sends to its vision experts (ERNIE 4.5 VL), read
        # once here: the per-step lookup on an nn.Module that lacks it costs ~2.5 us
        self.vision_token_ids = getattr(model, "vision_token_ids", None)
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
        self.count_nans = counts_nans_in_logits()  # vLLM's VLLM_COMPUTE_NANS_IN_LOGITS
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
            k = 0 if spec is None else SpeculativeConfig.from_dict(spec).max_draft_tokens
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

    # ---- prompt logprobs ------------------------------------------------------------------------
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
