"""Attention backends behind one interface (`AttentionBackend`), chosen once per engine."""

from __future__ import annotations

import torch

from paged_engine.attention.backend import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`name` is EngineConfig.attention_backend: "auto" picks Triton on CUDA (where triton is
    installed) and the torch reference elsewhere."""
    if name == "auto":
        import paged_kernels

        cuda_triton = device.type == "cuda" and paged_kernels.triton_available()
        name = "triton" if cuda_triton else "torch"
    if name == "triton":
        from paged_engine.attention.triton_backend import TritonBackend

        return TritonBackend()
    if name == "torch":
        from paged_engine.attention.torch_backend import TorchBackend

        return TorchBackend()
    raise ValueError(f"attention_backend={name!r} is invalid: expected 'auto', 'triton' or 'torch'")
