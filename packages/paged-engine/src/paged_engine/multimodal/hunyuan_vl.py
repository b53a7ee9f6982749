"""HunyuanOCR's image path (HunYuanVLForConditionalGeneration): its ViT, the convolutional
merger with a learned row break and begin / end rows, and the multi-axis rope positions.

    image -> the checkpoint's image processor (HunYuanVLImageProcessorPil, no torchvision: the
        image resized to multiples of patch * merge pixels, cut into h x w patches in row-major
        order) -> pixel rows [h*w, 3 * p * p]
    -> vision_tower, per image, as transformers runs it:
        embeddings: patch_embedding (a Conv2d with bias whose kernel is the patch: one matmul)
            + position_embedding rows 1.. (row 0 is an unused CLS slot): the learned
            edge x edge grid (edge = max_image_size / patch_size) resized to h x w by
            F.interpolate (interpolate_mode, align_corners=False) in float32
        layers: SigLIP's pre-norm layers (LayerNorm eps rms_norm_eps, q / k / v / o with
            biases, fc1 -> hidden_act -> fc2), attention over the image's patches
        patch_merger: before_rms (RMSNorm) -> the h x w grid -> proj_conv (m x m, stride m,
            D -> 2D) -> hidden_act -> proj_out (1 x 1, 2D -> 4D) -> image_newline appended
            after each of the h/m rows -> mlp (4D -> text hidden) -> [image_begin, rows...,
            image_end] -> after_rms (RMSNorm)
        -> [(h/m) * (w/m + 1) + 2, text hidden]  (image_sep is never read)
    prompt: <start> <image> x ((h/m) * (w/m + 1) + 2) <end>  (HunYuanVLProcessor repeats the
        chat template's lone image token; its first and last take the begin / end rows)

Positions (transformers' get_rope_index, n = len(mrope_section) axes): every token has its
1-D position p on every axis, except an image's grid tokens (its run less the first and last
token), whose last three axes are (column, row, image ordinal in the prompt) over the
(h/m) x (w/m + 1) grid, the break column included. Generated tokens continue at p + delta,
delta = max + 1 - prompt length (0: no grid index passes its 1-D position). The runner carries three
rows, so they travel as (p, column, -(1 + row + PACK * ordinal)) for grid tokens and p thrice
for the rest; models/hunyuan_vl.py's XdRotaryEmbedding unpacks them.

Refused by name: vision_config.temporal_patch_size other than 1, max_image_size not a multiple
of patch_size, text_hidden_size unlike the text model's, an interpolate_mode other than bilinear
/ bicubic; videos (the model takes none).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.norm import RMSNorm
from paged_engine.models.hunyuan_vl import PACK
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.mrope import MropePositions
from paged_engine.multimodal.qwen2_vl_vision import _int_field
from paged_engine.multimodal.vision_transformer import VisionLayer

MODEL_TYPES = frozenset({"hunyuan_vl_vision"})
# the Hub's original names (transformers' conversion mapping) -> HF's, then ours
_RENAMES = (
    (".embeddings.", "."),  # patch / position embeddings sit on the tower itself
    (".mlp.dense_h_to_4h.", ".mlp.fc1."),
    (".mlp.dense_4h_to_h.", ".mlp.fc2."),
    (".input_layernorm.", ".layer_norm1."),
    (".post_attention_layernorm.", ".layer_norm2."),
    (".perceive.proj.0.", ".patch_merger.proj_conv."),
    (".perceive.proj.2.", ".patch_merger.proj_out."),
    (".perceive.", ".patch_merger."),
    (".self_attn.o_proj.", ".self_attn.out_proj."),
)
_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.vit.", "vit.")


def merge_size(config: Any) -> int:
    return _int_field(config.vision_config, "spatial_merge_size")


def tokens(config: Any, grid: tuple[int, ...]) -> int:
    """An image's run: its merged grid with a break per row, and the begin / end tokens."""
    m = merge_size(config)
    _, h, w = grid
    return (h // m) * (w // m + 1) + 2


def positions(num_tokens: int, images: Sequence[ImageInput], merge: int) -> MropePositions:
    """The prompt's packed three-row table (see the module), images in prompt order."""
    table = np.tile(np.arange(num_tokens, dtype=np.int64), (3, 1))
    top = num_tokens - 1
    for ordinal, m in enumerate(images):
        assert m.image_size is not None and len(m.image_size) == 3
        rows, cols = m.image_size[1] // merge, m.image_size[2] // merge + 1
        if rows * cols + 2 != m.length:
            raise ValueError(f"an image's grid {m.image_size} does not give its {m.length} rows")
        row, col = np.divmod(np.arange(rows * cols), cols)
        grid = slice(m.offset + 1, m.offset + 1 + rows * cols)
        table[1, grid] = col
        table[2, grid] = -(1 + row + PACK * ordinal)
        top = max(top, cols - 1, rows - 1, ordinal)
    first = images[0].offset if images else num_tokens
    return MropePositions(table, first, top + 1 - num_tokens if num_tokens else 0)


class _PatchMerger(nn.Module):
    def __init__(self, dim: int, text_dim: int, merge: int, eps: float, act: str) -> None:
        super().__init__()
        self.before_rms = RMSNorm(dim, eps)
        self.proj_conv = nn.Conv2d(dim, 2 * dim, kernel_size=merge, stride=merge)
        self.proj_act = get_act_fn(act, "vision_config.hidden_act")
        self.proj_out = nn.Conv2d(2 * dim, 4 * dim, kernel_size=1)
        self.mlp = nn.Linear(4 * dim, text_dim)
        self.image_newline = nn.Parameter(torch.empty(4 * dim))
        self.image_begin = nn.Parameter(torch.empty(text_dim))
        self.image_end = nn.Parameter(torch.empty(text_dim))
        self.image_sep = nn.Parameter(torch.empty(text_dim))  # in the checkpoint, never read
        self.after_rms = RMSNorm(text_dim, eps)

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """x [h*w, D] (row-major patches) -> [(h/m) * (w/m + 1) + 2, text_dim]."""
        grid = self.before_rms(x).T.reshape(1, -1, h, w)
        grid = self.proj_out(self.proj_act(self.proj_conv(grid)))[0]  # [4D, h/m, w/m]
        newline = self.image_newline.to(grid.dtype)[:, None, None].expand(-1, grid.shape[1], 1)
        rows = self.mlp(torch.cat((grid, newline), dim=-1).flatten(1).T)
        ends = (self.image_begin[None].to(rows.dtype), self.image_end[None].to(rows.dtype))
        return self.after_rms(torch.cat((ends[0], rows, ends[1])))


class HunyuanVisionTower(nn.Module):
    """`vision_tower` of HF's HunYuanVLForConditionalGeneration (HF's names; layers'
    `self_attn.o_proj` is our `out_proj`)."""

    def __init__(self, config: Any, text_hidden: int) -> None:
        super().__init__()
        v = config.vision_config
        model_type = getattr(v, "model_type", None)
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"vision_config.model_type={model_type!r} is not supported; supported: "
                f"{sorted(MODEL_TYPES)}"
            )
        if _int_field(v, "temporal_patch_size", 1) != 1:
            raise ValueError(
                f"vision_config.temporal_patch_size={v.temporal_patch_size} is not supported: 1"
            )
        dim, self.patch = _int_field(v, "hidden_size"), _int_field(v, "patch_size")
        self.channels, self.merge = _int_field(v, "num_channels", 3), merge_size(config)
        size = _int_field(v, "max_image_size")
        if size % self.patch:
            raise ValueError(
                f"vision_config.max_image_size={size} is not a multiple of patch_size {self.patch}"
            )
        if getattr(v, "text_hidden_size", text_hidden) != text_hidden:
            raise ValueError(
                f"vision_config.text_hidden_size={v.text_hidden_size} is not the text model's "
                f"hidden_size {text_hidden}"
            )
        self.mode = getattr(v, "interpolate_mode", "bilinear")
        if self.mode not in ("bilinear", "bicubic"):
            raise ValueError(
                f"vision_config.interpolate_mode={self.mode!r} is not supported: bilinear, bicubic"
            )
        self.edge = size // self.patch
        self.patch_embedding = nn.Conv2d(self.channels, dim, self.patch, stride=self.patch)
        self.position_embedding = nn.Embedding(self.edge**2 + 1, dim)
        act = getattr(v, "hidden_act", None)
        if not isinstance(act, str):
            raise ValueError(f"vision_config.hidden_act={act!r} is not supported")
        self.layers = nn.ModuleList(
            VisionLayer(v) for _ in range(_int_field(v, "num_hidden_layers"))
        )
        eps = float(v.rms_norm_eps)
        self.patch_merger = _PatchMerger(dim, text_hidden, self.merge, eps, act)

    def _positions(self, h: int, w: int) -> torch.Tensor:  # -> [h*w, D] in the table's dtype
        table = self.position_embedding.weight
        grid = table[1:].view(self.edge, self.edge, -1).permute(2, 0, 1)[None].float()
        grid = F.interpolate(grid, size=(h, w), mode=self.mode, align_corners=False)
        return grid[0].flatten(1).T.to(table.dtype)

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image: pixels [t*h*w, C*p*p] with its grid (t, h, w) -> its run's rows."""
        t, h, w = grid
        if t != 1 or h % self.merge or w % self.merge or h < 2 or w < 2:
            raise ValueError(
                f"image_grid_thw {grid}: (1, h, w) with h and w multiples of "
                f"spatial_merge_size {self.merge}"
            )
        weight = self.patch_embedding.weight
        if pixels.shape != (h * w, weight[0].numel()):
            raise ValueError(
                f"pixel_values: shape {tuple(pixels.shape)}, expected ({h * w}, "
                f"{weight[0].numel()}) for grid {grid}"
            )
        x = F.linear(pixels.to(weight.dtype), weight.flatten(1), self.patch_embedding.bias)
        x = (x + self._positions(h, w))[None]  # [1, h*w, D]
        for layer in self.layers:
            x = layer(x)
        return self.patch_merger(x[0], h, w)


def _ours(name: str) -> str | None:
    """A checkpoint name -> the tower's, or None for anything else."""
    prefix = next((p for p in _PREFIXES if name.startswith(p)), None)
    if prefix is None:
        return None
    name = "." + name.removeprefix(prefix)
    for theirs, ours in _RENAMES:
        name = name.replace(theirs, ours)
    return name[1:]


class HunyuanImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding, one per placeholder."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.vision_tower = HunyuanVisionTower(config, int(config.text_config.hidden_size))

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        out = []
        for m in images:
            grid = tuple(int(x) for x in m.image_size)  # type: ignore[union-attr]
            out.append(self.vision_tower(m.pixel_values, grid))  # type: ignore[arg-type]
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's tower tensors (transformers' `[model.]vision_tower.*` or the Hub's
        `vit.*`; anything else is passed over); ValueError naming a missing or unexpected one."""
        picked = ((n, t) for n, t in ((_ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self.vision_tower, picked)
