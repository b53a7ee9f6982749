"""CUDA graphs for decode and verification steps, one per (query length q, bucketed batch size).

A captured graph replays a fixed sequence of kernels on fixed buffers, so every input lives in a
static buffer sized for the largest graph; a step of B sequences with q query tokens each copies
its inputs into the first B rows (B * q tokens) and replays the graph of the smallest bucket
>= B for that q. q = 1 serves decode steps; with speculative_config (k drafts) q = k + 1 serves
verification steps, where every row runs its last token and its k drafts. Row i of a q graph
owns tokens [i * q, (i + 1) * q): cu_seqlens_q = arange(bs + 1) * q and max_seqlen_q = q are
static, and the attention kernels put a row's q queries at the last q positions of its seq_len.

Padding rows write nothing (slot -1 for each of their q tokens) and read only the null block
with seq_len q, so their query positions are 0 .. q - 1 (never negative: no row without a
visible key); their outputs are dropped. A hybrid model's padding rows run on the recurrent
state's scratch row (worker/recurrent_state.py), which no sequence owns.

Steps whose rows have different query lengths (a row with fewer than k drafts or none, a
prefill chunk) run eagerly: a graph fixes every row's query count, and such a step matches no
captured layout.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from paged_engine.attention import AttentionMetadata

if TYPE_CHECKING:
    from paged_engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 256 + 1, 16))
    sizes = [s for s in sizes if s < max_num_seqs] + [max_num_seqs]
    return sorted(set(sizes))


class CudaGraphRunner:
    """`verify_len`: q = k + 1 of speculative_config, or None (decode graphs only)."""

    def __init__(
        self, runner: ModelRunner, max_num_seqs: int, verify_len: int | None = None
    ) -> None:
        self.runner = runner
        # Batch sizes per query length. A verification step of bs rows takes bs * q tokens of
        # the step's budget, so buckets past max_num_batched_tokens // q could never run; below
        # that the decode buckets serve (the same list or a prefix of it, plus the cap).
        self.sizes: dict[int, list[int]] = {1: bucket_sizes(max_num_seqs)}
        if verify_len is not None and verify_len > 1:
            budget = runner.config.max_num_batched_tokens or max_num_seqs * verify_len
            cap = min(max_num_seqs, budget // verify_len)
            if cap >= 1:
                self.sizes[verify_len] = bucket_sizes(cap)
        n, dev = max_num_seqs, runner.device
        num_tokens = max(q * sizes[-1] for q, sizes in self.sizes.items())
        self.input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = {
            q: torch.arange(sizes[-1] + 1, dtype=torch.int32, device=dev) * q
            for q, sizes in self.sizes.items()
        }
        self.block_tables = torch.zeros(
            (n, runner.max_blocks_per_seq), dtype=torch.int32, device=dev
        )
        # Hybrid models: each row's recurrent-state row; padding rows use the scratch row.
        self.scratch_row = -1
        self.state_slots = self.has_state = self.prompt_lens = None
        if runner.states is not None:
            self.scratch_row = runner.states.scratch_row
            self.state_slots = torch.full((n,), self.scratch_row, dtype=torch.int64, device=dev)
            self.has_state = torch.zeros(n, dtype=torch.bool, device=dev)
            self.prompt_lens = torch.zeros(n, dtype=torch.int64, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (q, bs) -> graph
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # (q, bs) -> [bs * q, D]
        self.pool = None

    def _meta(self, q: int, bs: int) -> AttentionMetadata:
        r = self.runner
        meta = r.backend.build_metadata(
            slot_mapping=self.slot_mapping[: bs * q],
            block_tables=self.block_tables[:bs],
            cu_seqlens_q=self.cu_seqlens_q[q][: bs + 1],
            seq_lens=self.seq_lens[:bs],
            max_seqlen_q=q,
            max_seqlen_k=r.config.max_model_len,  # static upper bound: no host sync in replay
        )
        if self.state_slots is not None and self.has_state is not None:
            meta.state_slots, meta.has_initial_state = self.state_slots[:bs], self.has_state[:bs]
            meta.prompt_lens = self.prompt_lens[:bs]  # type: ignore[index]
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        r = self.runner
        assert r.cache is not None
        t0 = time.perf_counter()
        # Most tokens first, so the smaller graphs reuse the first one's memory pool.
        keys = [(q, bs) for q, sizes in self.sizes.items() for bs in sizes]
        keys.sort(key=lambda key: (key[0] * key[1], key[0]), reverse=True)
        logger.info(
            "capturing CUDA graphs for %d (query length, batch size) pairs: %s",
            len(keys),
            ", ".join(f"q={q}: 1..{sizes[-1]}" for q, sizes in self.sizes.items()),
        )
        mapping = r.lora.model.mapping if r.lora is not None else None
        if mapping is not None:  # LoRA kernels go into every graph; no slot has tokens yet
            mapping.set(np.full(0, -1, dtype=np.int64))
            mapping.capturing = True
        try:
            self._capture_all(keys)
        finally:
            if mapping is not None:
                mapping.capturing = False
        torch.cuda.synchronize()
        logger.info("CUDA graphs captured in %.1fs", time.perf_counter() - t0)

    def _capture_all(self, keys: list[tuple[int, int]]) -> None:
        r = self.runner
        assert r.cache is not None
        for q, bs in keys:
            self.seq_lens.fill_(q)  # every row a valid q-token query while capturing
            meta = self._meta(q, bs)
            t = bs * q
            args = (self.input_ids[:t], self.positions[:t], r.cache.kv_caches, meta)
            r.model(*args)  # warm up: Triton JIT-compiles outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[q, bs] = r.model(*args)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[q, bs] = graph

    def can_run(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Every row has exactly q query tokens for a captured q: no row has more than
        max_seqlen_q, so num_tokens == num_seqs * max_seqlen_q holds only when all have it."""
        q, num_seqs = meta.max_seqlen_q, meta.seq_lens.shape[0]
        sizes = self.sizes.get(q)
        return (
            sizes is not None
            and num_tokens == num_seqs * q
            and num_seqs <= sizes[-1]
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [n * q, D] of a step that `can_run`: a view of the graph's static
        output, valid only until the next replay (the caller consumes it before the next step)."""
        q, n = meta.max_seqlen_q, meta.seq_lens.shape[0]
        bs = next(s for s in self.sizes[q] if s >= n)
        t, t_bs = n * q, bs * q
        # cu_seqlens_q needs no copy: a uniform step's is arange(n + 1) * q, the static one's.
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.slot_mapping[t:t_bs].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:bs].fill_(q)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.block_tables[:n, width:].zero_()
        self.block_tables[n:bs].zero_()
        if self.state_slots is not None and self.has_state is not None:
            assert meta.state_slots is not None and meta.has_initial_state is not None
            self.state_slots[:n].copy_(meta.state_slots)
            self.state_slots[n:bs].fill_(self.scratch_row)
            self.has_state[:n].copy_(meta.has_initial_state)
            self.has_state[n:bs].fill_(False)
            assert self.prompt_lens is not None and meta.prompt_lens is not None
            self.prompt_lens[:n].copy_(meta.prompt_lens)
            self.prompt_lens[n:bs].fill_(0)
        # Tokens [t, t_bs) keep stale ids / positions: harmless, as they write nothing (slot -1)
        # and attend only to the null block (seq_len q); their outputs are dropped.
        self.graphs[q, bs].replay()
        return self.outputs[q, bs][:t]
