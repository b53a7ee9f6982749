"""Videos for Qwen2-VL / Qwen2.5-VL: frames -> patch rows, a run of video tokens, M-RoPE steps.

    frames [T, H, W, 3] uint8 (vLLM's form; or a list of frames, or (frames, metadata))
      -> each frame resized to multiples of patch * merge pixels (bicubic, antialiased, as HF's
         video processor does through torchvision; H * W within the video size bounds), rescaled
         and normalized; T padded with copies of the last frame to a multiple of the temporal
         patch -> rows [t*h*w, 3 * tp * p * p], grid (t, h, w) in patches
    prompt: <|vision_start|> <|video_pad|> x (t*h*w / merge^2) <|vision_end|>

Videos processed ahead (`ImageInput`s from `process`, e.g. on a server's request thread) are
checked against the prompt and taken as they are. A video is an `ImageInput`
(multimodal/inputs.py) like an image: the vision tower reads its grid
(attention within each frame; multimodal/qwen2_vl_vision.py), the encoder cache and prefix cache
key it by its pixels' hash. Its M-RoPE temporal index of frame group k is k (Qwen2-VL) or
floor(k * tokens_per_second * second_per_grid_t) (Qwen2.5-VL, `t_step`), second_per_grid_t =
temporal_patch_size / fps; fps comes from the video's metadata ({"fps": ...}, with
"frames_indices" and "total_num_frames" the sampled rate), else 24, as transformers defaults it.

The video processor's settings come from the checkpoint's video_preprocessor_config.json, else
from its image processor's patch sizes and normalization with HF's Qwen2-VL video size bounds
(128 to 768 merged patches of 28 pixels a frame). transformers' own video processor needs
torchvision; this one needs only torch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import digest, expand_runs
from paged_engine.multimodal.mrope import MropePositions, mrope_positions
from paged_engine.multimodal.processor_files import check_processor_files

_DEFAULT_SIZE = {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}
_DEFAULT_FPS = 24.0  # transformers' VideoMetadata.sampled_fps without metadata
VIDEO_KWARGS = ("fps", "min_pixels", "max_pixels")  # the mm_processor_kwargs videos take


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int):
    """Qwen2-VL's rule: the nearest multiples of `factor`, the area within the bounds."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"multi_modal_data['video']: frames of {height} x {width}: the aspect ratio must be "
            "under 200"
        )
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def raw_settings(path: Path) -> tuple[dict[str, Any], bool]:
    """(the checkpoint's video processor settings, True), from video_preprocessor_config.json
    or transformers 5's processor_config.json, else (its image processor's, False)."""
    candidates: list[tuple[dict, bool]] = []  # (settings, the video processor's own)
    for name, own in (
        ("video_preprocessor_config.json", True),
        ("preprocessor_config.json", False),
    ):
        if (path / name).exists():
            candidates.append((json.loads((path / name).read_text()), own))
    if (path / "processor_config.json").exists():
        both = json.loads((path / "processor_config.json").read_text())
        for key, own in (("video_processor", True), ("image_processor", False)):
            if isinstance(both.get(key), dict):
                candidates.append((both[key], own))
    if not candidates:
        raise ValueError(f"{path} has no video or image processor config for its videos")
    return max(candidates, key=lambda c: c[1])  # the video processor's own first


def tower_checked_settings(
    path: Path, defaults: dict[str, Any], tower: dict[str, int]
) -> dict[str, Any]:
    """`defaults` overridden by the video processor's own saved settings (not the image
    processor's: `raw_settings`), and each `tower` setting (name -> the vision tower's value)
    as saved, else the tower's; ValueError naming one saved other than the tower's."""
    raw, own = raw_settings(path)
    s = {k: (raw.get(k, v) if own else v) for k, v in defaults.items()}
    for name, value in tower.items():
        s[name] = int(raw.get(name, value)) if own else value
        if s[name] != value:
            raise ValueError(
                f"{path}: the video processor's {name}={s[name]} is not the tower's {value}"
            )
    return s


