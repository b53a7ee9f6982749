"""The Triton backend: paged_kernels' JIT kernels (CUDA, or Triton's interpreter on CPU).

Given max_seqlen_q / max_seqlen_k from the host, the kernels never read device memory on the
host, so a decode forward through them can be captured in a CUDA graph. `batch_invariant=True`
runs the attention kernel in its fixed-config, never-split mode (paged_kernels.paged_attention).
"""

from __future__ import annotations

import functools

import torch

from paged_engine.attention.backend import AttentionMetadata, KernelBackend


class TritonBackend(KernelBackend):
    name = "triton"
    cuda_graph_capturable = True
    rope_writes_kv = True

    def __init__(self, batch_invariant: bool = False) -> None:
        # Imported here: triton is optional where only the torch backend runs.
        from paged_kernels import copy_blocks, paged_attention, write_kv_cache

        attention = paged_attention
        if batch_invariant:
            attention = functools.partial(paged_attention, batch_invariant=True)
        super().__init__(write_kv_cache, attention, copy_blocks, max_seqlens=True)
        self.batch_invariant = batch_invariant

    def attend_latent(
        self,
        query: torch.Tensor,
        cache: torch.Tensor,
        md: AttentionMetadata,
        *,
        scale: float,
        latent_dim: int,
        k_scale: float = 1.0,
    ) -> torch.Tensor:
        """paged_kernels.mla_attention: the latent head in two tiles (latent, rope), as wide
        as it is (576 for DeepSeek-V3: above paged_attention's MAX_HEAD_DIM)."""
        from paged_kernels import mla_attention

        return mla_attention(
            query,
            cache,
            md.block_tables,
            md.cu_seqlens_q,
            md.seq_lens,
            scale,
            latent_dim=latent_dim,
            max_seqlen_q=md.max_seqlen_q,
            max_seqlen_k=md.max_seqlen_k,  # decode may split the keys (no host read)
            k_scale=k_scale,
            out=torch.empty_like(query),
            batch_invariant=self.batch_invariant,
        )

    def causal_conv1d(
        self, x, weight, bias, conv_state, cu_seqlens, state_slots, has_initial_state, *, activation
    ) -> torch.Tensor:
        from paged_kernels import causal_conv1d

        return causal_conv1d(
            x, weight, bias, conv_state, cu_seqlens, state_slots, has_initial_state, activation
        )

    def gated_delta_rule(
        self, q, k, v, g, beta, ssm_state, cu_seqlens, state_slots, has_initial_state
    ) -> torch.Tensor:
        from paged_kernels import gated_delta_rule

        return gated_delta_rule(
            q, k, v, g, beta, ssm_state, cu_seqlens, state_slots, has_initial_state
        )

    def ssd_scan(
        self, x, dt, A, B, C, ssm_state, cu_seqlens, state_slots, has_initial_state
    ) -> torch.Tensor:
        from paged_kernels import ssd_scan

        return ssd_scan(x, dt, A, B, C, ssm_state, cu_seqlens, state_slots, has_initial_state)

    def selective_scan(
        self, x, dt, A, B, C, ssm_state, cu_seqlens, state_slots, has_initial_state
    ) -> torch.Tensor:
        from paged_kernels import selective_scan

        return selective_scan(x, dt, A, B, C, ssm_state, cu_seqlens, state_slots, has_initial_state)
