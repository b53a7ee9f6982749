"""Nemotron-H Omni's images on the host: its torchvision-only image processor in torch, and the
prompt layout (the tower and projector: multimodal/nemotron_h_omni.py).

NemotronH_Omni_Reasoning_V3ImageProcessor's steps, as `NemotronOmniTorchProcessor` runs them:

    budget = max((max_model_len - 4) * m^2, min_num_patches * images) capped at
        max_num_patches (0: no cap), at least min_num_patches (m = 1 / downsample_ratio)
    grid: round(H / p + 0.5) x round(W / p + 0.5), scaled down (floor) into the budget, up
        (ceil) to min_num_patches, each side then rounded up to a multiple of m where the
        budget allows, else down (at least m)
    image (RGB uint8 -> float32) -> bicubic resize with antialias to the grid's pixels (float32,
        no clamp: torchvision's rule for float images; none where the size is the grid's) ->
        rescale + normalize (CLIP mean / std) -> patches [h * w, 3 * p * p], row-major, each
        channel-major; pixel_values the images' patches concatenated, image_grid_hw [images, 2]

The prompt (NemotronH_Omni_Reasoning_V3Processor): each image token becomes <img>, h * w / m^2
image tokens, </img>. One image per `ImageInput`, size its grid (h, w); 1-D positions.

The budget depends on how many images one processor call holds only where min_num_patches *
images passes (max_model_len - 4) * m^2; that case is refused by name (images here run one at
a time). Refused as mm_processor_kwargs: patch_size and downsample_ratio (the tower's grid).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import (
    Layout,
    Loaded,
    Run,
    Size,
    _shape_error,
    digest,
    token_ids,
)
from paged_engine.multimodal.torch_processors import (
    ProcessorKwargs,
    TorchImageProcessor,
    normalize,
    saved_settings,
)

_DEFAULTS: dict[str, Any] = {  # the image processor's class attributes
    "do_resize": True,
    "resample": 3,  # bicubic
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],  # OPENAI_CLIP_MEAN
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_convert_rgb": True,
    "patch_size": 16,
    "downsample_ratio": 0.5,
    "min_num_patches": 1024,
    "max_num_patches": 13312,
    "max_model_len": 16384,
}


class _OmniKwargs(ProcessorKwargs, total=False):
    patch_size: int
    downsample_ratio: float
    min_num_patches: int
    max_num_patches: int
    max_model_len: int


def patch_budget(images: int, m: int, low: int, high: int, context: int) -> int:
    """Every image's patch budget in a call of `images` images."""
    n = max((context - 4) * m * m, low * images)
    if high:
        n = min(n, high)
    return max(n, low)


def patch_grid(height: int, width: int, p: int, m: int, low: int, high: int) -> tuple[int, int]:
    """(h, w) patches an image is resized to, within [low, high] patches, sides in m's."""
    gh, gw = round(height / p + 0.5), round(width / p + 0.5)
    f = min(math.sqrt(high / (gh * gw)), 1.0)
    gh, gw = math.floor(f * gh), math.floor(f * gw)
    if high > low and gh * gw < low:
        f = math.sqrt(low / (gh * gw))
        gh, gw = math.ceil(f * gh), math.ceil(f * gw)
    if r := gh % m:
        gh = gh + m - r if (gh + m - r) * gw <= high else max(m, gh - r)
    if r := gw % m:
        gw = gw + m - r if gh * (gw + m - r) <= high else max(m, gw - r)
    return gh, gw


