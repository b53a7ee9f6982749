"""The plain-torch backend: paged_kernels' reference implementations (any device, no Triton).

It reads sequence lengths on the host, so it is never captured in a CUDA graph.
"""

from __future__ import annotations

import paged_kernels
from paged_engine.attention.backend import KernelBackend


class TorchBackend(KernelBackend):
    name = "torch"
    cuda_graph_capturable = False

    def __init__(self) -> None:
        super().__init__(
            paged_kernels.ref_write_kv_cache,
            paged_kernels.ref_paged_attention,
            paged_kernels.ref_copy_blocks,
            max_seqlens=False,
        )