def _settings(path: Path) -> dict[str, Any]:
    """The video processor's settings: its own, else the image processor's with HF's video
    size bounds."""
    raw, own = raw_settings(path)
    size = dict(raw.get("size") or {}) if own else {}
    if not size.get("shortest_edge") or not size.get("longest_edge"):
        size = dict(_DEFAULT_SIZE)
    if own and raw.get("min_pixels"):
        size["shortest_edge"] = raw["min_pixels"]
    if own and raw.get("max_pixels"):
        size["longest_edge"] = raw["max_pixels"]
    return {
        "patch_size": int(raw.get("patch_size", 14)),
        "merge_size": int(raw.get("merge_size", 2)),
        "temporal_patch_size": int(raw.get("temporal_patch_size", 2)),
        "image_mean": list(raw.get("image_mean", [0.48145466, 0.4578275, 0.40821073])),
        "image_std": list(raw.get("image_std", [0.26862954, 0.26130258, 0.27577711])),
        "rescale_factor": float(raw.get("rescale_factor", 1 / 255)),
        "size": size,
    }


class VideoProcessor:
    """A video processor, built as video_archs.VIDEO_PROCESSORS builds each: the checkpoint's
    directory, its wrapper config, the engine's tokenizer, videos per prompt
    (limit_mm_per_prompt["video"]; None: any) and the EngineConfig. `_configure` reads the
    family's token ids and settings; ValueError where they give no videos it runs."""

    def __init__(
        self,
        path: Path,
        config: Any,
        tokenizer: Any = None,
        limit: int | None = None,
        engine_config: Any = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.limit = limit
        self.engine_config = engine_config
        check_processor_files(Path(path))  # broken processor files refused at engine start
        self._configure(Path(path), config)

    def _configure(self, path: Path, config: Any) -> None:
        raise NotImplementedError

    def _fit_runs(
        self, token_ids: list[int], items: list[ImageInput]
    ) -> tuple[list[int], list[ImageInput], list[tuple[int, int]]]:
        """Videos processed ahead (already checked as this tower's): the prompt with each one's
        run where it (expanded, or with one placeholder each) holds it; ValueError where a run
        starts elsewhere than its item's offset."""
        token_ids, starts, added = expand_runs(
            token_ids, self.video_token_id, [m.length for m in items], "video"
        )
        if starts != [m.offset for m in items]:
            raise ValueError(
                "multi_modal_data['video']: these processed videos do not fit this prompt "
                "(their runs start elsewhere)"
            )
        return token_ids, list(items), added


class QwenVideoProcessor(VideoProcessor):
    """Turns a prompt's videos into `ImageInput`s placed at its video tokens."""

    kwargs_names = VIDEO_KWARGS

    def check_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """`kwargs` (mm_processor_kwargs for videos); ValueError naming a bad one."""
        return check_kwargs(kwargs)

    def _configure(self, path: Path, config: Any) -> None:
        self.video_token_id = int(config.video_token_id)
        self.settings = _settings(path)
        vision = config.vision_config
        # Qwen2.5-VL spaces frame groups' temporal positions by time; Qwen2-VL by 1
        self.tokens_per_second = getattr(vision, "tokens_per_second", None)
        if (
            int(vision.patch_size) != self.settings["patch_size"]
            or int(vision.temporal_patch_size) != self.settings["temporal_patch_size"]
        ):
            raise ValueError(
                f"{path}: the video processor's patches ({self.settings['patch_size']}, "
                f"temporal {self.settings['temporal_patch_size']}) are not the vision tower's"
            )

    def process(
        self, token_ids: list[int], videos: Any, kwargs: dict[str, Any] | None = None
    ) -> tuple[list[int], list[ImageInput], list[tuple[int, int]]]:
        """(token ids with each video's run, the videos in prompt order, (where in
        `token_ids`, tokens added) of each run); ValueError naming multi_modal_data['video']
        (or mm_processor_kwargs) for anything wrong."""
        kwargs = self.check_kwargs(kwargs or {})
        items = video_list(videos, self.limit)
        if all(isinstance(m, ImageInput) for m in items):  # processed ahead (a server's)
            return self._placed(token_ids, items)
        loaded = [self._load(i, item, kwargs) for i, item in enumerate(items)]
        merge = self.settings["merge_size"]
        lengths = [t * h * w // merge**2 for _, (t, h, w), _ in loaded]
        token_ids, starts, added = expand_runs(token_ids, self.video_token_id, lengths, "video")
        out = []
        for (rows, grid, step), start, n in zip(loaded, starts, lengths, strict=True):
            out.append(ImageInput(rows, start, n, digest(rows, grid), grid, t_step=step))
        return token_ids, out, added

    def _placed(
        self, token_ids: list[int], items: list[ImageInput]
    ) -> tuple[list[int], list[ImageInput], list[tuple[int, int]]]:
        """Videos processed ahead (this method's output): each must be patch rows this tower
        reads, its run where the prompt (expanded, or with one placeholder each) holds it."""
        s, merge = self.settings, self.settings["merge_size"]
        width = 3 * s["temporal_patch_size"] * s["patch_size"] ** 2
        for m in items:
            grid, rows = m.image_size, m.pixel_values
            if (
                rows is None
                or m.embeds is not None
                or m.token_rows
                or grid is None
                or len(grid) != 3
                or grid[1] % merge
                or grid[2] % merge
                or tuple(rows.shape) != (grid[0] * grid[1] * grid[2], width)
                or m.length != rows.shape[0] // merge**2
                or not 0 < m.t_step < math.inf
            ):
                raise ValueError(
                    "multi_modal_data['video']: these processed videos are not patch rows this "
                    "model reads (their grids, rows or runs differ)"
                )
        return self._fit_runs(token_ids, items)

    def positions(self, num_tokens: int, items: tuple[ImageInput, ...]) -> MropePositions:
        """The prompt's M-RoPE table (its images and videos in prompt order)."""
        return mrope_positions(num_tokens, items, self.settings["merge_size"])

    def _load(
        self, i: int, item: Any, kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, tuple[int, int, int], float]:
        """(patch rows, grid, temporal position step) of video i."""
        frames, meta = item if isinstance(item, tuple) and len(item) == 2 else (item, None)
        video = _frames(i, frames)  # [T, 3, H, W] uint8
        s = self.settings
        size = dict(s["size"])
        size["shortest_edge"] = kwargs.get("min_pixels", size["shortest_edge"])
        size["longest_edge"] = kwargs.get("max_pixels", size["longest_edge"])
        factor = s["patch_size"] * s["merge_size"]
        height, width = video.shape[-2:]
        h, w = smart_resize(height, width, factor, size["shortest_edge"], size["longest_edge"])
        rows, grid = patch_rows(video, h, w, s)
        step = 1.0
        fps = _sampled_fps(i, meta, kwargs.get("fps"))  # (checked on every model)
        if self.tokens_per_second is not None:  # Qwen2.5-VL
            # float32 as transformers computes it: the index is floor(k * step)
            step = float(
                np.float32(self.tokens_per_second) * np.float32(s["temporal_patch_size"] / fps)
            )
        return rows, grid, step


def video_list(videos: Any, limit: int | None) -> list:
    """multi_modal_data['video'] as a list of videos; ValueError when empty or over `limit`."""
    items = list(videos) if _several(videos) else [videos]
    if not items:
        raise ValueError("multi_modal_data['video'] is empty: give a video or leave it out")
    if limit is not None and len(items) > limit:
        raise ValueError(
            f"multi_modal_data['video'] has {len(items)} videos, over "
            f"limit_mm_per_prompt={{'video': {limit}}}"
        )
    return items


def patch_rows(
    video: torch.Tensor, h: int, w: int, s: dict[str, Any]
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """uint8 frames [T, 3, H, W] resized to h x w (bicubic, antialiased, back to uint8 values
    as torchvision resizes uint8 frames), rescaled, normalized and cut into patch rows (the
    settings `s`): (rows, grid (t, h, w) in patches)."""
    x = video.float()
    if (h, w) != tuple(video.shape[-2:]):
        x = F.interpolate(x, size=(h, w), mode="bicubic", align_corners=False, antialias=True)
        x = x.round_().clamp_(0, 255)
    mean = torch.tensor(s["image_mean"]).view(1, 3, 1, 1)
    std = torch.tensor(s["image_std"]).view(1, 3, 1, 1)
    x = (x * s["rescale_factor"] - mean) / std
    return _patchify(x, s["patch_size"], s["merge_size"], s["temporal_patch_size"])


def known_kwargs(kwargs: dict[str, Any], names: tuple[str, ...]) -> None:
    """ValueError naming the first of `kwargs` that is not one of `names`."""
    bad = sorted(k for k in kwargs if k not in names)
    if bad:
        raise ValueError(
            f"mm_processor_kwargs[{bad[0]!r}] is not an argument this model's videos take; "
            f"they take {list(names)}"
        )


def check_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    known_kwargs(kwargs, VIDEO_KWARGS)
    for k, v in kwargs.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"mm_processor_kwargs[{k!r}] must be a number > 0, got {v!r}")
    return kwargs


def _several(videos: Any) -> bool:
    """Whether multi_modal_data['video'] is a list of videos (else one video: an array, a
    (frames, metadata) pair, or a list of frames, PIL images or [H, W, 3] arrays)."""
    if not isinstance(videos, list):
        return False
    frame = videos[0] if videos else None
    is_frame = hasattr(frame, "convert") or getattr(frame, "ndim", 0) == 3
    return not is_frame


def _sampled_fps(i: int, meta: Any, fps: float | None) -> float:
    """The frames' rate: mm_processor_kwargs' fps, the metadata's (sampled) fps, else 24."""
    if fps is not None:
        return float(fps)
    meta = video_meta(i, meta)
    rate = meta.get("fps")
    if rate is None:
        return _DEFAULT_FPS
    indices, total = meta.get("frames_indices"), meta.get("total_num_frames")
    if indices is not None and total:
        rate = len(indices) / total * rate
    return video_fps(i, rate)


def video_meta(i: int, meta: Any) -> dict[str, Any]:
    """Video i's metadata ({} for none); ValueError for anything but a dict."""
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise ValueError(
            f"multi_modal_data['video'][{i}]: metadata must be a dict such as {{'fps': 2.0}}, "
            f"got {type(meta).__name__}"
        )
    return meta


def indexed_frames(i: int, item: Any) -> tuple[torch.Tensor, dict[str, Any], list[int]]:
    """Video i of multi_modal_data, (frames, metadata) or frames: its frames [T, 3, H, W] uint8,
    its checked metadata and each frame's index in the source video (`frames_indices`, else
    0 .. T - 1); a ValueError naming the video where they disagree."""
    frames, meta = item if isinstance(item, tuple) and len(item) == 2 else (item, None)
    meta = video_meta(i, meta)
    video = _frames(i, frames)  # [T, 3, H, W] uint8
    indices = list(meta.get("frames_indices") or range(video.shape[0]))
    if len(indices) != video.shape[0]:
        raise ValueError(
            f"multi_modal_data['video'][{i}]: frames_indices has {len(indices)} entries for "
            f"{video.shape[0]} frames"
        )
    return video, meta, indices


def video_fps(i: int, rate: Any) -> float:
    """Video i's frame rate as a float; ValueError unless a number > 0."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
        raise ValueError(f"multi_modal_data['video'][{i}]: fps must be a number > 0")
    return float(rate)


def _frames(i: int, frames: Any) -> torch.Tensor:
    """[T, 3, H, W] uint8 from [T, H, W, 3] uint8 (numpy or torch) or a list of frames (PIL
    images or [H, W, 3] arrays)."""
    if isinstance(frames, (list, tuple)):
        if not frames:
            raise ValueError(f"multi_modal_data['video'][{i}] has no frames")
        try:
            frames = np.stack(
                [np.asarray(f.convert("RGB") if hasattr(f, "convert") else f) for f in frames]
            )
        except ValueError as e:
            raise ValueError(
                f"multi_modal_data['video'][{i}]: frames differ in size: {e}"
            ) from None
    if isinstance(frames, np.ndarray):
        frames = torch.from_numpy(np.ascontiguousarray(frames))
    if (
        not isinstance(frames, torch.Tensor)
        or frames.dim() != 4
        or frames.shape[-1] != 3
        or frames.dtype != torch.uint8
        or min(frames.shape) < 1
    ):
        got = (
            f"{tuple(frames.shape)} {frames.dtype}"
            if isinstance(frames, torch.Tensor)
            else type(frames).__name__
        )
        raise ValueError(
            f"multi_modal_data['video'][{i}] must be uint8 frames [T, H, W, 3] (numpy or torch), "
            f"a list of frames, or (frames, metadata); got {got}"
        )
    return frames.permute(0, 3, 1, 2).contiguous()


def _patchify(
    x: torch.Tensor, patch: int, merge: int, temporal: int
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[T, C, H, W] -> rows [t*h*w, C * temporal * patch * patch] in the tower's order (each
    merge x merge block of patches together), grid (t, h, w)."""
    if pad := -x.shape[0] % temporal:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    frames, channels, height, width = x.shape
    t, h, w = frames // temporal, height // patch, width // patch
    x = x.view(t, temporal, channels, h // merge, merge, patch, w // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * h * w, channels * temporal * patch * patch).contiguous(), (t, h, w)
