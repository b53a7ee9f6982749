"""LFM2-VL's image path (Lfm2VlForConditionalGeneration): a SigLIP2 NaFlex tower that reads each
view at its own patch grid, pixel unshuffle and an MLP projector into the LFM2 decoder
(models/lfm2.py, served through models/text_wrappers.py).

    image -> Lfm2VlImageProcessor (lfm2_vl_processor.py has its steps): views of multiples
        of u = patch * downsample_factor pixels: the image smart-resized between
        min_image_tokens and max_image_tokens blocks of u x u, or (too large, splitting) a
        rows x cols grid of tile_size tiles, row-major, then that as a thumbnail; each view
        normalized and cut into patches [h * w, p * p * 3] (row-major, each (row, col, channel))
    each view -> tower (SigLIP's layers, post_layernorm, no head): patch_embedding is a
        Linear over the flat patch; the learned side x side position table resized to the
        view's h x w grid (bilinear, align_corners=False, antialias: transformers' weights per
        axis) and added
        -> multi_modal_projector: f x f blocks of patches (row-major in the block) as one row,
           blocks row-major -> LayerNorm (projector_use_layernorm) -> linear_1 -> act ->
           linear_2 -> (h / f) * (w / f) rows
    prompt (Lfm2VlProcessor, its image tokens all special): each <image> becomes
        <|image_start|> (<|img_row_R_col_C|> <image> x n_tile per tile) <|img_thumbnail|>
        <image> x n_thumb <|image_end|>, or untiled <|image_start|> <image> x n <|image_end|>

A view is one `ImageInput` (image_size = its patch grid (h, w)), run alone at its size:
transformers pads the views of a batch to max_num_patches and masks the padding out of the
tower's attention and the projector's gather, which leaves each view's rows as they are alone.

The image processor: transformers' when it imports (it needs torchvision), else
lfm2_vl_processor.Lfm2VlTorchProcessor (torch_processors.PROCESSORS), called the same way with
the same mm_processor_kwargs; a request's kwargs are bounded first (Lfm2VlLayout.check_kwargs,
lfm2_vl_processor.check_kwargs). Refused by name: a non-square position table
(vision_config.num_patches), vision_config.model_type other than siglip2_vision_model; without
torchvision, saved settings the model would not read (lfm2_vl_processor's check).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.vision_transformer import VisionEncoder, pixel_shuffle

ARCH = "Lfm2VlForConditionalGeneration"
IMAGE, START, END, THUMBNAIL = "<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"
# an image's views: their patches [h * w, p * p * 3], their grids (h, w), the tiles (rows, cols)
Views = tuple[list[torch.Tensor], list[tuple[int, int]], tuple[int, int]]


def tile_token(row: int, col: int) -> str:
    """The special token before tile (row, col) of a grid (1-based)."""
    return f"<|img_row_{row}_col_{col}|>"


def patch_size(config: Any) -> int:
    return int(config.vision_config.patch_size)


def load_image(run: Any, image: Any) -> Views:
    """One image's views through the image processor (`run`: transformers' Lfm2VlImageProcessor,
    or lfm2_vl_processor's copy without torchvision), each view's padding cut off."""
    out = run([image], return_row_col_info=True)
    grids = [(int(h), int(w)) for h, w in out["spatial_shapes"].tolist()]
    views = [v[: h * w].float() for v, (h, w) in zip(out["pixel_values"], grids, strict=True)]
    return views, grids, (int(out["image_rows"][0]), int(out["image_cols"][0]))


def resized_positions(table: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[side, side, D] -> [rows * cols, D]: F.interpolate(bilinear, align_corners=False,
    antialias=True) of the table, as transformers computes it (float32 weights per axis:
    a triangle of support max(1, side / n) around each output's centre, normalized)."""
    side = table.shape[0]
    source = torch.arange(side, dtype=torch.float32, device=table.device)

    def weights(n: int) -> torch.Tensor:  # [n, side]
        scale = torch.tensor(side / n, dtype=torch.float32)
        center = (torch.arange(n, dtype=torch.float32, device=table.device) + 0.5) * scale - 0.5
        w = (1 - (source - center[:, None]).abs() / scale.clamp(min=1)).clamp(min=0)
        return w / w.sum(-1, keepdim=True)

    out = torch.einsum("ia,jb,abd->ijd", weights(rows), weights(cols), table.float())
    return out.reshape(rows * cols, -1).to(table.dtype)


