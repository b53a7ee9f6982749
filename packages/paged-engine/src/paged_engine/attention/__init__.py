"""Attention backends behind one interface (`AttentionBackend`), chosen once per engine."""

from __future__ import annotations

import torch

from paged_engine.attention.backend import AttentionBackend, AttentionMetadata, HostLengths

__all__ = ["AttentionBackend", "AttentionMetadata", "HostLengths", "get_attention_backend"]


def get_attention_backend(
    name: str, device: torch.device, *, batch_invariant: bool = False
) -> AttentionBackend:
    """`name` is EngineConfig.attention_backend: "auto" picks Triton on CUDA (where triton is
    installed), the CPU backend on CPU and the torch reference elsewhere. `batch_invariant`
    (EngineConfig.batch_invariant): only the CPU backend has that mode so far."""
    if name == "auto":
        import paged_kernels

        if device.type == "cpu":
            name = "cpu"
        elif device.type == "cuda" and paged_kernels.triton_available():
            name = "triton"
        else:
            name = "torch"
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on the CPU only, not on {device}")
        from paged_engine.attention.cpu_backend import CpuBackend

        return CpuBackend(batch_invariant=batch_invariant)
    if batch_invariant:
        raise ValueError(
            f"batch_invariant=True needs attention_backend='cpu' (device cpu); got {name!r} on "
            f"{device.type} (the Triton kernels have no fixed-reduction-order mode yet)"
        )
    if name == "triton":
        from paged_engine.attention.triton_backend import TritonBackend

        return TritonBackend()
    if name == "torch":
        from paged_engine.attention.torch_backend import TorchBackend

        return TorchBackend()
    raise ValueError(
        f"attention_backend={name!r} is invalid: expected 'auto', 'cpu', 'triton' or 'torch'"
    )
