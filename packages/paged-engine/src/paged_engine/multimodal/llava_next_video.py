"""LLaVA-NeXT-Video (LlavaNextVideoForConditionalGeneration): LLaVA-NeXT's images, and videos.

Images are LLaVA-NeXT's in every respect (anyres views, unpadded tile map, image_newline;
multimodal/llava_next.py, layouts_single_run.AnyResLayout). A video:

    frames [T, H, W, 3] uint8 (a list of frames, or (frames, metadata) as vLLM's loader gives)
      -> (only where the saved video processor has do_sample_frames: num_frames of them
         evenly, or `fps` a second by the metadata's fps; frames a loader sampled stay)
      -> each frame as LlavaNextVideoVideoProcessor does through torchvision: shortest edge to
         size (aspect kept; or an exact height x width), bicubic with antialias on the uint8
         values, center crop to crop_size (zero padding where it is larger), rescale and
         normalize (CLIP's mean and std by default) -> pixels [T, 3, S, S]
      -> tower + feature selection as an image's view (the same vision_feature_layer and
         strategy), each frame's p x p map pooled (spatial_pool_mode "average" / "max",
         kernel = stride = spatial_pool_stride) -> [T, q * q, C], q = p // stride
      -> multi_modal_projector -> T * q * q rows, frame after frame
    prompt: each <video> becomes T * q * q <video> tokens

HF's processor writes (p * p // 4) * T placeholders a video, which is this count for its
stride 2 and an even p (its model could not run another count); vLLM counts with the stride
as here. The pooler's "conv" mode (a learned Conv2d) is refused by name, as vLLM does. A video
is an `ImageInput` of modality "video": the encoder's `encode` routes it to the pooled path,
the encoder and prefix caches key it by its pixels' hash. mm_processor_kwargs take nothing for
videos (each name refused); frames processed ahead (`process`'s output) are checked against
the prompt and taken as they are. Settings: the checkpoint's video processor
(video_preprocessor_config.json or processor_config.json's "video_processor") over
transformers' class defaults; without one, the image processor's resize, crop and
normalization (frames never sampled). A crop that is not the tower's S x S, another size rule
or resample is refused by name (videos then not taken), as are frames of an aspect ratio over
200 (their resize would blow one side up).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from paged_engine.multimodal.gemma4_video import sample_indices
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import _side, digest, expand_runs
from paged_engine.multimodal.llava_next import AnyRes, LlavaNextImageEncoder
from paged_engine.multimodal.qwen_video import (
    _DEFAULT_FPS,
    VideoProcessor,
    indexed_frames,
    known_kwargs,
    raw_settings,
    video_fps,
    video_list,
)

ARCHS = ("LlavaNextVideoForConditionalGeneration",)
POOL_MODES = ("average", "max")
# transformers' LlavaNextVideoVideoProcessor class defaults (BaseVideoProcessor's for the rest)
_DEFAULTS: dict[str, Any] = {
    "size": {"shortest_edge": 224},
    "crop_size": {"height": 224, "width": 224},
    "resample": 3,
    "do_resize": True,
    "do_center_crop": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_sample_frames": False,
    "num_frames": None,
    "fps": None,
}
_MODES = {2: "bilinear", 3: "bicubic"}  # PIL resample codes -> torch's interpolate mode
# what an image processor's settings give a frame, where no video processor is saved
_FRAME_KEYS = ("size", "crop_size", "resample", "do_resize", "do_center_crop", "do_rescale")
_FRAME_KEYS += ("rescale_factor", "do_normalize", "image_mean", "image_std")
MAX_ASPECT = 200  # a frame's longer side over its shorter (its resize would blow it up)


def frame_tokens(config: Any) -> int:
    """Placeholders (= pooled rows) of one frame: q * q, q = p // spatial_pool_stride; ValueError
    naming a pooling the model does not run here."""
    mode, stride = config.spatial_pool_mode, config.spatial_pool_stride
    if mode not in POOL_MODES:
        raise ValueError(f"spatial_pool_mode={mode!r} is not supported; supported: {POOL_MODES}")
    side = AnyRes.from_config(config).side  # (checks the frame's features are its p x p grid)
    if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride <= side:
        raise ValueError(f"spatial_pool_stride={stride!r} must be an int in [1, {side}]")
    return (side // stride) ** 2


class LlavaNextVideoEncoder(LlavaNextImageEncoder):
    """LLaVA-NeXT's image encoder; items of modality "video" (frames [T, 3, S, S]) take the
    pooled path (module doc)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        frame_tokens(config)
        self.stride = int(config.spatial_pool_stride)
        self.max_pool = config.spatial_pool_mode == "max"

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        videos = [m for m in images if m.modality == "video"]
        stills = [m for m in images if m.modality != "video"]
        out = dict(zip(map(id, stills), super().encode(stills) if stills else [], strict=True))
        for m in videos:
            out[id(m)] = self._video(m.pixel_values)
        return [out[id(m)] for m in images]

    def _video(self, frames: torch.Tensor) -> torch.Tensor:  # [T, 3, S, S] -> [T * q * q, D]
        weight = self.image_newline
        x = self.features(frames.to(weight.device, weight.dtype))  # [T, p * p, C]
        t, n, c = x.shape
        p = self.anyres.side
        assert n == p * p, (n, p)
        grid = x.transpose(1, 2).reshape(t, c, p, p)
        pool = F.max_pool2d if self.max_pool else F.avg_pool2d
        pooled = pool(grid, self.stride, self.stride).flatten(2).transpose(1, 2)  # [T, q*q, C]
        return self.multi_modal_projector(pooled).flatten(0, 1)


