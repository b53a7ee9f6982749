"""The vision encoder ("visual") of Qwen3-VL and Qwen3-VL-MoE (one tower), in HF's weight names.

    pixel_values [P, C*tp*p*p]  (P = sum of t*h*w patches; each image's patches in merge-block
        order: the m*m patches of one merged token are consecutive, blocks row-major, frames last)
        -> patch_embed.proj (a Conv3d with bias whose kernel is the whole patch: one matmul)
        -> + pos_embed (a learned side x side grid, bilinearly resampled to the image's h x w)
        -> blocks[i]: x = x + attn(norm1(x), 2D rope);  x = x + mlp(norm2(x))
        |      (LayerNorm eps 1e-6; mlp: linear_fc1 -> hidden_act -> linear_fc2, all with bias)
        |  after block deepstack_visual_indexes[j]:
        |      deepstack_merger_list[j]: m*m consecutive patches concatenated -> norm
        |          -> linear_fc1 -> GELU -> linear_fc2  -> deepstack rows j [P / m**2, out_dim]
        -> merger: norm per patch -> m*m consecutive patches concatenated
            -> linear_fc1 -> GELU -> linear_fc2
        -> [P / m**2, out_dim]  (each image's rows contiguous, in the input's order)

Position embedding: the table's first side**2 rows (side = isqrt(num_position_embeddings)) form
a side x side grid. A patch at (row r, column c) of an h x w image reads it at the fractional
point (r * (side - 1) / (h - 1), c * (side - 1) / (w - 1)) (align-corners: the image's corner
patches sit on the grid's corners), mixing the four surrounding entries with bilinear weights
computed in float32; the mix is summed in float32 and cast to the module's dtype. Every frame of
an image gets the same embeddings.

Rotary: head_dim / 4 frequencies (theta from rope_parameters, 10000) rotate by a patch's row and
as many by its column; the angles [row freqs | column freqs] fill half the head and repeat over
the other half (rotate-half pairing), computed and applied in float32. Attention is within each
frame (HF's cu_seqlens).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.multimodal.qwen2_vl_vision import (
    _Block,
    _check_grids,
    _frame_segments,
    _head_dim,
    _int_field,
    _load_visual,
    _PatchEmbed,
    _rope_theta,
    _rotary_tables,
)

# vision_config.model_type values (transformers 5 names the sub-config "*_vision")
MODEL_TYPES = frozenset({"qwen3_vl", "qwen3_vl_vision", "qwen3_vl_moe", "qwen3_vl_moe_vision"})
# Qwen3-Omni's thinker: the same tower, its mergers named apart (multimodal/qwen_omni.py)
MODEL_TYPES |= {"qwen3_omni_moe_vision_encoder"}
# Cohere Compass (North-Micro-Vision): Qwen3-VL's tower, deepstack included
MODEL_TYPES |= {"cohere_compass_vision"}
# Qwen3.5 / Qwen3.5-MoE: the same tower without deepstack (their configs have no indexes)
NO_DEEPSTACK = frozenset({"qwen3_5_vision", "qwen3_5_moe_vision"})
_NORM_EPS = 1e-6  # HF hard-codes it for every norm of the tower


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.act_fn = get_act_fn(act, "vision_config.hidden_act")
        self.linear_fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class _PatchMerger(nn.Module):
    """m*m consecutive patches -> one row of out_dim. `norm_after_concat` (the deepstack
    mergers) normalises the concatenated m*m*D vector, else each patch's D before it."""

    def __init__(self, dim: int, out_dim: int, merge: int, norm_after_concat: bool) -> None:
        super().__init__()
        self.wide = dim * merge * merge
        self.norm_after_concat = norm_after_concat
        self.norm = nn.LayerNorm(self.wide if norm_after_concat else dim, _NORM_EPS)
        self.linear_fc1 = nn.Linear(self.wide, self.wide)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(self.wide, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [P, D] -> [P / m**2, out_dim]
        if self.norm_after_concat:
            x = self.norm(x.reshape(-1, self.wide))
        else:
            x = self.norm(x).reshape(-1, self.wide)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align-corners) taps of positions `index` (0..size-1) of an axis of `size`
    into a grid axis of `side`: ([n, 2] grid indices, [n, 2] float32 weights)."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    below = torch.floor(src)
    offsets = torch.arange(2)
    taps = (below.long()[:, None] + offsets).clamp(0, side - 1)
    # hat kernel 1 - |distance| to each tap, in the same float32 steps as HF
    distance = ((src - below)[:, None] - offsets).abs()
    return taps, (1 - distance).clamp(min=0)


