"""Normalization layers. Statistics are computed in float32 whatever the activation dtype.

`kernel`, when set (batch_invariant=True on the Triton path, layers/batch_invariant.py), replaces
the torch ops with paged_kernels.rms_norm / layer_norm: the same roundings, one program per row.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight; `weight_offset=1` serves checkpoints that store (weight - 1)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(torch.ones(hidden_size))

    kernel: Callable[..., torch.Tensor] | None = None  # (x, weight, eps, weight_offset)
    # 16-bit inputs: the normalised row rounds to x's dtype before the weight (Llama's); False
    # where the fp32 product rounds once (Gemma's, OLMo 2's): what `rms_norm_kernel` passes on
    round_before_weight = True
    # (x, residual, weight, eps) -> (norm(x + residual), x + residual): triton_layers.py
    add_kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x + residual), x + residual): a pre-norm decoder's residual add and the norm
        after it, in one kernel where `add_kernel` is set (the same roundings)."""
        if self.add_kernel is not None and x.shape == residual.shape and x.dtype == residual.dtype:
            return self.add_kernel(x, residual, self.weight, self.eps)
        total = x + residual
        return self(total), total

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., D]
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps, self.weight_offset)
        # torch.rms_norm computes x * rsqrt(mean(x^2) + eps) with the same bits as HF (same
        # float32 reduction). The weight multiplies the result cast back to the input dtype,
        # as HF does: fused into the norm only when that cast is a no-op.
        if x.dtype == torch.float32 and not self.weight_offset:
            if x.device.type == "cpu":
                return self._cpu_float32(x)
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        y = torch.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)
        if self.weight_offset:
            return (self.weight + self.weight_offset) * y
        return self.weight * y

    def _cpu_float32(self, x: torch.Tensor) -> torch.Tensor:
        """torch.rms_norm's CPU composite, op for op (the same bits), with its two scalars as
        float32 tensors: `mean` divides by a Python number, which ATen wraps in a double tensor
        and casts for every call (~30% of a decode step's norm time)."""
        consts = self._consts
        if consts is None:
            self._consts = consts = (
                torch.tensor(float(x.shape[-1]), dtype=torch.float32),
                torch.tensor(self.eps, dtype=torch.float32),
            )
        size, eps = consts
        var = x.pow(2).sum(-1, keepdim=True).div_(size).add_(eps)
        return x.mul(var.rsqrt_()).mul_(self.weight)

    _consts: tuple[torch.Tensor, torch.Tensor] | None = None


class UnitRMSNorm(nn.Module):
    """x / rms(x) in float32, rounded to x's dtype: an RMSNorm without a weight."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D]
        return torch.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


def rms_norm_kernel(norm: RMSNorm) -> Callable[..., torch.Tensor]:
    """paged_kernels.rms_norm rounding as `norm` does (`round_before_weight`): the kernel the
    Triton backend and batch-invariant mode give a norm of this kind."""
    from paged_kernels import rms_norm

    if norm.round_before_weight:
        return rms_norm
    return functools.partial(rms_norm, round_before_weight=False)


class GemmaRMSNorm(RMSNorm):
    """Gemma's y = x / rms(x) * (1 + weight), all in float32, rounded to x's dtype once at the
    end (a Llama RMSNorm rounds before the weight); its kernel rounds so too."""

    round_before_weight = False

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps, weight_offset=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., D]
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps, self.weight_offset)
        y = torch.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm computed in float32, returned in the input dtype."""

    kernel: Callable[..., torch.Tensor] | None = None  # (x, weight, bias, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., D]
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.bias, self.eps)
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        y = nn.functional.layer_norm(x.float(), self.normalized_shape, w, b, self.eps)
        return y.to(x.dtype)


class LayerNorm1P(LayerNorm):
    """Nemotron's LayerNorm1P: checkpoints store (weight - 1), y = norm(x) * (1 + weight) + bias
    (the 1 added in the weight's dtype, as HF adds it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., D]
        w = self.weight + 1.0
        if self.kernel is not None:
            return self.kernel(x, w, self.bias, self.eps)
        b = None if self.bias is None else self.bias.float()
        y = nn.functional.layer_norm(x.float(), self.normalized_shape, w.float(), b, self.eps)
        return y.to(x.dtype)


class HeadLayerNorm(LayerNorm):
    """Bias-free LayerNorm over each head of x [T, H, D] with one weight row per head, for this
    rank's H heads: rows [shard * H, (shard + 1) * H) of the model's [H_total, D] weights.

    Loads either the whole [H_total, D] tensor (Cohere's `q_norm.weight`) or one head's [D] row
    with its head index as shard id (StableLM's `norms.{h}.weight`; another rank's heads are
    skipped). A LayerNorm, so batch-invariant mode hands it its kernel (which normalizes; the
    per-head weight multiplies after, in float32 like the rest)."""

    def __init__(self, num_heads: int, head_dim: int, eps: float, shard: int) -> None:
        super().__init__(head_dim, eps=eps, elementwise_affine=False)
        self.weight = nn.Parameter(torch.ones(num_heads, head_dim))
        self.weight.weight_loader = self._load
        self.shard = shard

    def _load(self, param: nn.Parameter, w: torch.Tensor, shard_id: int | None = None) -> None:
        n, d = param.shape
        if shard_id is not None:  # one head's row
            if tuple(w.shape) != (d,):
                raise ValueError(f"per-head norm weight {tuple(w.shape)}, expected ({d},)")
            row = int(shard_id) - self.shard * n
            if 0 <= row < n:
                param.data[row].copy_(w)
            return
        if w.dim() != 2 or w.shape[1] != d or w.shape[0] < (self.shard + 1) * n:
            raise ValueError(f"norm weight {tuple(w.shape)} has no rows for shard {self.shard}")
        param.data.copy_(w[self.shard * n : (self.shard + 1) * n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, H, D]
        xf = x.float()
        if self.kernel is not None:
            y = self.kernel(xf, None, None, self.eps)
        else:
            y = nn.functional.layer_norm(xf, self.normalized_shape, None, None, self.eps)
        return (y * self.weight.float()).to(x.dtype)
