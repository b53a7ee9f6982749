"""LFM2-VL's image path (Lfm2VlForConditionalGeneration): a SigLIP2 NaFlex tower that reads each
view at its own patch grid, pixel unshuffle and an MLP projector into the LFM2 decoder
(models/lfm2.py, served through models/text_wrappers.py).

    image -> Lfm2VlImageProcessor's rule (as transformers runs it):
        smart resize: (H, W) to multiples of u = patch * downsample_factor (Python's round),
            scaled down (floor) over max_image_tokens * u^2 pixels, up (ceil) under
            min_image_tokens * u^2
        too large (rounded H * W over max_image_tokens * u^2 * max_pixels_tolerance) and
        do_image_splitting: a cols x rows grid of tile_size tiles (the (w, h) ratio of
        min_tiles..max_tiles tiles closest to W / H; a tie goes to the later ratio when
        the image covers over half its area), the image resized to the grid and cut
        row-major, then the smart-resized image as a thumbnail (use_thumbnail)
        else one view: the smart-resized image
        resize: bilinear with antialias on the uint8 image; then (x - 255 mean) / (255 std);
        patches [h * w, p * p * 3] (row-major patches, each (row, col, channel))
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
`Lfm2VlImageProcessor` here, the same steps in torch alone, from the checkpoint's
preprocessor_config.json (or processor_config.json's image_processor). Refused by name:
resample other than bilinear, encoder_patch_size / downsample_factor unlike the model's,
tile_size not a multiple of patch * downsample_factor, min_tiles < 2 with do_image_splitting
(a 1 x 1 grid's tile would not be the run the prompt counts), a non-square position table
(vision_config.num_patches), vision_config.model_type other than siglip2_vision_model.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.torch_processors import to_uint8
from paged_engine.multimodal.vision_transformer import VisionEncoder, pixel_shuffle

ARCH = "Lfm2VlForConditionalGeneration"
IMAGE, START, END, THUMBNAIL = "<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"
_BILINEAR = 2  # PILImageResampling.BILINEAR
# an image's views: their patches [h * w, p * p * 3], their grids (h, w), the tiles (rows, cols)
Views = tuple[list[torch.Tensor], list[tuple[int, int]], tuple[int, int]]
_DEFAULTS = {  # Lfm2VlImageProcessor's class attributes
    "downsample_factor": 2,
    "do_image_splitting": True,
    "min_tiles": 2,
    "max_tiles": 10,
    "use_thumbnail": True,
    "min_image_tokens": 64,
    "max_image_tokens": 256,
    "encoder_patch_size": 16,
    "tile_size": 512,
    "max_pixels_tolerance": 2.0,
    "resample": _BILINEAR,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def tile_token(row: int, col: int) -> str:
    """The special token before tile (row, col) of a grid (1-based)."""
    return f"<|img_row_{row}_col_{col}|>"


def read_settings(path: Path) -> dict[str, Any]:
    """The image processor's settings saved with the checkpoint, over the class defaults."""
    saved: dict[str, Any] = {}
    pre, proc = path / "preprocessor_config.json", path / "processor_config.json"
    if pre.exists():
        saved = json.loads(pre.read_text())
    elif proc.exists():
        saved = json.loads(proc.read_text()).get("image_processor", {})
    return {**_DEFAULTS, **{k: v for k, v in saved.items() if k in _DEFAULTS}}


def _closest_ratio(aspect: float, ratios: list[tuple[int, int]], area: int, tile: int):
    """transformers' find_closest_aspect_ratio: (w, h) tiles."""
    best_diff, best = float("inf"), (1, 1)
    for ratio in ratios:
        diff = abs(aspect - ratio[0] / ratio[1])
        if diff < best_diff:
            best_diff, best = diff, ratio
        elif diff == best_diff and area > 0.5 * tile * tile * ratio[0] * ratio[1]:
            best = ratio
    return best


