"""Rotary position embedding (RoPE) with explicit positions.

Supports partial rotary (only the first `rotary_dim` of each head rotates, GPT-NeoX), NeoX
style (rotate halves) or GPT-J style (rotate interleaved pairs), and the `linear` and `llama3`
frequency scalings. cos/sin are precomputed in float32 for `max_position` positions.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth band between."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        is_neox_style: bool = True,
        rope_scaling: dict[str, Any] | None = None,
        freq_factors: list[float] | None = None,
    ) -> None:
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"bad rotary_dim={rotary_dim} for head_dim={head_dim}")
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        self.is_neox_style = is_neox_style
        # float32 like the HF reference, so angles agree bit-for-bit at long positions
        exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        inv_freq = 1.0 / (base**exps)
        positions = torch.arange(max_position, dtype=torch.float32)
        rope_type = (rope_scaling or {}).get("rope_type") or (rope_scaling or {}).get("type")
        if rope_type in (None, "default"):
            pass
        elif rope_type == "linear":
            positions = positions / float(rope_scaling["factor"])
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
        else:
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}")
        if freq_factors is not None:  # GGUF `rope_freqs`: per-frequency divisors (Llama 3.1)
            if len(freq_factors) != len(inv_freq):
                raise ValueError(f"{len(freq_factors)} rope freq factors for {len(inv_freq)} freqs")
            inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [P, rotary_dim/2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H, D]; cos, sin: [T, 1, rotary_dim/2] float32
        rot, rest = x[..., : self.rotary_dim].float(), x[..., self.rotary_dim :]
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        if self.is_neox_style:
            out = torch.cat((o1, o2), dim=-1)
        else:
            out = torch.stack((o1, o2), dim=-1).flatten(-2)
        return torch.cat((out.to(x.dtype), rest), dim=-1)

    def begin_forward(self, positions: torch.Tensor) -> None:
        """Gather this forward's tables once for all layers (the model calls it first thing in
        every forward, so a table never outlives its positions): `rotate_heads` reads them.

        NeoX style over the whole head: out = x * [cos, cos] + swap_halves(x) * [-sin, sin],
        the same products and sums as `_rotate` (x1*cos + x2*(-sin) == x1*cos - x2*sin exactly).
        """
        if not (self.is_neox_style and self.rotary_dim == self.head_dim):
            self._tables = None
            return
        cos, sin = self.cos[positions], self.sin[positions]  # [T, D/2]
        self._tables = (
            positions,
            torch.cat((cos, cos), dim=-1).unsqueeze(1),  # [T, 1, D] float32
            torch.cat((-sin, sin), dim=-1).unsqueeze(1),
        )

    _tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def rotate_heads(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """x: [T, N, D] (q and k heads side by side, maybe a strided view) -> rotated [T, N, D]
        in x's dtype, or None when `begin_forward` did not prepare tables for `positions`."""
        tables = self._tables
        if tables is None or tables[0] is not positions:
            return None
        _, cos, sin = tables
        t, n, d = x.shape
        xf = x.float()
        swapped = xf.view(t, n, 2, d // 2).flip(2).view(t, n, d)  # [x2, x1]
        return (xf * cos + swapped * sin).to(x.dtype)

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        q: torch.Tensor,  # [T, H*D]
        k: torch.Tensor,  # [T, Hkv*D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        t = q.shape[0]
        q = self._rotate(q.view(t, -1, self.head_dim), cos, sin).reshape(t, -1)
        k = self._rotate(k.view(t, -1, self.head_dim), cos, sin).reshape(t, -1)
        return q, k


def rope_config(config: Any) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, rope_scaling or None, partial_rotary_factor) from an HF config of any age.

    transformers >= 5 keeps all of it in `rope_parameters`; older versions use `rope_theta`,
    `rope_scaling` and (GPT-NeoX) `rotary_emb_base` / `rotary_pct`.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if legacy and not params:
        params = dict(legacy)
    theta = params.get("rope_theta")
    if theta is None:
        theta = getattr(config, "rope_theta", None) or getattr(config, "rotary_emb_base", None)
    partial = params.get("partial_rotary_factor")
    if partial is None:
        partial = getattr(config, "partial_rotary_factor", None) or getattr(
            config, "rotary_pct", None
        )
    rope_type = params.get("rope_type") or params.get("type")
    scaling = params if rope_type not in (None, "default") else None
    return float(theta or 10000.0), scaling, float(partial or 1.0)


def get_rope(config: Any, head_dim: int, is_neox_style: bool = True) -> RotaryEmbedding:
    theta, scaling, partial = rope_config(config)
    return RotaryEmbedding(
        head_dim=head_dim,
        rotary_dim=int(head_dim * partial),
        max_position=int(config.max_position_embeddings),
        base=theta,
        is_neox_style=is_neox_style,
        rope_scaling=scaling,
        freq_factors=getattr(config, "rope_freq_factors", None),
    )
