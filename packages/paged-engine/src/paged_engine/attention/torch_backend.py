"""The plain-torch backend: paged_kernels' reference implementations (any device, no Triton).

It reads sequence lengths on the host, so it is never captured in a CUDA graph.
"""

from __future__ import annotations

import torch

import paged_kernels
from paged_engine.attention.backend import AttentionBackend, AttentionMetadata


class TorchBackend(AttentionBackend):
    name = "torch"
    cuda_graph_capturable = False

    def write_kv(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        paged_kernels.ref_write_kv_cache(key, value, key_cache, value_cache, slot_mapping)

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
        return paged_kernels.ref_paged_attention(
            query,
            key_cache,
            value_cache,
            md.block_tables,
            md.cu_seqlens_q,
            md.seq_lens,
            scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            alibi_slopes=alibi_slopes,
        )

    def copy_blocks(self, key_caches, value_caches, mapping) -> None:
        paged_kernels.ref_copy_blocks(key_caches, value_caches, mapping)
