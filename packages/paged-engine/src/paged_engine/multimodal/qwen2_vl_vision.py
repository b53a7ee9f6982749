"""The vision encoder ("visual") of Qwen2-VL and Qwen2.5-VL, in HF's weight names.

    pixel_values [P, C*tp*p*p]  (P = sum of t*h*w patches; each image's patches in merge-block
        order: the m*m patches of one merged token are consecutive, blocks row-major, frames last)
        -> patch_embed.proj (a bias-free Conv3d whose kernel is the whole patch: one matmul)
        -> blocks: x = x + attn(norm1(x), 2D rope);  x = x + mlp(norm2(x))
        -> merger: ln_q per patch -> each m*m consecutive patches concatenated
            -> mlp.0 Linear -> GELU -> mlp.2 Linear
        -> [P / m**2, out_dim]  (each image's rows contiguous, in the input's order)

                    Qwen2-VL (model_type qwen2_vl)        Qwen2.5-VL (qwen2_5_vl)
    width           embed_dim                              hidden_size
    norms, ln_q     LayerNorm (eps 1e-6)                   RMSNorm (eps 1e-6)
    mlp             fc1 -> hidden_act -> fc2 (mlp_ratio)   down(act(gate) * up), all with bias
    attention       within each frame                      within each frame for the blocks in
                                                           fullatt_block_indexes, else within
                                                           windows of window_size pixels
    out_dim         hidden_size                            out_hidden_size

Rotary: head_dim / 4 frequencies (theta 10000) rotate by a patch's row and as many by its column;
the angles [row freqs | column freqs] fill half the head and repeat over the other half
(rotate-half pairing), computed and applied in float32.

Attention segments are sets of patch rows: a frame is a contiguous range; a window is the merged
tokens of a window_size x window_size pixel square of one frame (the squares at the right and
bottom edges partial), i.e. its patches in ascending order. HF instead permutes the whole
sequence into window order before the blocks and back after the merger; each window then holds
the same patches in the same order, so the sums are the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.norm import RMSNorm
from paged_engine.models.utils import load_named_weights

# vision_config.model_type -> variant (transformers 5 names the sub-config "*_vision")
VARIANTS = {
    "qwen2_vl": "qwen2_vl",
    "qwen2_vl_vision": "qwen2_vl",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen2_5_vl_vision": "qwen2_5_vl",
    "qwen2_5_omni_vision_encoder": "qwen2_5_vl",  # Qwen2.5-Omni's thinker (qwen_omni.py)
}
_NORM_EPS = 1e-6  # HF hard-codes it for every norm of the tower


def _int_field(config, name: str, default: int | None = None) -> int:
    value = getattr(config, name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"vision_config.{name}={value!r} is not supported: a positive int")
    return value


def _rope_theta(config) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    kind = rope.get("rope_type", "axial")
    if kind not in ("axial", "default"):
        raise ValueError(
            f"vision_config.rope_parameters.rope_type={kind!r} is not supported: 'axial'"
        )
    return float(rope.get("rope_theta", 10000.0))


def _segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: list[torch.Tensor]
) -> torch.Tensor:
    """q, k, v: [P, H, D]; groups: [n, L] row indices, n segments of L rows each (every row in
    exactly one segment). Each row attends to the rows of its own segment only."""
    out = torch.empty_like(q)
    for index in groups:
        n, length = index.shape
        rows = index.reshape(-1)
        q_s, k_s, v_s = (t[rows].view(n, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q_s, k_s, v_s)  # [n, H, L, D], scale 1/sqrt(D)
        out[rows] = o.transpose(1, 2).reshape(n * length, *q.shape[1:])
    return out


def _group_by_length(segments: list[torch.Tensor]) -> list[torch.Tensor]:
    """Segments (1-D row indices) stacked into one [n, L] tensor per distinct length L."""
    by_length: dict[int, list[torch.Tensor]] = {}
    for seg in segments:
        by_length.setdefault(seg.numel(), []).append(seg)
    return [torch.stack(segs) for segs in by_length.values()]


def _norm(dim: int, rms: bool) -> nn.Module:
    return RMSNorm(dim, _NORM_EPS) if rms else nn.LayerNorm(dim, _NORM_EPS)


def _rotary_tables(
    positions: torch.Tensor, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [P, 1, head_dim] float32 of the patches' (row, column) `positions` [P, 2]:
    head_dim / 4 frequencies by the row and as many by the column, repeated over the other
    half (see the module docstring)."""
    # [D/4] float32 whatever the module's dtype (no buffer), on the CPU as HF computes it
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float) / half)
    freqs = positions[..., None].float() * inv_freq  # [P, 2, D/4]
    angles = freqs.flatten(1).repeat(1, 2)[:, None].to(device)  # [P, 1, D]: (row | col) x2
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [P, H, D]; cos, sin: [P, 1, D] float32. Rotate-half rope in float32, back to x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)  # rows: q | k | v, each head-major
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:  # x: [P, D]
        rows = x.shape[0]
        q, k, v = self.qkv(x).view(rows, 3, self.num_heads, -1).unbind(1)
        out = _segment_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, groups)
        return self.proj(out.reshape(rows, -1))


