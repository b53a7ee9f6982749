"""CUDA graphs for decode-only steps, captured once per bucketed batch size.

A captured graph replays a fixed sequence of kernels on fixed buffers, so every input lives in a
static buffer sized for the largest bucket; a step of B sequences copies its inputs into the first
B rows and replays the graph of the smallest bucket >= B. Padding rows write to slot -1 (skipped)
and read the null block with seq_len 1; their outputs are ignored.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

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
    def __init__(self, runner: ModelRunner, max_num_seqs: int) -> None:
        self.runner = runner
        self.sizes = bucket_sizes(max_num_seqs)
        n, dev = self.sizes[-1], runner.device
        self.max_bs = n
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(
            (n, runner.max_blocks_per_seq), dtype=torch.int32, device=dev
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        r = self.runner
        return r.backend.build_metadata(
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            max_seqlen_q=1,
            max_seqlen_k=r.config.max_model_len,  # static upper bound: no host sync in replay
        )

    @torch.inference_mode()
    def capture(self) -> None:
        r = self.runner
        assert r.cache is not None
        t0 = time.perf_counter()
        logger.info(
            "capturing CUDA graphs for %d batch sizes (1..%d)", len(self.sizes), max(self.sizes)
        )
        for bs in reversed(self.sizes):  # largest first so smaller graphs reuse its memory pool
            meta = self._meta(bs)
            args = (self.input_ids[:bs], self.positions[:bs], r.cache.kv_caches, meta)
            r.model(*args)  # warm up: Triton JIT-compiles outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[bs] = r.model(*args)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("CUDA graphs captured in %.1fs", time.perf_counter() - t0)

    def can_run(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        num_seqs = meta.seq_lens.shape[0]
        return (
            meta.max_seqlen_q == 1
            and num_tokens == num_seqs
            and num_seqs <= self.max_bs
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [n, D] of a decode step: a view of the graph's static output, valid only
        until the next replay (the caller consumes it before the next step)."""
        n = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:bs].fill_(1)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.block_tables[:n, width:].zero_()
        self.block_tables[n:bs].zero_()
        # Rows [n, bs) keep stale ids / positions: harmless, as they write nothing (slot -1) and
        # attend only to the null block (seq_len 1); their outputs are dropped.
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