class LlavaNextVideoProcessor(VideoProcessor):
    """Turns a prompt's videos into `ImageInput`s (modality "video") at its <video> tokens."""

    kwargs_names: tuple[str, ...] = ()

    def _configure(self, path: Path, config: Any) -> None:
        self.video_token_id = int(config.video_token_id)
        self.per_frame = frame_tokens(config)
        self.side = _side(config)
        raw, own = raw_settings(path)
        s = {k: (raw.get(k, v) if own or k in _FRAME_KEYS else v) for k, v in _DEFAULTS.items()}
        crop = s["crop_size"] or {}
        square = {"height": self.side, "width": self.side}
        if not s["do_center_crop"] or {k: crop.get(k) for k in square} != square:
            raise ValueError(
                f"{path}: the video processor's crop (do_center_crop={s['do_center_crop']}, "
                f"crop_size={crop}) is not the vision tower's {self.side} x {self.side} frame"
            )
        size = s["size"] or {}
        if s["do_resize"] and not (
            size.get("shortest_edge") or (size.get("height") and size.get("width"))
        ):
            raise ValueError(f"{path}: the video processor's size={size} is not one it takes")
        if s["do_resize"] and s["resample"] not in _MODES:
            raise ValueError(
                f"{path}: the video processor's resample={s['resample']} is not one of "
                f"{sorted(_MODES)} (bilinear, bicubic)"
            )
        self.settings = s

    def check_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """`kwargs` (mm_processor_kwargs for videos): none taken, each a ValueError by name."""
        known_kwargs(kwargs, self.kwargs_names)
        return kwargs

    def positions(self, num_tokens: int, items: tuple[ImageInput, ...]) -> Any:
        return None  # plain positions

    def process(
        self, token_ids: list[int], videos: Any, kwargs: dict[str, Any] | None = None
    ) -> tuple[list[int], list[ImageInput], list[tuple[int, int]]]:
        """(token ids with each video's run, the videos in prompt order, (where in
        `token_ids`, tokens added) of each run); ValueError naming multi_modal_data['video']
        (or mm_processor_kwargs) for anything wrong."""
        self.check_kwargs(kwargs or {})
        items = video_list(videos, self.limit)
        if all(isinstance(m, ImageInput) for m in items):  # processed ahead (a server's)
            return self._placed(token_ids, items)
        frames = [self._load(i, item) for i, item in enumerate(items)]
        lengths = [f.shape[0] * self.per_frame for f in frames]
        token_ids, starts, added = expand_runs(token_ids, self.video_token_id, lengths, "video")
        out = [
            ImageInput(f, at, n, digest(f, ("video",)), modality="video")
            for f, at, n in zip(frames, starts, lengths, strict=True)
        ]
        return token_ids, out, added

    def _placed(
        self, token_ids: list[int], items: list[ImageInput]
    ) -> tuple[list[int], list[ImageInput], list[tuple[int, int]]]:
        """Videos processed ahead: frames this tower reads, each run where the prompt (expanded,
        or with one placeholder each) holds it."""
        for m in items:
            f = m.pixel_values
            if (
                m.modality != "video"
                or f is None
                or m.embeds is not None
                or m.token_rows
                or f.dim() != 4
                or tuple(f.shape[1:]) != (3, self.side, self.side)
                or m.length != f.shape[0] * self.per_frame
            ):
                raise ValueError(
                    "multi_modal_data['video']: these processed videos are not frames this "
                    "model reads (their shapes or runs differ)"
                )
        return self._fit_runs(token_ids, items)

    def _load(self, i: int, item: Any) -> torch.Tensor:
        """Video i's frames as the tower reads them: [T, 3, S, S] float32."""
        video, meta, _ = indexed_frames(i, item)  # [T, 3, H, W] uint8
        s = self.settings
        if s["do_sample_frames"] and "frames_indices" not in meta:
            rate = meta.get("fps")
            if s["num_frames"] is None and s["fps"] is not None and rate is None:
                raise ValueError(
                    f"multi_modal_data['video'][{i}]: sampling {s['fps']} frames a second needs "
                    "the video's fps in its metadata, e.g. (frames, {'fps': 30.0})"
                )
            fps = _DEFAULT_FPS if rate is None else video_fps(i, rate)
            keep = sample_indices(video.shape[0], s["num_frames"], s["fps"], fps)
            if keep is None:
                raise ValueError(
                    f"multi_modal_data['video'][{i}]: {video.shape[0]} frame(s), fewer than the "
                    f"num_frames={s['num_frames']} the video processor samples"
                )
            video = video[torch.tensor(keep)]
        x = video.float()
        if s["do_resize"]:
            height, width = x.shape[-2:]
            if max(height, width) > MAX_ASPECT * min(height, width):
                raise ValueError(
                    f"multi_modal_data['video'][{i}]: frames of {height} x {width}: the aspect "
                    f"ratio must be at most {MAX_ASPECT}"
                )
            x = _resize(x, s["size"], _MODES[s["resample"]])
        x = _center_crop(x, self.side)
        mean = torch.tensor(s["image_mean"]).view(1, 3, 1, 1)
        std = torch.tensor(s["image_std"]).view(1, 3, 1, 1)
        if s["do_rescale"] and s["do_normalize"]:  # fused as transformers does
            return (x - mean / s["rescale_factor"]) / (std / s["rescale_factor"])
        if s["do_rescale"]:
            x = x * s["rescale_factor"]
        return (x - mean) / std if s["do_normalize"] else x


