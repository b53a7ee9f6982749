"""The attention-backend interface: one object per engine decides how KV is laid out, written,
read and copied, and whether a forward through it can be captured in a CUDA graph.

The model's `Attention` layers call `metadata.backend.write_kv` and `.attend`; the worker builds
the metadata through `build_metadata`, allocates the cache in `kv_cache_shape` and runs
copy-on-write through `copy_blocks`. No other module branches on which backend is in use.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(slots=True)
class HostLengths:
    """Host (numpy) copies of the step's batch layout, which the worker has before the forward:
    backends that plan on the host (the CPU backend) read these instead of device tensors."""

    cu_seqlens_q: np.ndarray  # [S+1]
    seq_lens: np.ndarray  # [S]
    block_tables: np.ndarray  # [S, max_blocks]
    slot_mapping: np.ndarray  # [T], -1 = padding
    key_ends: np.ndarray | None = None  # [T]: AttentionMetadata.key_ends on the host


@dataclass(slots=True)
class AttentionMetadata:
    """Everything an attention layer needs for one forward; built by the worker."""

    slot_mapping: torch.Tensor  # [T] int64, -1 = padding token (not written)
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with the null block 0
    cu_seqlens_q: torch.Tensor  # [S+1] int32
    seq_lens: torch.Tensor  # [S] int32 (context incl. this step's tokens)
    max_seqlen_q: int
    max_seqlen_k: int
    backend: AttentionBackend
    plan: Any = None  # a backend's per-step precomputation (index tensors, masks), or None
    # [T] int32: token t at position p sees keys k <= max(p, key_ends[t] - 1), the whole of its
    # image (Gemma 3's bidirectional image attention at prefill); None = causal. A step that has
    # it runs eagerly.
    key_ends: torch.Tensor | None = None
    # A decode step under the CPU's compiled forward: its rows' inputs for
    # `CpuBackend.attend_decode`, which the graph traces (worker/cpu_compile.py); else None.
    decode: Any = None
    # Hybrid models (layers/gated_delta_net.py): each sequence's recurrent-state row [S] int64
    # (-1: a padding row) and whether it continues that row's state [S] bool (False: it starts
    # at position 0). None outside hybrid models and in stand-alone forwards (profiling).
    state_slots: torch.Tensor | None = None
    has_initial_state: torch.Tensor | None = None
    # Hybrid models: each sequence's prompt length [S] int64; its tokens at positions from there
    # on are generated ones (Mamba2's dt clamp tells them apart). None where state_slots is.
    prompt_lens: torch.Tensor | None = None

    def state_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(state_slots, has_initial_state); in a stand-alone forward (memory profiling, where
        the worker sets neither) sequence i uses row i from a fresh state."""
        if self.state_slots is not None and self.has_initial_state is not None:
            return self.state_slots, self.has_initial_state
        num_seqs, device = self.seq_lens.shape[0], self.seq_lens.device
        return (
            torch.arange(num_seqs, dtype=torch.int64, device=device),
            torch.zeros(num_seqs, dtype=torch.bool, device=device),
        )


