"""Molmo v1's image processor (the release's image_preprocessing_molmo.py MolmoImageProcessor,
as vLLM's molmo.py runs it) and the geometry an image's size fixes: its views, prompt tokens,
pooling windows and padding masks (the prompt: multimodal/molmo_v1.py; the tower:
molmo_v1_encoder.py).

    settings (preprocessor_config.json over the release's defaults): crop S x S pixels
        (base_image_input_size), patch p (image_patch_size), cp = S / p patches a side,
        margins (l, r) patches (overlap_margins), max_crops; window = cp - l - r patches
    tiling (th, tw) = select_tiling(H - (l + r) p, W - (l + r) p) over th * tw <= max_crops
        in windows of window * p pixels (float32 as the release: the smallest scale-up,
        else the largest scale-down; ties to fewer tiles, then fewer rows)
    resize_and_pad(image, (h, w)): scale = min(h / H, w / W) in float32, the image resized to
        int(H scale) x int(W scale) (bilinear with antialiasing, in float32 on [0, 1],
        clipped), centered on a zero canvas (half the padding before), then normalized
        (x - mean) / std; the mask: which canvas pixels hold the image
    views: the global view (resize_and_pad to S x S) first, then the canvas
        (th window + l + r) p by (tw window + l + r) p cut into th x tw crops of S x S at
        strides of window * p (neighbours overlap by l + r patches), row-major
    masks (image_masks, per patch: the fraction of its pixels holding the image), as the
        release pairs them with the views: crop k's mask on view k (the global view takes
        crop 0's), the last view -1 (the release appends that row after the crops' masks)
    pooled tokens: each view's cp x cp patches in 2 x 2 windows -> (cp / 2)^2 tokens,
        row-major; the global view's all, then the canvas' grid row-major: crop row i keeps
        pooled rows [i > 0 ? l / 2 : 0, ...) of (window + (i == 0 ? l : 0)
        + (i == th - 1 ? r : 0) + 1) / 2, and columns alike (the crops' margins dropped)
    tokens: <im_start> (<im_patch> x cp/2 <im_col>) x cp/2 <im_end>          the global view
            <im_start> (<im_patch> x (W' + 1) / 2 <im_col>) x (H' + 1) / 2 <im_end>
            with H' = th window + l + r, W' alike                              the crops

The release resizes with TensorFlow's bilinear antialiased resize (its file imports
tensorflow); this runs torch's, the same triangle filter (not checked against TensorFlow).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

# the release's MolmoImageProcessor defaults
DEFAULTS: dict[str, Any] = {
    "max_crops": 12,
    "overlap_margins": [4, 4],
    "base_image_input_size": [336, 336],
    "image_patch_size": 14,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],  # OpenAI CLIP's
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
MOST_CROPS = 64  # max_crops bound (the views' tower runs grow with it)


def saved_settings(path: Path) -> dict[str, Any]:
    """preprocessor_config.json's fields over DEFAULTS."""
    file = Path(path) / "preprocessor_config.json"
    saved = json.loads(file.read_text()) if file.is_file() else {}
    return {k: saved.get(k, v) for k, v in DEFAULTS.items()}


def select_tiling(h: int, w: int, window: int, max_crops: int) -> tuple[int, int]:
    """(rows, cols) of crops for an h x w image (the release's rule; see the module)."""
    tilings = [(i, j) for i in range(1, max_crops + 1) for j in range(1, max_crops + 1)]
    tilings = sorted(
        (t for t in tilings if t[0] * t[1] <= max_crops), key=lambda t: (t[0] * t[1], t[0])
    )
    sizes = np.array(tilings, dtype=np.int32) * window
    scale = (sizes.astype(np.float32) / np.array([h, w], dtype=np.float32)).min(axis=-1)
    if np.all(scale < 1):
        return tilings[int(np.argmax(scale))]
    return tilings[int(np.argmin(np.where(scale < 1.0, 10e9, scale)))]


def fit(height: int, width: int, out_h: int, out_w: int) -> tuple[int, int, int, int]:
    """(scaled h, scaled w, top, left) of resize_and_pad (float32 as the release)."""
    scale = min(np.float32(out_h) / np.float32(height), np.float32(out_w) / np.float32(width))
    sh, sw = int(np.float32(height) * scale), int(np.float32(width) * scale)
    return sh, sw, (out_h - sh) // 2, (out_w - sw) // 2


