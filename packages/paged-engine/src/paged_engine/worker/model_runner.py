"""Runs the model for one scheduled step: inputs from the scheduler's plan, logits out.

The runner reads `Sequence` state and never changes it. Per step it builds one flat varlen batch:

    input_ids / positions / slot_mapping : [T]   every scheduled token of every sequence
    cu_seqlens_q                         : [S+1] sequence i owns rows [cu[i], cu[i+1])
    seq_lens                             : [S]   context length after this step
    block_tables                         : [S, max_blocks]  padded with the null block 0

and returns the logits of the last row of every sequence that reaches the end of its known tokens
(those are sampled). Decode-only batches replay a CUDA graph of the nearest bucket size on GPUs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from paged_engine.worker.cache_engine import CacheEngine
from paged_engine.config import EngineConfig
from paged_engine.worker.cuda_graphs import CudaGraphRunner
from paged_engine.layers.attention import AttentionMetadata
from paged_engine.core.request import Sequence
from paged_engine.core.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


class StepInputs(NamedTuple):
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    sample_rows: list[int]  # row in [T] of the last token of each sampling sequence
    sample_seqs: list[Sequence]
    # (sequence, first row, end row) of sequences whose prompt logprobs are computed this step
    prompt_rows: list[tuple[Sequence, int, int]]


@dataclass(slots=True)
class ModelOutput:
    logits: torch.Tensor | None  # [len(sample_seqs), vocab] float32
    sample_seqs: list[Sequence]  # sequences whose last token's logits are in `logits`
    # (sequence, logits [q_len, vocab] of every row it ran this step, position of the first row)
    prompt_logits: list[tuple[Sequence, torch.Tensor, int]]


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model: torch.nn.Module, hf_config, device: torch.device
    ):
        self.config = config
        self.model = model
        self.hf_config = hf_config
        self.device = device
        self.block_size = config.block_size
        assert config.max_model_len is not None
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        if config.attention_backend == "auto":
            self.backend = "triton" if device.type == "cuda" else "torch"
        else:
            self.backend = config.attention_backend
        self.cache: CacheEngine | None = None
        self.graphs: CudaGraphRunner | None = None
        self._pin = device.type == "cuda"

    # ---- KV cache -------------------------------------------------------------------------------
    def init_kv_cache(self, num_blocks: int) -> None:
        self.cache = CacheEngine(
            self.hf_config,
            num_blocks,
            self.block_size,
            dtype=_model_dtype(self.model),
            device=self.device,
            backend=self.backend,
        )
        # Only the Triton backend is capturable: the torch reference reads lengths on the host.
        if (
            self.device.type == "cuda"
            and self.backend == "triton"
            and not self.config.enforce_eager
        ):
            self.graphs = CudaGraphRunner(self, self.config.max_num_seqs)
            self.graphs.capture()

    # ---- one step -------------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Flat varlen inputs for every sequence with tokens this step (plain lists on the host,
        one tensor each to the device). A decode row costs a few list appends."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        prompt_rows: list[tuple[Sequence, int, int]] = []
        max_q = 0
        for seq, n in out.scheduled:
            if n == 0:
                continue
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_ids
            if n == 1:
                ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                _extend_slots(slots, table, start, end, bs)
            max_q = max(max_q, n)
            cu.append(cu[-1] + n)
            seq_lens.append(end)
            tables.append(table)
            if end == seq.num_tokens:
                sample_rows.append(cu[-1] - 1)
                sample_seqs.append(seq)
            if _wants_prompt_logprobs(seq, start):
                prompt_rows.append((seq, cu[-2], cu[-1]))
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) if len(t) < width else t for t in tables]
        meta = AttentionMetadata(
            slot_mapping=self._to_dev(torch.tensor(slots, dtype=torch.int64)),
            block_tables=self._to_dev(torch.tensor(padded, dtype=torch.int32)),  # 0 = null block
            cu_seqlens_q=self._to_dev(torch.tensor(cu, dtype=torch.int32)),
            seq_lens=self._to_dev(torch.tensor(seq_lens, dtype=torch.int32)),
            max_seqlen_q=max_q,
            max_seqlen_k=max(seq_lens),
            backend=self.backend,
        )
        return StepInputs(
            input_ids=self._to_dev(torch.tensor(ids, dtype=torch.int64)),
            positions=self._to_dev(torch.tensor(positions, dtype=torch.int64)),
            attn_metadata=meta,
            sample_rows=sample_rows,
            sample_seqs=sample_seqs,
            prompt_rows=prompt_rows,
        )

    def _to_dev(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True) if self._pin else t.to(self.device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelOutput:
        assert self.cache is not None, "init_kv_cache() first"
        if out.blocks_to_copy:
            self.cache.copy_blocks(out.blocks_to_copy)
        if not any(item.num_new_tokens for item in out.scheduled):
            return ModelOutput(logits=None, sample_seqs=[], prompt_logits=[])
        inputs = self.prepare(out)
        input_ids, positions, meta = inputs.input_ids, inputs.positions, inputs.attn_metadata
        if self.graphs is not None and self.graphs.can_run(meta, len(input_ids)):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, self.cache.kv_caches, meta)
        logits = None
        if inputs.sample_rows:
            rows = self._to_dev(torch.tensor(inputs.sample_rows, dtype=torch.long))
            logits = self.model.compute_logits(hidden.index_select(0, rows)).float()
        prompt_logits = [
            (seq, self.model.compute_logits(hidden[lo:hi]).float(), seq.num_computed_tokens)
            for seq, lo, hi in inputs.prompt_rows
        ]
        return ModelOutput(
            logits=logits, sample_seqs=inputs.sample_seqs, prompt_logits=prompt_logits
        )

    # ---- memory profiling -----------------------------------------------------------------------
    @torch.inference_mode()
    def profile_num_blocks(self, baseline_used: int | None = None) -> int:
        """KV blocks that fit once weights and the activations of the largest step are resident.

        `gpu_memory_utilization` is this engine's share of the device: the budget is
        `total * utilization` minus what the engine itself holds (memory used now minus
        `baseline_used`, the device's use before the engine loaded anything: other processes)
        minus the activation peak. Without a baseline all used memory counts as ours."""
        cfg = self.config
        bytes_per_block = CacheEngine.bytes_per_block(
            self.hf_config, self.block_size, _model_dtype(self.model)
        )
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override
        if self.device.type != "cuda":
            return max(int(cfg.cpu_kv_cache_gib * (1 << 30)) // bytes_per_block, 2)
        dev = self.device
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        free_before, total = torch.cuda.mem_get_info(dev)
        used_before = total - free_before  # weights, CUDA context, other processes
        own = used_before - (baseline_used or 0)
        allocated_before = torch.cuda.memory_allocated(dev)
        scratch_bytes = self._profile_forward()
        torch.cuda.synchronize(dev)
        # The peak counts the forward's scratch KV blocks too: the real pool replaces them.
        activation_peak = torch.cuda.max_memory_allocated(dev) - allocated_before - scratch_bytes
        budget = total * cfg.gpu_memory_utilization - own - activation_peak
        torch.cuda.empty_cache()
        num_blocks = int(budget // bytes_per_block)
        logger.info(
            "profiling: %.2f GiB held by the engine, %.2f GiB activation peak -> %d KV blocks",
            own / 2**30,
            activation_peak / 2**30,
            num_blocks,
        )
        return num_blocks

    def _profile_forward(self) -> int:
        """One forward of max_num_batched_tokens tokens over max_num_seqs rows, then logits.
        Returns the bytes of the scratch KV cache it allocated."""
        cfg = self.config
        assert cfg.max_num_batched_tokens is not None
        assert cfg.max_model_len is not None
        num_seqs = max(1, min(cfg.max_num_seqs, cfg.max_num_batched_tokens))
        # No step runs more than max_model_len tokens of one sequence (nor positions past it).
        num_tokens = min(cfg.max_num_batched_tokens, num_seqs * cfg.max_model_len)
        q, r = divmod(num_tokens, num_seqs)
        lens = [q + 1] * r + [q] * (num_seqs - r)  # each <= ceil(num_tokens / num_seqs)
        blocks_needed = sum(-(-n // self.block_size) for n in lens) + 1
        scratch = CacheEngine(
            self.hf_config,
            blocks_needed,
            self.block_size,
            dtype=_model_dtype(self.model),
            device=self.device,
        )
        tables, slots, next_block = [], [], 1
        for n in lens:
            nb = -(-n // self.block_size)
            table = list(range(next_block, next_block + nb))
            next_block += nb
            tables.append(table + [0] * (max(1, blocks_needed) - nb))
            slots.extend(
                table[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(n)
            )
        cu = np.concatenate([[0], np.cumsum(lens)]).tolist()
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=self.device),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            max_seqlen_q=max(lens),
            max_seqlen_k=max(lens),
            backend=self.backend,
        )
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        hidden = self.model(ids, positions, scratch.kv_caches, meta)
        self.model.compute_logits(hidden[:num_seqs])
        del scratch, hidden
        bpb = CacheEngine.bytes_per_block(self.hf_config, self.block_size, _model_dtype(self.model))
        return blocks_needed * bpb


def _extend_slots(slots: list[int], table: list[int], start: int, end: int, bs: int) -> None:
    """Append the cache slots of positions [start, end): one range per block touched."""
    for b in range(start // bs, (end - 1) // bs + 1):
        lo, hi = max(start, b * bs), min(end, (b + 1) * bs)
        base = table[b] * bs - b * bs
        slots.extend(range(base + lo, base + hi))


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _wants_prompt_logprobs(seq: Sequence, start: int) -> bool:
    params = seq.request.params
    return (
        getattr(params, "prompt_logprobs", None) is not None
        and start < seq.num_prompt_tokens
        and seq.index == 0
    )
