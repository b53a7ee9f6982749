"""MiniCPM-OCR (MiniCPMOcrForConditionalGeneration): MiniCPM-V 4.6's model under another name,
and its torchvision-only image processor in torch alone.

transformers' MiniCPMOcr modeling is MiniCPMV4_6's line for line (the same tower, window merger,
merger and Qwen3.5 decoder: multimodal/minicpmv.py's encoder, MiniCPMVLayout's prompt); the
config differs in its defaults only (downsample_mode "4x", tied embeddings). Its image
processor (MiniCPMOcrImageProcessor) exists on torchvision only; its steps, as
`MiniCPMOcrTorchProcessor` runs them (torch_processors.py's torchvision resize and normalize):

    image (RGB uint8 [3, H, W]) -> grid = get_sliced_grid (slice_mode; None when the image
        fits in scale_resolution^2): slice counts ceil(H * W / res^2) +- 1 (capped by
        max_slice_nums), rows x cols closest to the image's log aspect ratio (ties: more rows)
    thumbnail: best_resize to ~res^2 at the image's aspect ratio (upscaled only where the image
        is larger or, unsliced, small_image_upsize "always"), sides rounded to a multiple of
        patch * merge (merge 2 for "4x", 4 for "16x"; at least one)
    slices: the image resized to rows x cols of best_resize(cell) (always upscaled), cut
        row-major into equal cells
    each view -> rescale + normalize (float32) -> NaViT-packed [3, p, h * w * p] (patches
        row-major, each patch's pixel rows side by side); pixel_values [1, 3, p, sum] of every
        view of the call, target_sizes [views, 2] int32 (patch grids), grids per image
        ([0, 0]: unsliced), num_patches_per_image

Refused by name: small_image_upsize "adaptive" (an OpenCV glyph classifier picks the size;
not copied), do_resize False (transformers refuses it too), a patch_size or downsample_mode
other than the model's (the encoder's grid), and use_image_id / downsample_mode as
mm_processor_kwargs (the prompt's markers and runs are the checkpoint's). Videos are not run.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from paged_engine.multimodal.layouts_slices import MiniCPMVLayout
from paged_engine.multimodal.torch_processors import (
    ProcessorKwargs,
    TorchImageProcessor,
    normalize,
    resize,
    saved_settings,
)

_DEFAULTS: dict[str, Any] = {  # MiniCPMOcrImageProcessor's class attributes
    "do_resize": True,
    "resample": 3,  # bicubic
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": True,
    "max_slice_nums": 9,
    "scale_resolution": 448,
    "patch_size": 14,
    "slice_mode": True,
    "downsample_mode": "4x",
    "use_image_id": True,
    "small_image_upsize": "always",
}
UPSIZE = ("always", "never")


class _OcrKwargs(ProcessorKwargs, total=False):
    max_slice_nums: int
    scale_resolution: int
    patch_size: int
    slice_mode: bool
    downsample_mode: str
    use_image_id: bool
    small_image_upsize: str


def _round_to(length: float, unit: int) -> int:
    """The nearest multiple of `unit` (Python's round, half to even), at least `unit`."""
    return max(round(length / unit) * unit, unit)


def best_resize(
    size: tuple[float, float], res: int, patch: int, merge: int, upscale: bool
) -> tuple[int, int]:
    """(h, w) a view of `size` is resized to: ~res^2 pixels at its aspect ratio where it is
    larger (or `upscale`), sides in multiples of patch * merge."""
    h, w = size
    if h * w > res * res or upscale:
        ratio = w / h
        h = int(res / math.sqrt(ratio))
        w = int(h * ratio)
    return _round_to(h, patch * merge), _round_to(w, patch * merge)


def sliced_grid(h: int, w: int, max_slices: int, res: int) -> tuple[int, int] | None:
    """(rows, cols) of slices, or None where the image fits in one view."""
    multiple = min(math.ceil(h * w / (res * res)), max_slices)
    if multiple <= 1:
        return None
    log_ratio = math.log(w / h)
    best, error = (1, 1), float("inf")
    for n in (multiple - 1, multiple, multiple + 1):
        if n == 1 or n > max_slices:
            continue
        for rows in range(1, n + 1):
            if n % rows:
                continue
            e = abs(log_ratio - math.log((n // rows) / rows))
            if e < error or (e == error and rows > best[0]):
                best, error = (rows, n // rows), e
    return best


def pack(x: torch.Tensor, p: int) -> torch.Tensor:
    """[C, H, W] -> [C, p, (H/p * W/p) * p]: patches row-major, patch l's pixel row r at
    [:, r, l * p : (l + 1) * p] (transformers' reshape_by_patch)."""
    c, h, w = x.shape
    x = x.reshape(c, h // p, p, w // p, p).permute(0, 2, 1, 3, 4)
    return x.reshape(c, p, -1)


class MiniCPMOcrTorchProcessor(TorchImageProcessor):
    """MiniCPMOcrImageProcessor's call in torch alone (the module docstring's steps)."""

    name = "MiniCPMOcrImageProcessor"
    defaults: ClassVar[dict[str, Any]] = _DEFAULTS
    valid_kwargs = _OcrKwargs

    def check(self, s: dict[str, Any]) -> None:
        super().check(s)
        if s["small_image_upsize"] not in UPSIZE:
            raise ValueError(
                f"{self.name}'s small_image_upsize={s['small_image_upsize']!r} is not supported: "
                f"one of {UPSIZE} ('adaptive' needs OpenCV's glyph classifier)"
            )
        if not s["do_resize"]:
            raise ValueError(f"{self.name}'s do_resize=False is not supported (transformers': no)")
        if s["downsample_mode"] not in ("4x", "16x"):
            mode = s["downsample_mode"]
            raise ValueError(f"{self.name}'s downsample_mode={mode!r} is not '4x' or '16x'")
        config = self.config
        if config is None:
            return
        for name, want in (
            ("patch_size", int(config.vision_config.patch_size)),
            ("downsample_mode", config.downsample_mode),
        ):
            if s[name] != want:
                raise ValueError(
                    f"the image processor's {name}={s[name]!r} differs from the model's ({want!r})"
                )

    def preprocess(self, images: list[torch.Tensor], s: dict[str, Any]) -> dict[str, Any]:
        p, res = int(s["patch_size"]), int(s["scale_resolution"])
        merge = 2 if s["downsample_mode"] == "4x" else 4
        views: list[torch.Tensor] = []
        sizes: list[list[int]] = []
        grids: list[list[int]] = []
        counts: list[int] = []
        for x in images:
            h, w = x.shape[-2:]
            grid = sliced_grid(h, w, int(s["max_slice_nums"]), res) if s["slice_mode"] else None
            upscale = grid is None and s["small_image_upsize"] == "always"
            pieces = [resize(x, best_resize((h, w), res, p, merge, upscale), s["resample"])]
            if grid is not None:
                rows, cols = grid
                cell = (_round_to(h, rows) / rows, _round_to(w, cols) / cols)
                ch, cw = best_resize(cell, res, p, merge, True)
                whole = resize(x, (ch * rows, cw * cols), s["resample"])
                pieces += [
                    whole[:, r * ch : (r + 1) * ch, c * cw : (c + 1) * cw]
                    for r in range(rows)
                    for c in range(cols)
                ]
            for piece in pieces:
                views.append(pack(normalize(piece, s).float(), p))
                sizes.append([piece.shape[-2] // p, piece.shape[-1] // p])
            grids.append(list(grid) if grid is not None else [0, 0])
            counts.append(len(pieces))
        return {
            "pixel_values": torch.cat(views, dim=-1).unsqueeze(0),
            "target_sizes": torch.tensor(sizes, dtype=torch.int32),
            "grids": grids,
            "num_patches_per_image": counts,
        }


class MiniCPMOcrLayout(MiniCPMVLayout):
    """MiniCPM-V 4.6's prompt; use_image_id read from the saved settings (transformers' image
    processor may need the missing torchvision), and the names that would change the prompt's
    markers or runs refused as mm_processor_kwargs."""

    refused_kwargs: ClassVar[dict[str, str]] = {
        "use_image_id": "the prompt's <image_id> markers follow the checkpoint's setting",
        "downsample_mode": "the model's downsample_mode fixes the runs",
    }

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        if self.use_id is None:
            saved = saved_settings(self.config._name_or_path)
            self.use_id = bool(saved.get("use_image_id", _DEFAULTS["use_image_id"]))
        return super().splice(ids, segments)