def _resize(x: torch.Tensor, size: dict, mode: str) -> torch.Tensor:
    """[T, 3, H, W] uint8 values resized as torchvision resizes uint8 frames (antialiased,
    back to whole values in [0, 255]): to size's height x width, or its shortest edge with the
    aspect kept (transformers' get_resize_output_image_size, default_to_square=False)."""
    h, w = x.shape[-2:]
    if size.get("shortest_edge"):
        edge = int(size["shortest_edge"])
        short, long = (w, h) if w <= h else (h, w)
        new_long = int(edge * long / short)
        out = (new_long, edge) if w <= h else (edge, new_long)
    else:
        out = (int(size["height"]), int(size["width"]))
    if out == (h, w):
        return x
    x = F.interpolate(x, size=out, mode=mode, align_corners=False, antialias=True)
    return x.round_().clamp_(0, 255)


def _center_crop(x: torch.Tensor, side: int) -> torch.Tensor:
    """[T, 3, H, W] -> [T, 3, side, side]: zero padding (left / top half rounded down) where a
    side is shorter, then the centred window (its offset rounded down), as transformers."""
    h, w = x.shape[-2:]
    if side > h or side > w:
        dw, dh = max(side - w, 0), max(side - h, 0)
        x = F.pad(x, (dw // 2, (dw + 1) // 2, dh // 2, (dh + 1) // 2))
        h, w = x.shape[-2:]
    top, left = int((h - side) / 2.0), int((w - side) / 2.0)
    return x[..., top : top + side, left : left + side].contiguous()