class _MLP(nn.Module):  # Qwen2-VL
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = get_act_fn(act, "vision_config.hidden_act")
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _GatedMLP(nn.Module):  # Qwen2.5-VL
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = get_act_fn(act, "vision_config.hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp: nn.Module, rms: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = _norm(dim, rms), _norm(dim, rms)
        self.attn = _Attention(dim, num_heads)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        return x + self.mlp(self.norm2(x))


class _PatchEmbed(nn.Module):
    """A Conv3d whose kernel is the whole patch, run as one matmul on flattened patches."""

    def __init__(self, in_channels: int, temporal: int, patch: int, dim: int, bias: bool) -> None:
        super().__init__()
        kernel = (temporal, patch, patch)
        self.proj = nn.Conv3d(in_channels, dim, kernel, stride=kernel, bias=bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [P, C*tp*p*p] -> [P, D]
        weight = self.proj.weight
        return F.linear(pixels.to(weight.device, weight.dtype), weight.flatten(1), self.proj.bias)


def _head_dim(config, width: int, num_heads: int) -> int:
    """The tower's head size (ValueError unless it splits into row and column halves)."""
    if width % num_heads or (width // num_heads) % 4:
        raise ValueError(
            f"vision_config: width {width} / num_heads {num_heads} must be a head_dim "
            "divisible by 4 (half of it rotates by row, half by column)"
        )
    head_dim = width // num_heads
    if getattr(config, "head_dim", None) not in (None, head_dim):
        raise ValueError(f"vision_config.head_dim={config.head_dim} is not {head_dim}")
    return head_dim


def _check_grids(
    pixel_values: torch.Tensor, grid_thw, merge: int, row_width: int
) -> list[tuple[int, int, int]]:
    """Each image's (t, h, w), checked against the merge size and the pixel rows."""
    grids = [tuple(int(v) for v in g) for g in grid_thw]
    for grid in grids:
        if len(grid) != 3 or min(grid) < 1 or grid[1] % merge or grid[2] % merge:
            raise ValueError(
                f"grid_thw {grid}: (t, h, w) with h and w positive multiples of "
                f"spatial_merge_size {merge}"
            )
    rows = sum(t * h * w for t, h, w in grids)
    if pixel_values.shape != (rows, row_width):
        raise ValueError(
            f"pixel_values: shape {tuple(pixel_values.shape)}, expected ({rows}, {row_width}) "
            f"for grid_thw {grids}"
        )
    return grids  # type: ignore[return-value]


def _frame_segments(grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """Each frame's patch rows (attention stays within a frame), grouped by length."""
    segments, start = [], 0
    for t, h, w in grids:
        for _ in range(t):
            segments.append(torch.arange(start, start + h * w))
            start += h * w
    return _group_by_length(segments)


def _load_visual(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """The checkpoint's `visual.*` / `model.visual.*` tensors into `module` (any other name is
    passed over); ValueError naming a missing or unexpected one."""

    def inner(name: str) -> str:
        return name.removeprefix("model.").removeprefix("visual.")

    picked = ((n, t) for n, t in weights if n.removeprefix("model.").startswith("visual."))
    return load_named_weights(module, picked, rename=inner)


class _PatchMerger(nn.Module):
    def __init__(self, dim: int, out_dim: int, merge: int, rms: bool) -> None:
        super().__init__()
        self.ln_q = _norm(dim, rms)
        wide = dim * merge * merge
        self.mlp = nn.Sequential(nn.Linear(wide, wide), nn.GELU(), nn.Linear(wide, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [P, D] -> [P / m**2, out_dim]
        return self.mlp(self.ln_q(x).view(-1, self.mlp[0].in_features))


class QwenVisionEncoder(nn.Module):
    """`visual` of HF's Qwen2VLForConditionalGeneration / Qwen2_5_VLForConditionalGeneration."""

    def __init__(self, vision_config) -> None:
        super().__init__()
        config = vision_config
        model_type = getattr(config, "model_type", None)
        if model_type not in VARIANTS:
            raise ValueError(
                f"vision_config.model_type={model_type!r} is not supported; supported: "
                f"{sorted(VARIANTS)}"
            )
        self.variant = VARIANTS[model_type]
        qwen2_5 = self.variant == "qwen2_5_vl"
        width = _int_field(config, "hidden_size" if qwen2_5 else "embed_dim")
        num_heads = _int_field(config, "num_heads")
        depth = _int_field(config, "depth")
        self.patch_size = _int_field(config, "patch_size")
        self.temporal_patch_size = _int_field(config, "temporal_patch_size")
        self.in_channels = _int_field(config, "in_channels", 3)
        self.merge = _int_field(config, "spatial_merge_size")
        self.out_dim = _int_field(config, "out_hidden_size" if qwen2_5 else "hidden_size")
        self.head_dim = _head_dim(config, width, num_heads)
        self.rope_theta = _rope_theta(config)

        act = getattr(config, "hidden_act", None)
        if not isinstance(act, str):
            raise ValueError(f"vision_config.hidden_act={act!r} is not supported")
        if qwen2_5:
            mlp: type[_MLP | _GatedMLP] = _GatedMLP
            hidden = _int_field(config, "intermediate_size")
            window_size = _int_field(config, "window_size")
            # window side in merged tokens
            self.window: int | None = window_size // self.merge // self.patch_size
            if self.window < 1:
                raise ValueError(
                    f"vision_config.window_size={window_size} is under one merged token "
                    f"({self.merge * self.patch_size} pixels)"
                )
            full = getattr(config, "fullatt_block_indexes", None)
            if full is None or not all(isinstance(i, int) for i in full):
                raise ValueError(f"vision_config.fullatt_block_indexes={full!r} is not supported")
            self.full_blocks = frozenset(full)
        else:
            ratio = getattr(config, "mlp_ratio", None)
            if not isinstance(ratio, int | float) or ratio <= 0:
                raise ValueError(f"vision_config.mlp_ratio={ratio!r} is not supported")
            mlp, hidden = _MLP, int(width * ratio)
            self.window = None
            self.full_blocks = frozenset(range(depth))

        self.patch_embed = _PatchEmbed(
            self.in_channels, self.temporal_patch_size, self.patch_size, width, bias=False
        )
        self.blocks = nn.ModuleList(
            _Block(width, num_heads, mlp(width, hidden, act), qwen2_5) for _ in range(depth)
        )
        self.merger = _PatchMerger(width, self.out_dim, self.merge, qwen2_5)

    def _grids(self, pixel_values: torch.Tensor, grid_thw) -> list[tuple[int, int, int]]:
        width = self.in_channels * self.temporal_patch_size * self.patch_size**2
        return _check_grids(pixel_values, grid_thw, self.merge, width)

    # The index tensors below are built on the CPU (small, and no device sync per window).

    def _positions(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """[P, 2] (row, column) of every patch, in the input's merge-block order."""
        m, out = self.merge, []
        for t, h, w in grids:
            shape = (h // m, w // m, m, m)  # (block row, block column, row in block, column)
            rows = torch.arange(h).view(h // m, 1, m, 1).expand(shape)
            cols = torch.arange(w).view(1, w // m, 1, m).expand(shape)
            out.append(torch.stack([rows, cols], dim=-1).reshape(-1, 2).repeat(t, 1))
        return torch.cat(out)

    def _frames(self, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        return _frame_segments(grids)

    def _windows(self, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Per frame, the windows (row-major) of window x window merged tokens, edges partial."""
        mm, size, segments, start = self.merge**2, self.window, [], 0
        for t, h, w in grids:
            bh, bw = h // self.merge, w // self.merge  # merged tokens per column / row
            nh, nw = -(-bh // size), -(-bw // size)
            token = torch.arange(t * bh * bw)
            frame, row, col = token // (bh * bw), token // bw % bh, token % bw
            key = (frame * nh + row // size) * nw + col // size  # window of each merged token
            order = torch.argsort(key, stable=True)  # tokens by window, ascending within
            counts = torch.bincount(key, minlength=t * nh * nw).tolist()
            patches = order[:, None] * mm + torch.arange(mm) + start
            segments.extend(p.reshape(-1) for p in patches.split(counts))
            start += t * h * w
        return _group_by_length(segments)

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]
    ) -> torch.Tensor:
        """pixel_values [sum t*h*w, C*tp*p*p] (HF's image processor's, images concatenated);
        grid_thw: each image's (t, h, w) in patches -> [sum t*h*w / m**2, out_dim]."""
        grids = self._grids(pixel_values, grid_thw)
        x = self.patch_embed(pixel_values)
        device = x.device
        cos, sin = _rotary_tables(self._positions(grids), self.head_dim, self.rope_theta, device)
        frames = [g.to(device) for g in self._frames(grids)]
        windows = frames if self.window is None else [g.to(device) for g in self._windows(grids)]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in self.full_blocks else windows)
        return self.merger(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `visual.*` / `model.visual.*` tensors (any other name is passed
        over); raises ValueError naming a missing or unexpected one."""
        return _load_visual(self, weights)
