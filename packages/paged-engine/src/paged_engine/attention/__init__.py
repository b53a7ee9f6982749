"""Attention backends behind one interface (`AttentionBackend`), chosen once per engine."""

from __future__ import annotations

import logging

import torch

from paged_engine.attention.backend import AttentionBackend, AttentionMetadata, HostLengths

logger = logging.getLogger(__name__)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "HostLengths",
    "get_attention_backend",
    "resolve_backend_name",
]

BACKENDS = ("cpu", "triton", "torch")


def resolve_backend_name(name: str, device: torch.device) -> str:
    """`name` is EngineConfig.attention_backend: "auto" picks Triton on CUDA (where triton is
    installed), the CPU backend on CPU and the torch reference elsewhere."""
    if name == "auto":
        import paged_kernels

        if device.type == "cpu":
            return "cpu"
        if device.type == "cuda" and paged_kernels.triton_available():
            return "triton"
        return "torch"
    if name not in BACKENDS:
        raise ValueError(
            f"attention_backend={name!r} is invalid: expected 'auto', 'cpu', 'triton' or 'torch'"
        )
    return name


def get_attention_backend(
    name: str,
    device: torch.device,
    *,
    batch_invariant: bool = False,
    head_dim: int | None = None,
) -> AttentionBackend:
    """The backend `resolve_backend_name(name, device)` names. `batch_invariant`
    (EngineConfig.batch_invariant): the CPU and Triton backends have that mode; the torch
    reference does not. `head_dim`: the KV cache's head size; above the Triton kernel's
    MAX_HEAD_DIM (MLA's latent cache: 576) "auto" takes the torch reference instead."""
    import paged_kernels

    too_wide = head_dim is not None and head_dim > paged_kernels.MAX_HEAD_DIM
    if too_wide and resolve_backend_name(name, device) == "triton":
        if name == "triton":
            raise ValueError(
                f"attention_backend='triton' takes head sizes up to {paged_kernels.MAX_HEAD_DIM}; "
                f"this model caches {head_dim} a KV head: use attention_backend 'auto' or 'torch'"
            )
        logger.warning(
            "the KV cache's head size %d is above the Triton kernel's %d: attention runs on the "
            "torch reference (correct, not fast; no CUDA graphs)",
            head_dim,
            paged_kernels.MAX_HEAD_DIM,
        )
        name = "torch"
    name = resolve_backend_name(name, device)
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on the CPU only, not on {device}")
        from paged_engine.attention.cpu_backend import CpuBackend

        return CpuBackend(batch_invariant=batch_invariant)
    if name == "triton":
        from paged_kernels._utils import is_interpreter

        if device.type != "cuda" and not is_interpreter():
            raise ValueError(
                f"attention_backend='triton' on {device.type} needs Triton's interpreter: set "
                "TRITON_INTERPRET=1 before paged_kernels is imported (slow; for tests), or use "
                "attention_backend='cpu'"
            )
        from paged_engine.attention.triton_backend import TritonBackend

        return TritonBackend(batch_invariant=batch_invariant)
    if batch_invariant:
        raise ValueError(
            f"batch_invariant=True needs attention_backend 'cpu' or 'triton'; got {name!r} on "
            f"{device.type} (the torch reference has no fixed-reduction-order mode)"
        )
    from paged_engine.attention.torch_backend import TorchBackend

    return TorchBackend()