class Lfm2VlImageProcessor:
    """Lfm2VlImageProcessor's steps in torch alone (no torchvision): image -> its views'
    patches [h * w, p * p * 3] float32 and patch grids (h, w), tiles first."""

    def __init__(self, settings: dict[str, Any], config: Any) -> None:
        s = settings
        if s["resample"] != _BILINEAR:
            raise ValueError(f"preprocessor_config.json resample={s['resample']!r}: bilinear (2)")
        self.patch, self.factor = int(s["encoder_patch_size"]), int(s["downsample_factor"])
        if self.patch != patch_size(config) or self.factor != int(config.downsample_factor):
            raise ValueError(
                f"preprocessor_config.json encoder_patch_size={self.patch} / downsample_factor="
                f"{self.factor} differ from the model's ({patch_size(config)}, "
                f"{config.downsample_factor})"
            )
        self.unit = self.patch * self.factor
        self.tile = int(s["tile_size"])
        if self.tile % self.unit:
            raise ValueError(
                f"preprocessor_config.json tile_size={self.tile} is not a multiple of "
                f"encoder_patch_size * downsample_factor ({self.unit})"
            )
        split = bool(s["do_image_splitting"])
        self.min_tiles, self.max_tiles = int(s["min_tiles"]), int(s["max_tiles"])
        if not split:
            self.min_tiles = self.max_tiles = 1
        if split and not 2 <= self.min_tiles <= self.max_tiles:
            raise ValueError(
                f"preprocessor_config.json min_tiles={self.min_tiles}, max_tiles="
                f"{self.max_tiles}: 2 <= min_tiles <= max_tiles with do_image_splitting"
            )
        self.ratios = sorted(
            {
                (w, h)
                for n in range(self.min_tiles, self.max_tiles + 1)
                for w in range(1, n + 1)
                for h in range(1, n + 1)
                if self.min_tiles <= w * h <= self.max_tiles
            },
            key=lambda r: r[0] * r[1],
        )
        self.thumbnail = bool(s["use_thumbnail"])
        self.min_tokens, self.max_tokens = int(s["min_image_tokens"]), int(s["max_image_tokens"])
        self.tolerance = float(s["max_pixels_tolerance"])
        mean = torch.tensor(s["image_mean"])[:, None, None]
        std = torch.tensor(s["image_std"])[:, None, None]
        if s["do_normalize"] and s["do_rescale"]:  # transformers fuses the rescale into both
            mean, std = mean * (1.0 / s["rescale_factor"]), std * (1.0 / s["rescale_factor"])
        self.mean, self.std = mean, std
        self.do_normalize, self.do_rescale = bool(s["do_normalize"]), bool(s["do_rescale"])
        self.rescale = float(s["rescale_factor"])

    def smart_size(self, height: int, width: int) -> tuple[int, int]:
        """(h, w) of the one view or the thumbnail, multiples of the unit."""
        u = self.unit
        lo, hi = self.min_tokens * u * u, self.max_tokens * u * u
        h, w = max(u, round(height / u) * u), max(u, round(width / u) * u)
        if h * w > hi:
            beta = math.sqrt(height * width / hi)
            h = max(u, math.floor(height / beta / u) * u)
            w = max(u, math.floor(width / beta / u) * u)
        elif h * w < lo:
            beta = math.sqrt(lo / (height * width))
            h, w = math.ceil(height * beta / u) * u, math.ceil(width * beta / u) * u
        return h, w

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of tiles: (1, 1) for an image that is not split."""
        u = self.unit
        h, w = max(self.patch, round(height / u) * u), max(self.patch, round(width / u) * u)
        large = h * w > self.max_tokens * u * u * self.tolerance
        if not large or self.min_tiles == self.max_tiles == 1:
            return 1, 1
        cols, rows = _closest_ratio(width / height, self.ratios, height * width, self.tile)
        return rows, cols

    def _resize(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        if tuple(x.shape[-2:]) == (h, w):  # torchvision's own shortcut
            return x
        return F.interpolate(
            x[None], size=(h, w), mode="bilinear", align_corners=False, antialias=True
        )[0]

    def _patches(self, x: torch.Tensor) -> torch.Tensor:  # [3, H, W] uint8 -> [h * w, p*p*3]
        x = (x.float() - self.mean) / self.std if self.do_normalize else x.float()
        if not self.do_normalize and self.do_rescale:
            x = x * self.rescale
        c, height, width = x.shape
        p = self.patch
        x = x.view(c, height // p, p, width // p, p).permute(1, 3, 2, 4, 0)
        return x.reshape((height // p) * (width // p), p * p * c).contiguous()

    def __call__(self, image: Any) -> Views:
        """(each view's patches, each view's grid (h, w), the tile grid (rows, cols))."""
        x = to_uint8(image)
        height, width = x.shape[-2:]
        rows, cols = self.grid(height, width)
        h, w = self.smart_size(height, width)
        views = []
        if rows * cols > 1:
            big = self._resize(x, rows * self.tile, cols * self.tile)
            t = self.tile
            views = [
                big[:, r * t : (r + 1) * t, c * t : (c + 1) * t]
                for r in range(rows)
                for c in range(cols)
            ]
        if rows * cols == 1 or self.thumbnail:
            views.append(self._resize(x, h, w))
        grids = [(v.shape[1] // self.patch, v.shape[2] // self.patch) for v in views]
        return [self._patches(v) for v in views], grids, (rows, cols)


def patch_size(config: Any) -> int:
    return int(config.vision_config.patch_size)


def hf_processor_available() -> bool:
    """Whether transformers can import Lfm2VlImageProcessor (it needs torchvision)."""
    return importlib.util.find_spec("torchvision") is not None


def local_processor(config: Any) -> Lfm2VlImageProcessor | None:
    """The torch-only processor where transformers' cannot import, else None."""
    if hf_processor_available():
        return None
    path = Path(getattr(config, "name_or_path", "") or ".")
    return Lfm2VlImageProcessor(read_settings(path), config)


def load_image(processor: Lfm2VlImageProcessor | None, run: Any, image: Any) -> Views:
    """One image's views (patches, grids, tile grid; see `Lfm2VlImageProcessor`):
    transformers' processor through `run` when it imports (its padding cut off), else
    `processor`."""
    if processor is not None:
        return processor(image)
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
