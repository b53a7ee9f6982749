"""Normalization layers. Statistics are computed in float32 whatever the activation dtype."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight; `weight_offset=1` serves checkpoints that store (weight - 1)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., D]
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight + self.weight_offset) * xf.to(dtype)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm computed in float32, returned in the input dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., D]
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        y = nn.functional.layer_norm(x.float(), self.normalized_shape, w, b, self.eps)
        return y.to(x.dtype)