@dataclass(frozen=True, slots=True)
class Geometry:
    """What an image's size fixes (image_size: (H, W, th, tw, l, r, cp, p))."""

    height: int
    width: int
    th: int
    tw: int
    left: int
    right: int
    cp: int  # patches a crop side
    p: int  # pixels a patch side

    @property
    def window(self) -> int:
        return self.cp - self.left - self.right

    @property
    def views(self) -> int:
        return 1 + self.th * self.tw

    def canvas(self) -> tuple[int, int]:
        """The canvas' (h, w) in pixels."""
        margin = (self.left + self.right) * self.p
        return self.th * self.window * self.p + margin, self.tw * self.window * self.p + margin

    def _kept(self, n: int) -> list[tuple[int, int]]:
        """(first pooled row, rows) each of n crops keeps along one side."""
        half = self.cp // 2
        out = []
        for i in range(n):
            size = self.window + (self.left if i == 0 else 0) + (self.right if i == n - 1 else 0)
            start = 0 if i == 0 else self.left // 2
            out.append((start, min((size + 1) // 2, half - start)))
        return out

    def tokens(self, patch: int, start: int, end: int, col: int) -> list[int]:
        half = self.cp // 2
        rows = sum(k for _, k in self._kept(self.th))
        cols = sum(k for _, k in self._kept(self.tw))
        glob = [start, *([patch] * half + [col]) * half, end]
        return [*glob, start, *([patch] * cols + [col]) * rows, end]

    def windows(self) -> torch.Tensor:
        """[pooled tokens, 4]: each <im_patch>'s 2 x 2 patches, indices into the views'
        patches [views * cp * cp], in the prompt's order."""
        cp, half = self.cp, self.cp // 2
        corner = torch.tensor([0, 1, cp, cp + 1])  # (dh, dw) row-major in a window

        def grid(view: int, ys: range, xs: range) -> torch.Tensor:
            base = torch.tensor([view * cp * cp + 2 * y * cp + 2 * x for y in ys for x in xs])
            return base.view(len(ys), len(xs), 1) + corner

        parts = [grid(0, range(half), range(half)).view(-1, 4)]
        rows = [
            grid(1 + i * self.tw + j, range(y0, y0 + ny), range(x0, x0 + nx))
            for i, (y0, ny) in enumerate(self._kept(self.th))
            for j, (x0, nx) in enumerate(self._kept(self.tw))
        ]
        for i in range(self.th):  # the canvas row-major: crop row i's pooled rows side by side
            parts.append(torch.cat(rows[i * self.tw : (i + 1) * self.tw], dim=1).view(-1, 4))
        return torch.cat(parts)

    def masks(self) -> torch.Tensor:
        """[views, cp * cp]: the release's image_masks as it pairs them with the views."""
        ch, cw = self.canvas()
        sh, sw, top, left = fit(self.height, self.width, ch, cw)
        inside = torch.zeros(ch, cw)
        inside[top : top + sh, left : left + sw] = 1.0
        step, side = self.window * self.p, self.cp * self.p
        crops = [
            inside[i * step : i * step + side, j * step : j * step + side]
            for i in range(self.th)
            for j in range(self.tw)
        ]
        per_patch = torch.stack(crops).view(-1, self.cp, self.p, self.cp, self.p).mean((2, 4))
        last = torch.full((1, self.cp * self.cp), -1.0)
        return torch.cat([per_patch.reshape(len(crops), -1), last])


def _resized(
    image: torch.Tensor, out_h: int, out_w: int, mean: torch.Tensor, std: torch.Tensor
) -> torch.Tensor:
    """resize_and_pad of image [3, H, W] in [0, 1] -> [3, out_h, out_w], normalized."""
    sh, sw, top, left = fit(image.shape[1], image.shape[2], out_h, out_w)
    if sh < 1 or sw < 1:  # (the release's resize fails the same)
        raise ValueError(
            f"multi_modal_data['image']: a {image.shape[1]} x {image.shape[2]} image is too "
            f"thin to fit {out_h} x {out_w} pixels"
        )
    x = F.interpolate(
        image[None], size=(sh, sw), mode="bilinear", align_corners=False, antialias=True
    )
    canvas = torch.zeros(3, out_h, out_w)
    canvas[:, top : top + sh, left : left + sw] = x[0].clamp(0.0, 1.0)
    return (canvas - mean) / std


class MolmoV1ImageProcessor:
    """The release's image steps (see the module): images -> views [V, 3, S, S] + Geometry."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self.side = int(settings["base_image_input_size"][0])
        self.p = int(settings["image_patch_size"])
        self.left, self.right = (int(m) for m in settings["overlap_margins"])
        self.max_crops = int(settings["max_crops"])
        self.mean = torch.tensor(settings["image_mean"], dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(settings["image_std"], dtype=torch.float32).view(3, 1, 1)

    def one(self, image: Any) -> tuple[torch.Tensor, Geometry]:
        rgb = np.asarray(image.convert("RGB"), dtype=np.uint8)
        x = torch.from_numpy(rgb.copy()).permute(2, 0, 1).float() / 255.0  # [3, H, W]
        h, w = x.shape[1:]
        cp, margin = self.side // self.p, (self.left + self.right) * self.p
        window = (cp - self.left - self.right) * self.p
        th, tw = select_tiling(h - margin, w - margin, window, self.max_crops)
        g = Geometry(h, w, th, tw, self.left, self.right, cp, self.p)
        canvas = _resized(x, *g.canvas(), self.mean, self.std)
        crops = [
            canvas[:, i * window : i * window + self.side, j * window : j * window + self.side]
            for i in range(th)
            for j in range(tw)
        ]
        glob = _resized(x, self.side, self.side, self.mean, self.std)
        return torch.stack([glob, *crops]), g

    def __call__(self, images: list[Any], return_tensors: str = "pt") -> dict[str, list]:
        done = [self.one(image) for image in images]
        return {"pixel_values": [v for v, _ in done], "geometries": [g for _, g in done]}
