"""Videos for Qwen3-VL and Qwen3.5 (and their MoE): frames -> timestamped frame groups.

    frames [T, H, W, 3] uint8 (with vLLM's metadata: fps, frames_indices)
      -> sampled at `fps` frames a second (2 by default; min_frames..max_frames of them) unless
         already sampled (metadata with frames_indices, or do_sample_frames=False)
      -> resized together: multiples of patch * merge pixels with the whole video's pixels
         within the size bounds (transformers' Qwen3-VL rule), normalized, padded with the last
         frame to pairs, cut into temporal x spatial patches: T/2 groups of h x w patches
    prompt: each <|vision_start|><|video_pad|><|vision_end|> (or a lone <|video_pad|>) becomes
         per group: "<{t:.1f} seconds>" <|vision_start|> <|video_pad|> x (h*w/merge^2)
         <|vision_end|>, t the mean time of the group's two frames (frame index / fps)

Each group is an `ImageInput` of grid (1, h, w): the vision tower attends within each frame and
M-RoPE places each group as an image (the timestamp text between them), as transformers'
Qwen3-VL splits a video's grid into frames. Settings come from the checkpoint's
video_preprocessor_config.json, else transformers' Qwen3-VL video defaults with the image
processor's patches and normalization. Qwen3VideoProcessor's `process` is the template GLM-4.xV's
and Gemma 4's video processors (glm4v_video.py, gemma4_video.py) fill in.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import digest
from paged_engine.multimodal.mrope import MropePositions, mrope_positions
from paged_engine.multimodal.qwen_video import (
    _DEFAULT_FPS,
    VideoProcessor,
    indexed_frames,
    known_kwargs,
    patch_rows,
    raw_settings,
    video_fps,
    video_list,
)

# transformers' Qwen3VLVideoProcessor defaults
_DEFAULTS = {
    "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
    "fps": 2.0,
    "min_frames": 4,
    "max_frames": 768,
    "do_sample_frames": True,
    "cap_pixels_per_frame": False,
    "max_video_tokens": 768,
}
KWARGS = ("fps", "do_sample_frames")  # the mm_processor_kwargs Qwen3-VL's videos take
ARCHS = (
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",  # Qwen3-VL's processor and video scheme
    "Qwen3_5MoeForConditionalGeneration",
)


def smart_resize(
    frames: int, height: int, width: int, factor: int, temporal: int, lo: int, hi: int
):
    """transformers' Qwen3-VL rule: multiples of `factor`, the video's pixels (frames rounded
    to pairs) within [lo, hi]; frames smaller than `factor` scaled up first."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"multi_modal_data['video']: frames of {height} x {width}: the aspect ratio must be "
            "under 200"
        )
    h, w = round(height / factor) * factor, round(width / factor) * factor
    t = round(frames / temporal) * temporal
    if t * h * w > hi:
        beta = math.sqrt(frames * height * width / hi)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < lo:
        beta = math.sqrt(lo / (frames * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def sample_indices(total: int, fps: float, target: float, lo: int, hi: int) -> list[int]:
    """Which of `total` frames at `fps` to keep for `target` frames a second: at least `lo`,
    at most `hi` (and `total`), evenly spread, as transformers' Qwen3-VL samples them."""
    n = min(max(int(total / fps * target), lo), hi, total)
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


def timestamps(indices: list[int], fps: float, temporal: int) -> list[float]:
    """Each frame group's time in seconds: the mean of its first and last frame's (frame
    index / fps), the last group padded with its last frame."""
    idx = list(indices) + [indices[-1]] * (-len(indices) % temporal)
    t = [i / fps for i in idx]
    return [(t[i] + t[i + temporal - 1]) / 2 for i in range(0, len(t), temporal)]


def tower_settings(
    path: Path, config: Any, defaults: dict[str, Any], raw: dict[str, Any], own: bool
) -> dict[str, Any]:
    """The video processor's settings: `defaults` overridden by its saved ones (`raw` where
    `own`), size bounds both set or the defaults', the patches (checked against the vision
    tower's), merge and normalization as saved, else the tower's and the defaults'."""
    vision = config.vision_config
    s = {k: (raw.get(k, v) if own else v) for k, v in defaults.items()}
    size = dict(s["size"] or {})
    if not size.get("shortest_edge") or not size.get("longest_edge"):
        size = dict(defaults["size"])
    settings = {
        **s,
        "size": size,
        "patch_size": int(raw.get("patch_size", vision.patch_size)),
        "merge_size": int(raw.get("merge_size", vision.spatial_merge_size)),
        "temporal_patch_size": int(raw.get("temporal_patch_size", vision.temporal_patch_size)),
        "image_mean": list(raw.get("image_mean", s.get("image_mean", [0.5, 0.5, 0.5]))),
        "image_std": list(raw.get("image_std", s.get("image_std", [0.5, 0.5, 0.5]))),
        "rescale_factor": float(raw.get("rescale_factor", 1 / 255)),
    }
    tower = (int(vision.patch_size), int(vision.temporal_patch_size))
    if (settings["patch_size"], settings["temporal_patch_size"]) != tower:
        raise ValueError(f"{path}: the video processor's patches are not the vision tower's")
    return settings


class Qwen3VideoProcessor(VideoProcessor):
    """Turns a prompt's videos into timestamped frame groups (`ImageInput`s) in its tokens.

    The template of the timestamped video families (GLM-4.xV's and Gemma 4's subclass it):
    `process` finds one placeholder a video (`_spans`), replaces it by each of the video's
    runs from `_load` (rows, grid, timestamp text) as [text] start run x n end [text], and
    takes runs processed ahead where `_fits` each and they cover every `run_token_id`."""

    kwargs_names = KWARGS
    placeholder = "<|video_pad|>"  # (for messages)
    wrapped = True  # a placeholder may be start / pad / end: the wrapper is replaced too
    stamp_first = True  # the timestamp text before its run, else after it
    two_way = False  # runs attend both ways (ImageInput.bidirectional)
    uncovered = "video tokens"  # what runs processed ahead must cover (for messages)

    def check_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """`kwargs` (mm_processor_kwargs for videos); ValueError naming a bad one."""
        return check_kwargs(kwargs)

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # (VideoProcessor's arguments)
        # timestamp text -> ids; a server's request threads share the engine's tokenizer
        self._ids: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def _configure(self, path: Path, config: Any) -> None:
        """The family's token ids and settings; ValueError where the checkpoint's settings
        give no videos this processor runs."""
        self.video_token_id = self.run_token_id = int(config.video_token_id)
        self.start_id = int(config.vision_start_token_id)
        self.end_id = int(config.vision_end_token_id)
        raw, own = raw_settings(path)
        self.settings = tower_settings(path, config, _DEFAULTS, raw, own)

    def process(
        self, token_ids: list[int], videos: Any, kwargs: dict[str, Any] | None = None
    ) -> tuple[list[int], list[ImageInput], list[tuple[int, int]]]:
        """(token ids with each video's timestamped runs, the runs in prompt order,
        (where in `token_ids`, tokens added) of each video); ValueError naming
        multi_modal_data['video'] (or mm_processor_kwargs) for anything wrong."""
        kwargs = self.check_kwargs(kwargs or {})
        items = video_list(videos, self.limit)
        if all(isinstance(m, ImageInput) for m in items):  # processed ahead (a server's)
            return self._placed(token_ids, items)
        spans = self._spans(token_ids)
        if len(spans) != len(items):
            raise ValueError(
                f"multi_modal_data['video'] has {len(items)} video(s) but the prompt has "
                f"{len(spans)} {self.placeholder} placeholder(s): put one per video"
            )
        out_ids: list[int] = []
        runs: list[ImageInput] = []
        added: list[tuple[int, int]] = []
        last = 0
        for i, (item, (start, stop)) in enumerate(zip(items, spans, strict=True)):
            out_ids += token_ids[last:start]
            before = len(out_ids)
            for rows, grid, text in self._load(i, item, kwargs):
                if self.stamp_first:
                    out_ids += self._encode(text)
                out_ids.append(self.start_id)
                n = self._run_length(rows, grid)
                runs.append(
                    ImageInput(
                        rows, len(out_ids), n, digest(rows, grid), grid, bidirectional=self.two_way
                    )
                )
                out_ids += [self.run_token_id] * n
                out_ids.append(self.end_id)
                if not self.stamp_first:
                    out_ids += self._encode(text)
            added.append((start, len(out_ids) - before - (stop - start)))
            last = stop
        return out_ids + token_ids[last:], runs, added

    def positions(self, num_tokens: int, items: tuple[ImageInput, ...]) -> MropePositions:
        return mrope_positions(num_tokens, items, self.settings["merge_size"])

    def _encode(self, text: str) -> list[int]:
        """A timestamp's ids, tokenized once (one thread at a time in the tokenizer)."""
        with self._lock:
            if text not in self._ids:
                if len(self._ids) >= 4096:  # (a bound: an hour of groups is ~3600 texts)
                    self._ids.clear()
                self._ids[text] = self.tokenizer.encode(text, add_special_tokens=False)
            return self._ids[text]

    def _spans(self, ids: list[int]) -> list[tuple[int, int]]:
        """[start, stop) of each video placeholder: the template's start / pad / end wrapper
        (where `wrapped`), or a lone pad token."""
        spans = []
        for i, t in enumerate(ids):
            if t != self.video_token_id:
                continue
            wrapped = (
                self.wrapped
                and 0 < i < len(ids) - 1
                and ids[i - 1] == self.start_id
                and ids[i + 1] == self.end_id
            )
            spans.append((i - 1, i + 2) if wrapped else (i, i + 1))
        return spans

    def _run_length(self, rows: torch.Tensor, grid: tuple[int, ...]) -> int:
        """Tokens in the run of a group of patch rows: one per merge x merge patches."""
        return rows.shape[0] // self.settings["merge_size"] ** 2

    def _fits(self, m: ImageInput) -> bool:
        """Whether a group processed ahead is patch rows of one frame pair this tower reads
        (its run checked by `_placed`)."""
        s, merge = self.settings, self.settings["merge_size"]
        width = 3 * s["temporal_patch_size"] * s["patch_size"] ** 2
        grid, rows = m.image_size, m.pixel_values
        return (
            rows is not None
            and grid is not None
            and len(grid) == 3
            and grid[0] == 1
            and tuple(rows.shape) == (grid[1] * grid[2], width)
            and m.length == rows.shape[0] // merge**2
        )

    def _placed(
        self, token_ids: list[int], items: list[ImageInput]
    ) -> tuple[list[int], list[ImageInput], list[tuple[int, int]]]:
        """Runs processed ahead: each one `_fits`, at a run of `run_token_id`, together
        covering every such token of the prompt."""
        covered = 0
        for m in items:
            if not (
                self._fits(m) and token_ids[m.offset : m.end] == [self.run_token_id] * m.length
            ):
                raise ValueError(
                    "multi_modal_data['video']: these processed videos do not fit this prompt "
                    "and model (their grids, rows or runs differ)"
                )
            covered += m.length
        if covered != token_ids.count(self.run_token_id):
            raise ValueError(
                "multi_modal_data['video']: these processed videos do not cover the prompt's "
                f"{self.uncovered}"
            )
        return token_ids, list(items), []

    def _load(self, i: int, item: Any, kwargs: dict[str, Any]):
        """Video i's groups: (patch rows [h*w, C*tp*p*p], grid (1, h, w), timestamp text)."""
        video, meta, indices = indexed_frames(i, item)
        fps = video_fps(i, meta.get("fps") or _DEFAULT_FPS)
        s = self.settings
        sample = kwargs.get("do_sample_frames", meta.get("do_sample_frames"))
        if sample is None:  # frames a loader sampled already keep their indices
            sample = s["do_sample_frames"] and "frames_indices" not in meta
        if sample:
            target = float(kwargs.get("fps", s["fps"]))
            keep = sample_indices(video.shape[0], fps, target, s["min_frames"], s["max_frames"])
            video, indices = video[torch.tensor(keep)], [indices[k] for k in keep]
        tp = s["temporal_patch_size"]
        if video.shape[0] < tp:
            raise ValueError(
                f"multi_modal_data['video'][{i}]: {video.shape[0]} frame(s); Qwen3-VL's videos "
                f"need at least {tp}"
            )
        size, frames_n = s["size"], video.shape[0]
        hi = size["longest_edge"]
        factor = s["patch_size"] * s["merge_size"]
        if s["cap_pixels_per_frame"]:  # qwen-vl-utils' per-frame cap (transformers' option)
            cap = s["max_video_tokens"] * factor * factor
            hi = max(min(cap, hi // frames_n), int(size["shortest_edge"] * 1.05)) * frames_n
        height, width = video.shape[-2:]
        h, w = smart_resize(frames_n, height, width, factor, tp, size["shortest_edge"], hi)
        rows, (t, gh, gw) = patch_rows(video, h, w, s)
        per = gh * gw
        times = timestamps(indices, fps, tp)
        return [
            (rows[k * per : (k + 1) * per].contiguous(), (1, gh, gw), f"<{times[k]:.1f} seconds>")
            for k in range(t)
        ]


def check_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    known_kwargs(kwargs, KWARGS)
    fps = kwargs.get("fps")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or fps <= 0):
        raise ValueError(f"mm_processor_kwargs['fps'] must be a number > 0, got {fps!r}")
    sample = kwargs.get("do_sample_frames")
    if sample is not None and not isinstance(sample, bool):
        raise ValueError(f"mm_processor_kwargs['do_sample_frames'] must be a bool, got {sample!r}")
    return kwargs