class AttentionBackend(ABC):
    """Contract: `write_kv` stores the step's K/V at `slot_mapping` (skipping slot -1) before
    `attend` of the same layer reads the cache; `attend` is causal within each sequence's new
    rows and sees its whole context through the block table; `copy_blocks` copies whole blocks
    of every layer. `cuda_graph_capturable` backends read no device memory on the host.

    An fp8 cache (float8_e4m3fn / float8_e5m2) holds key / k_scale and value / v_scale (the
    layer's per-tensor scales, fixed before the first write); `attend` dequantizes what it
    reads. Any other cache dtype takes scales of exactly 1.0.

    `sliding_window` W: a query at position p sees keys p - W < k <= p. `attention_chunk_size` C
    (Llama 4's chunked local attention): keys p - p % C <= k <= p. None = the whole context.

    `md.key_ends` (Gemma 3's images): a query at position p sees keys up to
    max(p, key_ends[t] - 1), the window and chunk lower bounds unchanged.

    `sinks` (gpt-oss): [H] float raw logits, one per query head, that join every row's softmax
    denominator and add nothing to its output (`ref_paged_attention`); None = none. A backend
    that cannot honour them raises, never drops them."""

    name: str
    cuda_graph_capturable: bool = False
    # `write_kv` is paged_kernels.write_kv_cache: a layer whose rope runs paged_kernels.rope_qk_
    # may have that kernel store its K/V instead, in the same launch (Attention.fused_kv_write).
    rope_writes_kv: bool = False

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """Shape of one layer's key (and value) cache; slot = block_id * block_size + offset."""
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def build_metadata(
        self,
        *,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        host: HostLengths | None = None,
        key_ends: torch.Tensor | None = None,
    ) -> AttentionMetadata:
        """`host`: the same layout as numpy arrays, when the caller has it (backends that plan
        on the host use it; the kernels read the tensors)."""
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            cu_seqlens_q=cu_seqlens_q,
            seq_lens=seq_lens,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            backend=self,
            key_ends=key_ends,
        )

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None: ...

    @abstractmethod
    def attend(
        self,
        query: torch.Tensor,  # [T, H, D]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None,
        soft_cap: float | None,
        attention_chunk_size: int | None = None,
        alibi_slopes: torch.Tensor | None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sinks: torch.Tensor | None = None,  # [H] float
    ) -> torch.Tensor:  # [T, H, D]
        ...

    def attend_latent(
        self,
        query: torch.Tensor,  # [T, H, D]: absorbed MLA queries
        cache: torch.Tensor,  # one latent head: every head's key, its first columns the value
        md: AttentionMetadata,
        *,
        scale: float,
        latent_dim: int,
        k_scale: float = 1.0,
    ) -> torch.Tensor:  # [T, H, D]; only the first latent_dim columns are defined
        """Attention over a latent cache (models/deepseek_v2.py). By default the cache serves as
        both K and V of `attend` (a D-wide output); a backend may run a latent kernel instead."""
        return self.attend(
            query,
            cache,
            cache,
            md,
            scale=scale,
            sliding_window=None,
            soft_cap=None,
            alibi_slopes=None,
            k_scale=k_scale,
            v_scale=k_scale,
        )

    @abstractmethod
    def copy_blocks(
        self,
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
        mapping: torch.Tensor,  # [P, 2] int64 (src, dst)
    ) -> None: ...

    # Linear attention (layers/gated_delta_net.py): paged_kernels' torch references by default.
    def causal_conv1d(
        self,
        x: torch.Tensor,  # [T, C]
        weight: torch.Tensor,  # [C, K]
        bias: torch.Tensor | None,
        conv_state: torch.Tensor,  # [slots, C, K - 1], updated in place
        cu_seqlens: torch.Tensor,
        state_slots: torch.Tensor,
        has_initial_state: torch.Tensor,
        *,
        activation: str | None,
    ) -> torch.Tensor:  # [T, C]
        from paged_kernels import ref_causal_conv1d

        return ref_causal_conv1d(
            x, weight, bias, conv_state, cu_seqlens, state_slots, has_initial_state, activation
        )

    def gated_delta_rule(
        self,
        q: torch.Tensor,  # [T, Hk, Dk]
        k: torch.Tensor,  # [T, Hk, Dk]
        v: torch.Tensor,  # [T, Hv, Dv]
        g: torch.Tensor,  # [T, Hv] (a decay per head) or [T, Hv, Dk] (per key channel) fp32 log
        beta: torch.Tensor,  # [T, Hv]
        ssm_state: torch.Tensor,  # [slots, Hv, Dk, Dv], updated in place
        cu_seqlens: torch.Tensor,
        state_slots: torch.Tensor,
        has_initial_state: torch.Tensor,
    ) -> torch.Tensor:  # [T, Hv, Dv]
        from paged_kernels import ref_gated_delta_rule

        return ref_gated_delta_rule(
            q, k, v, g, beta, ssm_state, cu_seqlens, state_slots, has_initial_state
        )

    def ssd_scan(
        self,
        x: torch.Tensor,  # [T, H, P]
        dt: torch.Tensor,  # [T, H] float32 step sizes
        A: torch.Tensor,  # [H] float32, negative
        B: torch.Tensor,  # [T, G, N]
        C: torch.Tensor,  # [T, G, N]
        ssm_state: torch.Tensor,  # [slots, H, P, N], updated in place
        cu_seqlens: torch.Tensor,
        state_slots: torch.Tensor,
        has_initial_state: torch.Tensor,
    ) -> torch.Tensor:  # [T, H, P] float32
        """Mamba2's selective scan (layers/mamba2.py)."""
        from paged_kernels import ref_ssd_scan

        return ref_ssd_scan(x, dt, A, B, C, ssm_state, cu_seqlens, state_slots, has_initial_state)

    def selective_scan(
        self,
        x: torch.Tensor,  # [T, D]
        dt: torch.Tensor,  # [T, D] float32 step sizes
        A: torch.Tensor,  # [D, N] float32, negative
        B: torch.Tensor,  # [T, N]
        C: torch.Tensor,  # [T, N]
        ssm_state: torch.Tensor,  # [slots, D, N], updated in place
        cu_seqlens: torch.Tensor,
        state_slots: torch.Tensor,
        has_initial_state: torch.Tensor,
    ) -> torch.Tensor:  # [T, D] float32
        """Mamba1's selective scan (Mamba, Falcon Mamba, Jamba's mamba layers)."""
        from paged_kernels import ref_selective_scan

        return ref_selective_scan(
            x, dt, A, B, C, ssm_state, cu_seqlens, state_slots, has_initial_state
        )


class KernelBackend(AttentionBackend):
    """A backend made of paged_kernels' three entry points, which the Triton kernels and their
    torch references share: write_kv_cache, paged_attention, copy_blocks. `max_seqlens`: pass
    max_seqlen_q / max_seqlen_k from the metadata (so the kernel reads no lengths on the host)."""

    def __init__(self, write, attention, copy, *, max_seqlens: bool) -> None:
        self._write, self._attention, self._copy = write, attention, copy
        self._max_seqlens = max_seqlens

    def write_kv(
        self, key, value, key_cache, value_cache, slot_mapping, *, k_scale=1.0, v_scale=1.0
    ) -> None:
        self._write(
            key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale
        )

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
        attention_chunk_size: int | None = None,
        alibi_slopes: torch.Tensor | None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        extra: dict[str, Any] = (
            {"max_seqlen_q": md.max_seqlen_q, "max_seqlen_k": md.max_seqlen_k}
            if self._max_seqlens
            else {}
        )
        if md.key_ends is not None:
            extra["key_ends"] = md.key_ends
        return self._attention(
            query,
            key_cache,
            value_cache,
            md.block_tables,
            md.cu_seqlens_q,
            md.seq_lens,
            scale,
            sliding_window=sliding_window,
            attention_chunk_size=attention_chunk_size,
            soft_cap=soft_cap,
            alibi_slopes=alibi_slopes,
            k_scale=k_scale,
            v_scale=v_scale,
            sinks=sinks,
            **extra,
        )

    def copy_blocks(self, key_caches, value_caches, mapping) -> None:
        self._copy(key_caches, value_caches, mapping)
