"""What the hybrid models' linear mixers share (Gated DeltaNet, Kimi Delta Attention, Mamba2,
LFM2's short conv): the head-count and activation check, the depthwise conv's parameters, and
the per-sequence state pools.

A mixer's `state_shapes(num_slots)` gives its conv window's shape `[slots, C, K - 1]` and, but
for a conv-only mixer, its matrix state's; `allocate_state` (the worker calls it:
worker/recurrent_state.py) makes the pools, plain tensors rather than buffers (no state_dict
entry), the conv window in the model dtype and the matrix state in `ssm_dtype`.
"""

from __future__ import annotations

import torch
from torch import nn


def check_mixer(name: str, act: str | None, tp: int, **counts: int) -> None:
    """A linear mixer's head counts split over `tp` ranks, and its activation (None: not
    configurable) is SiLU."""
    for what, n in counts.items():
        if n % tp:
            raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={tp}")
    if act is not None and act not in ("silu", "swish"):
        raise ValueError(f"{name} supports the 'silu' activation only, got {act!r}")


class DepthwiseConv(nn.Module):
    """A depthwise conv's parameters under HF's names (`weight` [C, 1, K], `bias`): Gated
    DeltaNet's and Mamba2's `conv1d`, LFM2's short `conv`."""

    def __init__(self, channels: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None


class LinearMixer(nn.Module):
    """A mixer carrying per-sequence state (module docstring); subclasses give `state_shapes`."""

    conv_state: torch.Tensor | None = None  # [slots, C, K - 1]
    ssm_state: torch.Tensor | None = None  # [slots, ...]; None for a conv-only mixer

    def state_shapes(self, num_slots: int) -> tuple[tuple[int, ...], ...]:
        raise NotImplementedError

    def run_conv(
        self,
        conv: DepthwiseConv,
        x: torch.Tensor,  # [T, C]
        md,
        slots: torch.Tensor,
        has_state: torch.Tensor,
        activation: str | None = "silu",
    ) -> torch.Tensor:
        """x through the causal depthwise `conv` over this layer's conv windows (updated in
        place: each sequence's last K - 1 inputs), on the step's backend: [T, C]."""
        return md.backend.causal_conv1d(
            x,
            conv.weight.squeeze(1),
            conv.bias,
            self.conv_state,
            md.cu_seqlens_q,
            slots,
            has_state,
            activation=activation,
        )

    def allocate_state(
        self, num_slots: int, dtype: torch.dtype, ssm_dtype: torch.dtype, device: torch.device
    ) -> None:
        conv, *ssm = self.state_shapes(num_slots)
        self.conv_state = torch.zeros(conv, dtype=dtype, device=device)
        if ssm:
            self.ssm_state = torch.zeros(ssm[0], dtype=ssm_dtype, device=device)