class Qwen3VisionEncoder(nn.Module):
    """`visual` of HF's Qwen3VLForConditionalGeneration / Qwen3VLMoeForConditionalGeneration.

    forward returns (merged rows, [deepstack rows per deepstack_visual_indexes entry])."""

    def __init__(self, vision_config) -> None:
        super().__init__()
        config = vision_config
        model_type = getattr(config, "model_type", None)
        if model_type not in MODEL_TYPES | NO_DEEPSTACK:
            raise ValueError(
                f"vision_config.model_type={model_type!r} is not supported; supported: "
                f"{sorted(MODEL_TYPES)}"
            )
        width = _int_field(config, "hidden_size")
        num_heads = _int_field(config, "num_heads")
        depth = _int_field(config, "depth")
        hidden = _int_field(config, "intermediate_size")
        self.patch_size = _int_field(config, "patch_size")
        self.temporal_patch_size = _int_field(config, "temporal_patch_size")
        self.in_channels = _int_field(config, "in_channels", 3)
        self.merge = _int_field(config, "spatial_merge_size")
        self.out_dim = _int_field(config, "out_hidden_size")
        num_positions = _int_field(config, "num_position_embeddings")
        # HF: int(n ** 0.5); rows past side**2 (n not a square) are loaded but never read
        self.grid_side = math.isqrt(num_positions)
        self.head_dim = _head_dim(config, width, num_heads)
        self.rope_theta = _rope_theta(config)
        act = getattr(config, "hidden_act", None)
        if not isinstance(act, str):
            raise ValueError(f"vision_config.hidden_act={act!r} is not supported")
        deepstack = getattr(config, "deepstack_visual_indexes", None)
        if model_type in NO_DEEPSTACK and deepstack is None:
            deepstack = []
        if (
            not isinstance(deepstack, list | tuple)
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in deepstack)
            or list(deepstack) != sorted(set(deepstack))
            or any(i < 0 or i >= depth for i in deepstack)
        ):
            # HF emits the features in block order and silently skips indexes past the last
            # block; strictly increasing in-range indexes make that the config's order
            raise ValueError(
                f"vision_config.deepstack_visual_indexes={deepstack!r} is not supported: "
                f"strictly increasing block indexes below depth {depth}"
            )
        self.deepstack_visual_indexes = tuple(deepstack)
        self.num_deepstack = len(deepstack)

        self.patch_embed = _PatchEmbed(
            self.in_channels, self.temporal_patch_size, self.patch_size, width, bias=True
        )
        self.pos_embed = nn.Embedding(num_positions, width)
        self.blocks = nn.ModuleList(
            _Block(width, num_heads, _MLP(width, hidden, act), rms=False) for _ in range(depth)
        )
        self.merger = _PatchMerger(width, self.out_dim, self.merge, norm_after_concat=False)
        self.deepstack_merger_list = nn.ModuleList(
            _PatchMerger(width, self.out_dim, self.merge, norm_after_concat=True) for _ in deepstack
        )

    def _grids(self, pixel_values: torch.Tensor, grid_thw) -> list[tuple[int, int, int]]:
        width = self.in_channels * self.temporal_patch_size * self.patch_size**2
        return _check_grids(pixel_values, grid_thw, self.merge, width)

    # The index tensors below are built on the CPU (small, and no device sync per image).

    def _frame_positions(self, h: int, w: int) -> torch.Tensor:
        """[h*w, 2] (row, column) of one frame's patches, in merge-block order."""
        m = self.merge
        shape = (h // m, w // m, m, m)  # (block row, block column, row in block, column)
        rows = torch.arange(h).view(h // m, 1, m, 1).expand(shape)
        cols = torch.arange(w).view(1, w // m, 1, m).expand(shape)
        return torch.stack([rows, cols], dim=-1).reshape(-1, 2)

    def _position_embeddings(
        self, grids: list[tuple[int, int, int]], positions: list[torch.Tensor], dtype: torch.dtype
    ) -> torch.Tensor:
        """[P, D] pos_embed resampled to each image's grid (every frame alike), in `dtype`."""
        table, side, out = self.pos_embed.weight, self.grid_side, []
        for (t, h, w), pos in zip(grids, positions):
            row_taps, row_weights = _axis_taps(pos[:, 0], h, side)
            col_taps, col_weights = _axis_taps(pos[:, 1], w, side)
            # 4 taps per patch: (row tap, column tap) pairs, row-major
            index = (row_taps[:, :, None] * side + col_taps[:, None, :]).flatten(1)
            weight = (row_weights[:, :, None] * col_weights[:, None, :]).flatten(1)
            index, weight = index.to(table.device), weight.to(table.device)
            mixed = (F.embedding(index, table) * weight[..., None]).sum(1)  # float32
            out.append(mixed.to(dtype).repeat(t, 1))
        return torch.cat(out)

    def _rotary(
        self,
        grids: list[tuple[int, int, int]],
        positions: list[torch.Tensor],
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [P, 1, head_dim] float32."""
        pos = torch.cat([p.repeat(t, 1) for (t, _, _), p in zip(grids, positions)])
        return _rotary_tables(pos, self.head_dim, self.rope_theta, device)

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values [sum t*h*w, C*tp*p*p] (HF's image processor's, images concatenated);
        grid_thw: each image's (t, h, w) in patches -> (merged rows [sum t*h*w / m**2, out_dim],
        one deepstack tensor of that shape per deepstack_visual_indexes entry, in its order)."""
        grids = self._grids(pixel_values, grid_thw)
        positions = [self._frame_positions(h, w) for _, h, w in grids]
        x = self.patch_embed(pixel_values)
        x = x + self._position_embeddings(grids, positions, x.dtype)
        cos, sin = self._rotary(grids, positions, x.device)
        frames = [g.to(x.device) for g in _frame_segments(grids)]
        deepstack: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in self.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[len(deepstack)](x))
        return self.merger(x), deepstack

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `model.visual.*` (transformers 5's save_pretrained) / `visual.*`
        tensors (any other name is passed over); raises ValueError naming a missing or
        unexpected one."""
        return _load_visual(self, weights)
