"""Phi4MultimodalImageProcessor's steps in torch alone (transformers builds it on torchvision
only), for multimodal/phi4mm.py; torch_processors.py picks it where torchvision is missing.

    image (RGB uint8 [3, H, W]) -> crop grid (wc, hc) = (ceil(W / S), ceil(H / S)); past
        dynamic_hd crops, the grid of at most dynamic_hd whose aspect ratio is closest to the
        image's (ties: the later, larger grid where the image covers over half of it)
    -> resized to fit the grid, aspect kept (bilinear, antialiased, on uint8: the processor's
        `resample` is not used here), padded white right / bottom to hc S x wc S
    -> rescaled and normalized (float32) -> the global view: that image resized to S x S
        (`resample`, bicubic; float, no antialias) -> views [1 + hc wc, 3, S, S], global first,
        crops row-major; a patch mask [hc m, wc m] (m = S / patch) whose last
        floor(pad / patch) rows / cols are 0
    out: image_pixel_values [images, most views, 3, S, S] (zero views after an image's),
        image_attention_mask [images, most views, m, m] (ones after), image_sizes [images, 2]
        (hc S, wc S), num_img_tokens (HF's count: 256 + 1 + u_h u_w + u_h + 16)
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from paged_engine.multimodal.phi4mm import valid_pooled
from paged_engine.multimodal.torch_processors import (
    ProcessorKwargs,
    TorchImageProcessor,
    normalize,
    resize,
    square_size,
)

_BILINEAR, _BICUBIC = 2, 3


class _Phi4Kwargs(ProcessorKwargs, total=False):
    size: dict[str, int]
    patch_size: int
    dynamic_hd: int


def _ratios(most: int) -> set[tuple[int, int]]:
    """transformers' target_ratios, {(i, j): i * j <= most}, each pair added in the order its
    comprehension (n to most, i and j to n: most**3 steps, minutes past a few hundred) first
    meets it: by n = max(i, j), then i, then j. The same adds give the same set order, which
    decides exact ties of the search below."""
    out: set[tuple[int, int]] = set()
    for n in range(1, most + 1):
        for i in range(1, min(n, most // n + 1)):  # i < n, j = n
            out.add((i, n))
        for j in range(1, min(n, most // n) + 1):  # i = n, j <= n
            out.add((n, j))
    return out


def crop_grid(h: int, w: int, side: int, most: int) -> tuple[int, int]:
    """(wc, hc): the crop grid of an h x w image (see the module)."""
    wc, hc = math.ceil(w / side), math.ceil(h / side)
    if wc * hc <= most:
        return wc, hc
    aspect, area = w / h, w * h
    best, best_diff = (1, 1), float("inf")
    for i, j in sorted(_ratios(most), key=lambda r: r[0] * r[1]):
        diff = abs(aspect - i / j)
        if diff < best_diff:
            best, best_diff = (i, j), diff
        elif diff == best_diff and area > 0.5 * side * side * i * j:
            best = (i, j)
    return best


def fit(h: int, w: int, side: int, most: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((hc, wc), (new h, new w)): the grid and the size the image is resized to inside it;
    ValueError where a side would fall under 10 pixels."""
    wc, hc = crop_grid(h, w, side, most)
    th, tw = hc * side, wc * side
    if tw / w < th / h:
        new = (int(h * (tw / w)), tw)
    else:
        new = (th, int(w * (th / h)))
    if min(new[0], th) < 10 or min(new[1], tw) < 10:
        raise ValueError(f"the image's aspect ratio is too extreme ({h} x {w} -> {new})")
    return (hc, wc), new


class Phi4MMTorchProcessor(TorchImageProcessor):
    """Phi4MultimodalImageProcessor (see the module)."""

    name = "Phi4MultimodalImageProcessor"
    defaults: ClassVar[dict[str, Any]] = {
        "resample": _BICUBIC,
        "size": {"height": 448, "width": 448},
        "patch_size": 14,
        "dynamic_hd": 36,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
    }
    valid_kwargs = _Phi4Kwargs

    def check(self, s: dict[str, Any]) -> None:
        super().check(s)
        side, patch, most = square_size(s, self.name), s["patch_size"], s["dynamic_hd"]
        if not (isinstance(patch, int) and 0 < patch <= side and side % patch == 0):
            raise ValueError(f"{self.name}'s patch_size={patch!r}: a divisor of size {side}")
        if not (isinstance(most, int) and most >= 1):
            raise ValueError(f"{self.name}'s dynamic_hd={most!r}: an int >= 1")

    def preprocess(self, images: list[torch.Tensor], s: dict[str, Any]) -> dict[str, Any]:
        side, patch = square_size(s, self.name), int(s["patch_size"])
        m = side // patch
        views, masks, sizes, tokens = [], [], [], []
        for x in images:
            (hc, wc), new = fit(*x.shape[-2:], side, int(s["dynamic_hd"]))
            x = resize(x, new, _BILINEAR)
            pad_h, pad_w = hc * side - new[0], wc * side - new[1]
            x = F.pad(x, (0, pad_w, 0, pad_h), value=255)
            x = normalize(x, s).float()  # [3, hc S, wc S]
            whole = x[None]
            if tuple(x.shape[-2:]) != (side, side):
                mode = {_BILINEAR: "bilinear", _BICUBIC: "bicubic"}.get(s["resample"])
                if mode is None:
                    raise ValueError(f"{self.name}'s resample={s['resample']!r}: 2 or 3")
                whole = F.interpolate(whole, (side, side), mode=mode, align_corners=False)
            crops = x.view(3, hc, side, wc, side).permute(1, 3, 0, 2, 4).reshape(-1, 3, side, side)
            views.append(torch.cat([whole, crops]))
            grid = torch.ones(hc * m, wc * m)
            grid[hc * m - pad_h // patch :, :] = 0
            grid[:, wc * m - pad_w // patch :] = 0
            mask = grid.view(hc, m, wc, m).transpose(1, 2).reshape(-1, m, m)
            masks.append(torch.cat([torch.ones(1, m, m), mask]))
            sizes.append([hc * side, wc * side])
            u_h, u_w = valid_pooled((hc, wc, hc * m - pad_h // patch, wc * m - pad_w // patch), m)
            tokens.append(256 + 1 + u_h * u_w + u_h + 16)
        most = max(v.shape[0] for v in views)
        pixels = torch.stack([F.pad(v, (0, 0, 0, 0, 0, 0, 0, most - len(v))) for v in views])
        mask = torch.stack([F.pad(k, (0, 0, 0, 0, 0, most - len(k)), value=1) for k in masks])
        return {
            "image_pixel_values": pixels,
            "image_attention_mask": mask,
            "image_sizes": torch.tensor(sizes, dtype=torch.long),
            "num_img_tokens": tokens,
        }
