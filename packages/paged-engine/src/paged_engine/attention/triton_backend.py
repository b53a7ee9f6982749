"""The Triton backend: paged_kernels' JIT kernels (CUDA, or Triton's interpreter on CPU).

Given max_seqlen_q / max_seqlen_k from the host, the kernels never read device memory on the
host, so a decode forward through them can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from paged_engine.attention.backend import AttentionBackend, AttentionMetadata


class TritonBackend(AttentionBackend):
    name = "triton"
    cuda_graph_capturable = True

    def __init__(self) -> None:
        # Imported here: triton is optional where only the torch backend runs.
        from paged_kernels import copy_blocks, paged_attention, write_kv_cache

        self._write = write_kv_cache
        self._attend = paged_attention
        self._copy = copy_blocks

    def write_kv(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        self._write(key, value, key_cache, value_cache, slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None,
        soft_cap: float | None,
        alibi_slopes: torch.Tensor | None,
    ) -> torch.Tensor:
        return self._attend(
            query,
            key_cache,
            value_cache,
            md.block_tables,
            md.cu_seqlens_q,
            md.seq_lens,
            scale,
            max_seqlen_q=md.max_seqlen_q,
            max_seqlen_k=md.max_seqlen_k,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            alibi_slopes=alibi_slopes,
        )

    def copy_blocks(self, key_caches, value_caches, mapping) -> None:
        self._copy(key_caches, value_caches, mapping)
