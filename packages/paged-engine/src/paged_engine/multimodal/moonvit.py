"""MoonViT, Kimi K2.5's vision tower (HF's Kimi_K25VisionModel), in HF's weight names.

    pixel_values [P, 3, p, p]  (P = sum of h*w patches; each image's patches row-major)
        -> patch_embed.proj (Conv2d with bias, kernel = stride = p: one matmul per patch)
        -> + patch_embed.pos_emb: the learned [S, S, D] grid resampled to the image's (h, w)
             (bicubic, align_corners=False, as F.interpolate; no antialias)
        -> layers: x = x + attn(norm1(x), 2-D rope);  x = x + mlp(norm2(x))  (LayerNorm eps 1e-5,
             attention within each image, q / k / v / proj with bias; mlp fc1 -> act -> fc2)
        -> final_layernorm
        -> each kh x kw block of patches gathered into one row [kh * kw, D] (block row-major,
             patches within a block row-major): [P / (kh * kw), kh * kw, D]

A video chunk (grid (t, h, w), t > 1 frames, each frame's patches row-major, frames in order;
multimodal/kimi_k25_video.py) differs in three places, as HF's: frame f also adds the
sinusoid [sin(f * inv), cos(f * inv)] (inv = 10000 ** -(2i / D); row f + 1 of HF's table, whose
row 0 is the zero an image adds), attention spans the whole chunk (merge_temporal=True), and
each merge block is the mean over the t frames (float32) of that block: [h * w / (kh * kw),
kh * kw, D]. t is at most vision_config.pos_emb_time (the table's rows).

Differences from Qwen2-VL's tower (qwen2_vl_vision.py, whose attention, rotation and MLP this
reuses): patches arrive row-major, not in merge-block order (the merge reorders them after the
final norm); an additive learned position grid; and the rope angles interleave the axes: with
head_dim / 4 frequencies f_j (theta ** -(4j / head_dim)), a patch at (row, col) rotates by
[col * f_0, row * f_0, col * f_1, row * f_1, ...] over half the head, repeated over the other
half (rotate-half pairing, float32).

The Hub's (and transformers 5's saved) names are the original ones: `vision_tower.encoder.
blocks.N.{norm0, norm1, wqkv, wo, mlp.fc0, mlp.fc1}`, `vision_tower.patch_embed.pos_emb.weight`;
wqkv's q and k rows are in the complex (pairwise) rope order and are permuted to rotate-half
order at load, as transformers' PermuteForRope does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.qwen2_vl_vision import (
    _MLP,  # fc1 -> act -> fc2, with biases
    _group_by_length,
    _int_field,
    _rope_theta,
    _rotate,
    _segment_attention,
)

_EPS = 1e-5  # every LayerNorm of the tower (hard-coded by HF)
# original (Hub) block names -> HF's
_BLOCK_RENAMES = {
    "norm0": "norm1",
    "norm1": "norm2",
    "mlp.fc0": "mlp.fc1",
    "mlp.fc1": "mlp.fc2",
    "wo": "attn.proj",
}
_BLOCK = re.compile(r"^encoder\.blocks\.(\d+)\.(.+)$")

Grid = tuple[int, int, int]


class _Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:  # x: [P, D]
        rows = x.shape[0]
        q, k, v = (
            p(x).view(rows, self.num_heads, -1) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = _segment_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, groups)
        return self.proj(out.reshape(rows, -1))


class _Layer(nn.Module):
    def __init__(self, dim: int, num_heads: int, hidden: int, act: str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, _EPS)
        self.norm2 = nn.LayerNorm(dim, _EPS)
        self.attn = _Attention(dim, num_heads)
        self.mlp = _MLP(dim, hidden, act)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        return x + self.mlp(self.norm2(x))


class _PositionGrid(nn.Module):  # HF's patch_embed.pos_emb
    def __init__(self, side: int, dim: int) -> None:
        super().__init__()
        self.position_embeddings = nn.Parameter(torch.zeros(side, side, dim))

    def forward(self, grids: list[Grid], times: torch.Tensor) -> torch.Tensor:
        """[P, D]: the grid resampled to each image's (h, w), row-major, repeated for each of a
        chunk's t frames with frame f's row of `times` [T, D] added (none for t = 1)."""
        table = self.position_embeddings.permute(2, 0, 1)[None]  # [1, D, S, S]
        out = []
        for t, h, w in grids:
            if (h, w) == tuple(table.shape[-2:]):
                grid = table[0]
            else:
                grid = F.interpolate(table, size=(h, w), mode="bicubic", align_corners=False)[0]
            grid = grid.flatten(1).t()  # [h * w, D]
            if t > 1:
                grid = (grid[None] + times[:t, None].to(grid.device, grid.dtype)).flatten(0, 1)
            out.append(grid)
        return torch.cat(out)


class _PatchEmbed(nn.Module):
    def __init__(self, patch: int, dim: int, side: int, frames: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, stride=patch)
        self.pos_emb = _PositionGrid(side, dim)
        # [frames, D] float32 (no buffer: not in the checkpoint, stays float32)
        inv = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)
        angles = torch.outer(torch.arange(frames).float(), inv)
        self.times = torch.cat([angles.sin(), angles.cos()], dim=1)

    def forward(self, pixels: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        # [P, 3, p, p] -> [P, D]: a conv whose kernel is the whole patch is one matmul
        w = self.proj.weight
        x = F.linear(pixels.reshape(pixels.shape[0], -1), w.reshape(w.shape[0], -1), self.proj.bias)
        return x + self.pos_emb(grids, self.times).to(x.dtype)


class MoonVisionTower(nn.Module):
    """HF's Kimi_K25VisionModel: patches of images (t = 1) and video chunks (t frames) ->
    [sum of h * w / (kh * kw), kh * kw, D]."""

    def __init__(self, vision_config) -> None:
        super().__init__()
        v = vision_config
        dim = _int_field(v, "hidden_size")
        heads = _int_field(v, "num_attention_heads")
        self.patch = _int_field(v, "patch_size")
        side = _int_field(v, "pos_emb_height")
        if getattr(v, "pos_emb_width", side) != side:
            raise ValueError(
                f"vision_config.pos_emb_width={v.pos_emb_width} must equal pos_emb_height={side} "
                "(transformers resamples a square grid)"
            )
        head_dim = dim // heads
        if dim % heads or head_dim % 4:
            raise ValueError(
                f"vision_config.hidden_size={dim} / num_attention_heads={heads} must be a "
                "head_dim divisible by 4 (rope: head_dim / 4 frequencies per axis)"
            )
        kernel = tuple(getattr(v, "merge_kernel_size", (2, 2)))
        if len(kernel) != 2 or not all(isinstance(k, int) and k > 0 for k in kernel):
            raise ValueError(f"vision_config.merge_kernel_size={kernel!r}: two positive ints")
        self.kernel: tuple[int, int] = (kernel[0], kernel[1])
        half = head_dim // 2
        theta = _rope_theta(v)
        # [head_dim / 4] float32 (no buffer: stays float32 whatever the module's dtype)
        self.inv_freq = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float) / half)
        self.frames = _int_field(v, "pos_emb_time") if hasattr(v, "pos_emb_time") else 4
        self.patch_embed = _PatchEmbed(self.patch, dim, side, self.frames)
        hidden = _int_field(v, "intermediate_size")
        layers = _int_field(v, "num_hidden_layers")
        self.layers = nn.ModuleList(_Layer(dim, heads, hidden, v.hidden_act) for _ in range(layers))
        self.final_layernorm = nn.LayerNorm(dim, _EPS)

    def _rope(self, grids: list[Grid], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [P, 1, head_dim] float32 for the packed patches of images with these grids."""
        pos = torch.cat(
            [
                torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1)
                .view(-1, 2)
                .repeat(t, 1)
                for t, h, w in grids
            ]
        ).float()  # [P, 2] (row, col)
        angles = pos[:, :, None] * self.inv_freq  # [P, 2, F]
        # per frequency (col, row): HF's transpose(1, 2).flip(-1)
        angles = angles.transpose(1, 2).flip(-1).flatten(1).repeat(1, 2)[:, None]
        return angles.cos().to(device), angles.sin().to(device)

    def _merge(self, x: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """[P, D] row-major patches -> [h * w / (kh * kw), kh * kw, D] merge blocks per image
        or chunk (a chunk's frames averaged in float32, as HF's temporal_merge)."""
        kh, kw = self.kernel
        d, out = x.shape[-1], []
        for part, (t, h, w) in zip(x.split([t * h * w for t, h, w in grids]), grids, strict=True):
            blocks = part.view(t, h // kh, kh, w // kw, kw, d).permute(0, 1, 3, 2, 4, 5)
            blocks = blocks.reshape(t, -1, kh * kw, d)
            if t == 1:
                out.append(blocks[0])
            else:
                out.append((blocks.float() * (1.0 / t)).sum(0).to(x.dtype))
        return torch.cat(out)

    def forward(self, pixels: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """pixels [P, 3, p, p] of images (1, h, w) and chunks (t, h, w) (h, w multiples of the
        merge kernel, t at most pos_emb_time) -> [sum of h * w / (kh * kw), kh * kw, D]."""
        kh, kw = self.kernel
        for t, h, w in grids:
            if not 1 <= t <= self.frames or h % kh or w % kw:
                raise ValueError(
                    f"image_grid_thw {(t, h, w)}: 1 to pos_emb_time={self.frames} frames, h and "
                    f"w multiples of merge_kernel_size {self.kernel}"
                )
        if pixels.shape[0] != sum(t * h * w for t, h, w in grids):
            raise ValueError(f"pixel_values {tuple(pixels.shape)} do not fit the grids {grids}")
        x = self.patch_embed(pixels, grids)
        cos, sin = self._rope(grids, x.device)
        groups = _clip_segments(grids)
        for layer in self.layers:
            x = layer(x, cos, sin, groups)
        return self._merge(self.final_layernorm(x), grids)

    def hf_names(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """A tensor under the tower's prefix (HF's names or the Hub's originals) as ours."""
        name = name.removeprefix("encoder.") if name.startswith("encoder.patch_embed.") else name
        if name == "patch_embed.pos_emb.weight":
            yield "patch_embed.pos_emb.position_embeddings", tensor
            return
        if name.startswith("encoder.final_layernorm."):
            yield name.removeprefix("encoder."), tensor
            return
        match = _BLOCK.match(name)
        if match is None:
            yield name, tensor
            return
        index, rest = match.groups()
        base = f"layers.{index}."
        if rest.startswith("wqkv."):
            kind = rest.removeprefix("wqkv.")
            q, k, v = tensor.chunk(3, dim=0)
            heads = self.layers[0].attn.num_heads
            yield base + f"attn.q_proj.{kind}", _pairs_to_halves(q, heads)
            yield base + f"attn.k_proj.{kind}", _pairs_to_halves(k, heads)
            yield base + f"attn.v_proj.{kind}", v
            return
        for old, new in _BLOCK_RENAMES.items():
            if rest.startswith(old + "."):
                rest = new + rest[len(old) :]
                break
        yield base + rest, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Tensors named under the tower (its prefix removed); ValueError naming a missing or
        unexpected one."""

        def convert(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
            return self.hf_names(name, tensor)

        return load_named_weights(self, weights, convert=convert)


def _pairs_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q / k rows of each head from pairwise (complex) rope order (x0, y0, x1, y1, ...) to
    rotate-half order (x0, x1, ..., y0, y1, ...): transformers' PermuteForRope."""
    rows = w.shape[0]
    half = rows // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(rows, *w.shape[1:])


def _clip_segments(grids: list[Grid]) -> list[torch.Tensor]:
    """Each image's or chunk's patch rows (attention spans a chunk's frames), grouped by length."""
    segments, start = [], 0
    for t, h, w in grids:
        segments.append(torch.arange(start, start + t * h * w))
        start += t * h * w
    return _group_by_length(segments)
