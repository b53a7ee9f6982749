"""The Triton backend: paged_kernels' JIT kernels (CUDA, or Triton's interpreter on CPU).

Given max_seqlen_q / max_seqlen_k from the host, the kernels never read device memory on the
host, so a decode forward through them can be captured in a CUDA graph. `batch_invariant=True`
runs the attention kernel in its fixed-config, never-split mode (paged_kernels.paged_attention).
"""

from __future__ import annotations

import functools

from paged_engine.attention.backend import KernelBackend


class TritonBackend(KernelBackend):
    name = "triton"
    cuda_graph_capturable = True

    def __init__(self, batch_invariant: bool = False) -> None:
        # Imported here: triton is optional where only the torch backend runs.
        from paged_kernels import copy_blocks, paged_attention, write_kv_cache

        attention = paged_attention
        if batch_invariant:
            attention = functools.partial(paged_attention, batch_invariant=True)
        super().__init__(write_kv_cache, attention, copy_blocks, max_seqlens=True)
