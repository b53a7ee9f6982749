"""Paged attention layer: write this step's K/V into the cache, then attend through block tables.

The layer holds no parameters and no backend choice: `attn_metadata.backend` does the work. A
model with attention sinks (gpt-oss) hands the layer its own sinks parameter, which the layer
reads at every call and never registers or copies.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paged_engine.attention.backend import AttentionMetadata
from paged_engine.layers import compiled_ops

__all__ = ["Attention", "AttentionMetadata", "LatentAttention"]


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
        sinks: torch.Tensor | None = None,  # [num_heads] float: this rank's heads' sinks
        attention_chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} not divisible by num_kv_heads={num_kv_heads}")
        if attention_chunk_size is not None and (
            not isinstance(attention_chunk_size, int) or attention_chunk_size < 1
        ):
            raise ValueError(
                f"attention_chunk_size must be a positive integer, got {attention_chunk_size!r}"
            )
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        # Chunked local attention (Llama 4): a query at position p sees keys from p - p % C on.
        self.attention_chunk_size = attention_chunk_size
        self.soft_cap = soft_cap
        # An fp8 KV cache's per-tensor scales (stored = key / k_scale); 1.0 for any other cache.
        # Set once before the first cache write (worker/kv_scales.py), never changed after.
        self.k_scale = 1.0
        self.v_scale = 1.0
        if alibi_slopes is not None:
            self.register_buffer("alibi_slopes", alibi_slopes.float(), persistent=False)
        else:
            self.alibi_slopes = None
        if sinks is not None and sinks.shape != (num_heads,):
            raise ValueError(f"sinks must be [num_heads={num_heads}], got {tuple(sinks.shape)}")
        # The model's parameter itself, read at call time (weights load after construction and
        # may be updated in place). Set past nn.Module.__setattr__, so it is not registered a
        # second time under this module's name (a duplicate in state_dict / the loader's map).
        self.__dict__["sinks"] = sinks
        # A layer that reads another layer's cache and writes none (Gemma 4's KV-shared
        # layers): `set_kv_source`; its k / v arguments are ignored.
        self.__dict__["kv_source"] = None
        # Set by a compiled forward (worker/cpu_compile.py): this layer's handle for the
        # paged_engine::attention operator and the index of its cache in the model's kv_caches.
        self.op_handle: int | None = None
        self.kv_index = -1
        # Set by a compiled forward: a decode step's attention is traced into the graph
        # (`backend.attend_decode`) instead of calling the operator.
        self.trace_decode = False

    def set_kv_source(self, source: Attention) -> None:
        """Attend over `source`'s cache (the model hands this layer that cache) and never write
        it: the keys and values there, written with `source`'s fp8 scales, are this layer's."""
        if (source.num_kv_heads, source.head_dim) != (self.num_kv_heads, self.head_dim):
            raise ValueError("a KV-sharing layer needs its source's KV head count and size")
        self.__dict__["kv_source"] = source

    def fused_kv_write(
        self, kv_cache: tuple[torch.Tensor, torch.Tensor], attn_metadata: AttentionMetadata
    ) -> dict[str, Any] | None:
        """What paged_kernels.rope_qk_ needs to store this step's K/V in the layer's cache in
        its own launch (caches, slots, scales), where the backend's write is that kernel's and
        the layer writes its cache eagerly; the layer is then called with `kv_written=True`.
        None: the layer writes them itself."""
        if (
            not attn_metadata.backend.rope_writes_kv
            or self.kv_source is not None
            or self.op_handle is not None  # a compiled forward's operator writes them
        ):
            return None
        key_cache, value_cache = kv_cache
        return {
            "key_cache": key_cache,
            "value_cache": value_cache,
            "slot_mapping": attn_metadata.slot_mapping,
            "k_scale": self.k_scale,
            "v_scale": self.v_scale,
        }

    def forward(
        self,
        q: torch.Tensor,  # [T, H*D]
        k: torch.Tensor,  # [T, Hkv*D]
        v: torch.Tensor,  # [T, Hkv*D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # each [num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
        kv_written: bool = False,  # the rope kernel stored k and v (fused_kv_write)
    ) -> torch.Tensor:  # [T, H*D]
        if kv_written:
            return self.run(q, k, v, kv_cache, attn_metadata, kv_written=True)
        if self.op_handle is not None and torch.compiler.is_compiling():
            rows = attn_metadata.decode
            if rows is not None and self.trace_decode:
                key_cache, value_cache = kv_cache
                return attn_metadata.backend.attend_decode(
                    q,
                    k,
                    v,
                    key_cache,
                    value_cache,
                    rows,
                    scale=self.scale,
                    sliding_window=self.sliding_window,
                    soft_cap=self.soft_cap,
                    attention_chunk_size=self.attention_chunk_size,
                    sinks=self.sinks,
                )
            return compiled_ops.attention(q, k, v, self.op_handle)  # runs `run` below
        return self.run(q, k, v, kv_cache, attn_metadata)

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
        kv_written: bool = False,
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        backend = attn_metadata.backend
        source = self.kv_source
        if source is not None:  # the cache holds the source layer's K / V of these tokens
            scales = {"k_scale": source.k_scale, "v_scale": source.v_scale}
        else:
            scales = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        if source is None and not kv_written:
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
            backend.write_kv(k, v, key_cache, value_cache, attn_metadata.slot_mapping, **scales)
        out = backend.attend(
            q,
            key_cache,
            value_cache,
            attn_metadata,
            scale=self.scale,
            sliding_window=self.sliding_window,
            soft_cap=self.soft_cap,
            attention_chunk_size=self.attention_chunk_size,
            alibi_slopes=self.alibi_slopes,
            sinks=self.sinks,
            **scales,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_dim)


class LatentAttention(Attention):
    """Attention over a latent KV cache (multi-head latent attention, models/deepseek_v2.py): one
    KV head of `head_dim` entries a token that is every query head's key, and whose first
    `latent_dim` entries are its value. The layer's (key, value) cache pair holds one tensor
    twice (worker/cache_engine.py `latent_kv`); the output keeps the query's width [T, H*D],
    only each head's first `latent_dim` columns defined.
    """

    def __init__(self, num_heads: int, head_dim: int, latent_dim: int, scale: float) -> None:
        super().__init__(num_heads, head_dim, 1, scale)
        self.latent_dim = latent_dim

    def fused_kv_write(self, kv_cache, attn_metadata) -> None:
        return None  # one latent vector a slot, written by `run`

    # The value is the key: its fp8 scale is the key's (both writes of a slot store one vector).
    @property
    def v_scale(self) -> float:
        return self.k_scale

    @v_scale.setter
    def v_scale(self, value: float) -> None:  # set with k_scale (worker/kv_scales.py)
        pass

    def run(
        self,
        q: torch.Tensor,  # [T, H*D]: absorbed queries
        k: torch.Tensor,  # [T, D]: the latent
        v: torch.Tensor,  # the latent again (unused)
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # one tensor twice
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        latent = k.view(num_tokens, 1, self.head_dim)
        cache = kv_cache[0]
        backend = attn_metadata.backend
        scales = {"k_scale": self.k_scale, "v_scale": self.k_scale}
        backend.write_kv(latent, latent, cache, cache, attn_metadata.slot_mapping, **scales)
        out = backend.attend_latent(
            q,
            cache,
            attn_metadata,
            scale=self.scale,
            latent_dim=self.latent_dim,
            k_scale=self.k_scale,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
