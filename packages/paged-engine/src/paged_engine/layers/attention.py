"""Paged attention layer: write this step's K/V into the cache, then attend through block tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import paged_kernels


@dataclass(slots=True)
class AttentionMetadata:
    """Everything an attention layer needs for one forward; built by the model runner."""

    slot_mapping: torch.Tensor  # [T] int64, -1 = padding token (not written)
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with the null block 0
    cu_seqlens_q: torch.Tensor  # [S+1] int32
    seq_lens: torch.Tensor  # [S] int32 (context incl. this step's tokens)
    max_seqlen_q: int
    max_seqlen_k: int
    backend: str  # "triton" (CUDA or TRITON_INTERPRET) or "torch" (reference)


class Attention(nn.Module):
    """Multi-head / grouped-query attention over a paged KV cache (no parameters)."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} not divisible by num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.soft_cap = soft_cap
        if alibi_slopes is not None:
            self.register_buffer("alibi_slopes", alibi_slopes.float(), persistent=False)
        else:
            self.alibi_slopes = None

    def forward(
        self,
        q: torch.Tensor,  # [T, H*D]
        k: torch.Tensor,  # [T, Hkv*D]
        v: torch.Tensor,  # [T, Hkv*D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # each [num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H*D]
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        md = attn_metadata
        if md.backend == "torch":
            paged_kernels.ref_write_kv_cache(k, v, key_cache, value_cache, md.slot_mapping)
            out = paged_kernels.ref_paged_attention(
                q,
                key_cache,
                value_cache,
                md.block_tables,
                md.cu_seqlens_q,
                md.seq_lens,
                self.scale,
                sliding_window=self.sliding_window,
                soft_cap=self.soft_cap,
                alibi_slopes=self.alibi_slopes,
            )
        elif md.backend == "triton":
            # Imported lazily: the Triton kernels are optional on CPU-only machines.
            from paged_kernels import paged_attention, write_kv_cache

            write_kv_cache(k, v, key_cache, value_cache, md.slot_mapping)
            out = paged_attention(
                q,
                key_cache,
                value_cache,
                md.block_tables,
                md.cu_seqlens_q,
                md.seq_lens,
                self.scale,
                max_seqlen_q=md.max_seqlen_q,
                max_seqlen_k=md.max_seqlen_k,
                sliding_window=self.sliding_window,
                soft_cap=self.soft_cap,
                alibi_slopes=self.alibi_slopes,
            )
        else:
            raise ValueError(f"unknown attention backend {md.backend!r} (use 'torch' or 'triton')")
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