class NemotronOmniTorchProcessor(TorchImageProcessor):
    """NemotronH_Omni_Reasoning_V3ImageProcessor's call in torch alone (the module docstring's
    steps); the Hub's `norm_mean` / `norm_std` settings read as image_mean / image_std."""

    name = "NemotronH_Omni_Reasoning_V3ImageProcessor"
    defaults: ClassVar[dict[str, Any]] = _DEFAULTS
    valid_kwargs = _OmniKwargs

    def __init__(self, settings: dict[str, Any], config: Any = None) -> None:
        settings = dict(settings)
        for hub, ours in (("norm_mean", "image_mean"), ("norm_std", "image_std")):
            if settings.get(hub) is not None:
                settings.setdefault(ours, settings[hub])
        super().__init__(settings, config)

    def check(self, s: dict[str, Any]) -> None:
        super().check(s)
        if self.config is None:
            return
        for name, want in (
            ("patch_size", int(self.config.vision_config.patch_size)),
            ("downsample_ratio", float(self.config.downsample_ratio)),
        ):
            if s[name] != want:
                raise ValueError(
                    f"the image processor's {name}={s[name]!r} differs from the model's ({want!r})"
                )

    def preprocess(self, images: list[torch.Tensor], s: dict[str, Any]) -> dict[str, Any]:
        p, m = int(s["patch_size"]), round(1 / float(s["downsample_ratio"]))
        low, high, context = (
            int(s[k]) for k in ("min_num_patches", "max_num_patches", "max_model_len")
        )
        budget = patch_budget(len(images), m, low, high, context)
        out, grids = [], []
        for x in images:
            gh, gw = patch_grid(x.shape[-2], x.shape[-1], p, m, low, budget)
            y = x.float()
            if tuple(y.shape[-2:]) != (gh * p, gw * p):
                mode = {2: "bilinear", 3: "bicubic"}.get(int(s["resample"]))
                if mode is None:
                    raise ValueError(f"{self.name}'s resample={s['resample']!r}: 2 or 3 only")
                y = F.interpolate(
                    y[None], (gh * p, gw * p), mode=mode, align_corners=False, antialias=True
                )[0]
            y = normalize(y, s)  # float32, the rescale fused into mean / std
            c = y.shape[0]
            patches = y.view(c, gh, p, gw, p).permute(1, 3, 0, 2, 4)
            out.append(patches.reshape(gh * gw, c * p * p))
            grids.append((gh, gw))
        return {"pixel_values": torch.cat(out), "image_grid_hw": torch.tensor(grids)}


class NemotronOmniLayout(Layout):
    """<img>, a run of h * w / m^2 image tokens, </img>; patches [h * w, 3 p p]; size (h, w)."""

    takes_embeds = False
    refused_kwargs: ClassVar[dict[str, str]] = {
        "downsample_ratio": "the model's downsample_ratio fixes the runs",
    }

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        from paged_engine.multimodal.nemotron_h_omni import check_config

        check_config(config)
        self.config = config
        self.placeholder = placeholder
        self.fixed = None
        self.patch = int(config.vision_config.patch_size)
        self.bounds = token_ids(
            tokenizer,
            getattr(tokenizer, "image_start_token", None) or "<img>",
            getattr(tokenizer, "image_end_token", None) or "</img>",
        )
        path = getattr(config, "_name_or_path", "")
        saved = saved_settings(path) if path else {}
        self.settings = {**_DEFAULTS, **{k: v for k, v in saved.items() if k in _DEFAULTS}}

    def length(self, size: Size) -> int:
        from paged_engine.multimodal.nemotron_h_omni import tokens

        if size is None or len(size) != 2:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not (h, w)")
        return tokens(self.config, size[0], size[1])

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        assert size is not None and len(size) == 2
        return (size[0] * size[1], 3 * self.patch * self.patch)

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        s = self.settings
        m = round(1 / float(s["downsample_ratio"]))
        keys = ("min_num_patches", "max_num_patches", "max_model_len")
        low, high, context = (int(s[k]) for k in keys)
        if patch_budget(count, m, low, high, context) != patch_budget(1, m, low, high, context):
            raise ValueError(
                f"multi_modal_data['image']: {count} images change the image processor's patch "
                f"budget (min_num_patches={low} x images passes max_model_len={context}); "
                "not supported"
            )
        out = run([image])
        gh, gw = (int(v) for v in out["image_grid_hw"][0])
        pixels = out["pixel_values"].float()
        if tuple(pixels.shape) != self.pixel_shape((gh, gw)):
            raise _shape_error(pixels, self.pixel_shape((gh, gw)))
        return pixels, (gh, gw)

    def segment(self, loaded: Loaded) -> list[int]:
        start, end = self.bounds
        return [start, *([self.placeholder] * self.length(loaded[1])), end]

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        pixels, size = loaded
        n = self.length(size)
        return [ImageInput(pixels, at + 1, n, digest(pixels, size), size)]  # after <img>