class _Embeddings(nn.Module):
    def __init__(self, vision: Any) -> None:
        super().__init__()
        d, p, n = int(vision.hidden_size), int(vision.patch_size), int(vision.num_patches)
        self.side = math.isqrt(n)
        if self.side**2 != n:
            raise ValueError(f"vision_config.num_patches={n} is not a square position table")
        self.patch_embedding = nn.Linear(int(vision.num_channels) * p * p, d)
        self.position_embedding = nn.Embedding(n, d)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        x = self.patch_embedding(patches.to(self.patch_embedding.weight.dtype))  # [N, L, D]
        table = self.position_embedding.weight.view(self.side, self.side, -1)
        return x + resized_positions(table, *grid)


class Siglip2Tower(nn.Module):
    """transformers' Siglip2VisionModel without its head (weight names kept): views of one
    patch grid [N, h * w, p * p * 3] -> last_hidden_state [N, h * w, D]."""

    def __init__(self, vision: Any) -> None:
        super().__init__()
        if getattr(vision, "model_type", None) != "siglip2_vision_model":
            raise ValueError(
                f"vision_config.model_type={getattr(vision, 'model_type', None)!r} is not "
                "supported for LFM2-VL: siglip2_vision_model"
            )
        self.embeddings = _Embeddings(vision)
        self.encoder = VisionEncoder(vision, int(vision.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(int(vision.hidden_size), eps=vision.layer_norm_eps)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        x = self.embeddings(patches, grid)
        for layer in self.encoder.layers:
            x = layer(x)  # no mask: every patch is the view's
        return self.post_layernorm(x)


class _Projector(nn.Module):  # transformers' Lfm2VlMultiModalProjector
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.factor = int(config.downsample_factor)
        wide = int(config.vision_config.hidden_size) * self.factor**2
        inner, bias = int(config.projector_hidden_size), bool(config.projector_bias)
        use_norm = bool(config.projector_use_layernorm)
        self.layer_norm = nn.LayerNorm(wide) if use_norm else None
        self.linear_1 = nn.Linear(wide, inner, bias=bias)
        self.act = get_act_fn(config.projector_hidden_act, "projector_hidden_act")
        self.linear_2 = nn.Linear(inner, int(config.text_config.hidden_size), bias=bias)

    def forward(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        x = pixel_shuffle(x, self.factor, rows)  # [N, h * w, D] -> [N, h * w / f^2, f^2 D]
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return self.linear_2(self.act(self.linear_1(x)))


def _ours(name: str) -> str | None:
    """A checkpoint name of the tower or projector in this module's names (else None; the
    tower's pooling head is not read)."""
    name = name.removeprefix("model.")
    if name.startswith("vision_tower."):
        name = name.replace("vision_tower.vision_model.", "vision_tower.", 1)
        return None if name.startswith("vision_tower.head.") else name
    return name if name.startswith("multi_modal_projector.") else None


class Lfm2VlImageEncoder(nn.Module):
    """Views -> rows of the text model's input embedding, one per placeholder."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.vision_tower = Siglip2Tower(config.vision_config)
        self.multi_modal_projector = _Projector(config)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower(patches, grid), grid[0])

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each view's rows; views of one grid run as one batch."""
        weight = self.multi_modal_projector.linear_1.weight
        out: list[torch.Tensor | None] = [None] * len(images)
        by_grid: dict[tuple[int, int], list[int]] = {}
        for i, m in enumerate(images):
            by_grid.setdefault(tuple(m.image_size), []).append(i)  # type: ignore[arg-type]
        for grid, group in by_grid.items():
            patches = torch.stack([images[i].pixel_values for i in group])  # type: ignore[misc]
            rows = self(patches.to(weight.device, weight.dtype), grid)
            for i, r in zip(group, rows, strict=True):
                out[i] = r
        return out  # type: ignore[return-value]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `[model.]vision_tower.[vision_model.]*` and
        `[model.]multi_modal_projector.*` tensors (any other name is passed over); ValueError
        naming a missing or unexpected one."""
        picked = ((n, t) for n, t in ((_ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)
