"""Manifold-constrained hyper-connections (DeepSeek-V4, models/deepseek_v4.py), as
transformers runs them: the residual stream is hc_mult streams [T, N, D]. Before a sublayer a
float32 map of the RMS-normed flattened streams gives pre = sigmoid + hc_eps, post = 2 sigmoid
and comb = softmax + hc_eps, made doubly stochastic by hc_sinkhorn_iters Sinkhorn steps (columns
first); the sublayer runs on sum_i pre_i x_i and the caller sets the streams to
post_j * out + sum_i comb_ij x_i. `HyperHead` collapses them with pre weights alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) without a weight, the factor rounded to x's dtype (HF's unweighted norm)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def fp32_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32))


class HyperConnection(nn.Module):
    """One sublayer's hyper-connection weights (`fn`, `base`, `scale` of a layer's `hc_attn_*`
    or `hc_ffn_*`). streams [T, N, D] -> (post [T, N], comb [T, N, N], collapsed [T, D])."""

    def __init__(self, config) -> None:
        super().__init__()
        n = self.n = int(config.hc_mult)
        self.iters, self.hc_eps = int(config.hc_sinkhorn_iters), float(config.hc_eps)
        self.eps = float(config.rms_norm_eps)
        self.fn = fp32_param((2 + n) * n, n * config.hidden_size)
        self.base, self.scale = fp32_param((2 + n) * n), fp32_param(3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, eps = self.n, self.hc_eps
        mixes = F.linear(unit_rms(x.flatten(1).float(), self.eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = comb_w.view(-1, n, n) * self.scale[2] + comb_b.view(n, n)
        comb = torch.softmax(comb, dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(self.iters - 1):  # Sinkhorn: rows, then columns, sum to 1
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        collapsed = (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
        return post, comb, collapsed


class HyperHead(nn.Module):
    """`hc_head`: the final collapse of the streams [T, N, D] -> [T, D] (pre weights only)."""

    def __init__(self, config) -> None:
        super().__init__()
        n = int(config.hc_mult)
        self.hc_eps, self.eps = float(config.hc_eps), float(config.rms_norm_eps)
        self.hc_fn = fp32_param(n, n * config.hidden_size)
        self.hc_base, self.hc_scale = fp32_param(n), fp32_param(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unit_rms(x.flatten(1).float(), self.eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
