"""Videos for GLM-4.1V / GLM-4.5V / GLM-4.6V: frames -> frame pairs that enter as images.

    frames [T, H, W, 3] uint8 (with vLLM's metadata: fps, frames_indices, total_num_frames)
      -> sampled by the video's fps unless a loader sampled them already (metadata with
         frames_indices) or do_sample_frames=False; GLM-4.1V / 4.5V keep 2 frames a second
         (`fps`) over at most max_duration seconds, GLM-4.6V 6, 2 or 1 a second by the video's
         length (at most 640 frames); both drop repeated indices and repeat the last frame to
         an even count
      -> resized together (Qwen3-VL's rule: the whole video's pixels within the size bounds),
         normalized, cut into temporal x spatial patches: T/2 pairs of h x w patches
    prompt: each <|video|> (the template's <|begin_of_video|> / <|end_of_video|> around it
         stay) becomes per pair: <|begin_of_image|> <|image|> x (h*w/merge^2) <|end_of_image|>
         then the pair's first frame's time: "3" (GLM-4.1V / 4.5V: whole seconds, truncated)
         or "3.5 seconds" (GLM-4.6V)

How this differs from Qwen3-VL's videos (qwen3_video.Qwen3VideoProcessor, whose `process`
template, kwargs check, timestamp tokenizer cache and M-RoPE table it reuses), as transformers
runs GLM's: a pair's run is of the *image* token (HF's placeholder mask for videos is the
image one), its time comes after it, not before, and is the pair's first frame's (frame index
/ fps, fps 24 when the metadata has none), not the mean of both; the sampling rules are GLM's.
Each pair is an `ImageInput` of grid (1, h, w): the tower (multimodal/glm4v_vision.py) and the
M-RoPE table read it exactly as an image, as Glm4vModel's get_video_features and get_rope_index
split a video's grid into frames. Videos processed ahead are such pairs: a server hands them over
with the prompt's images (their runs are image runs).

Which rules apply: the checkpoint's video_processor_type (Glm46VVideoProcessor or
Glm4vVideoProcessor), else the architecture (Glm46VForConditionalGeneration: GLM-4.6V's).
Refused by name: a video of one frame left unsampled (multi_modal_data['video'][i], as HF's
smart_resize refuses it), sampling asked of a video without metadata fps
(mm_processor_kwargs['do_sample_frames'] / the metadata's), metadata frames_indices or
duration that do not fit, and mm_processor_kwargs['fps'] on GLM-4.6V (its rate follows the
video's length).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.qwen3_video import Qwen3VideoProcessor, smart_resize, tower_settings
from paged_engine.multimodal.qwen3_video import check_kwargs as qwen3_check_kwargs
from paged_engine.multimodal.qwen_video import (
    _DEFAULT_FPS,
    indexed_frames,
    patch_rows,
    raw_settings,
    video_fps,
)

ARCHS = (
    "Glm4vForConditionalGeneration",
    "Glm4vMoeForConditionalGeneration",
    "Glm46VForConditionalGeneration",
)
GLM46V = "Glm46VForConditionalGeneration"
# transformers' Glm4vVideoProcessor / Glm46VVideoProcessor defaults (the same values)
_DEFAULTS = {
    "size": {"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 2 * 30000},
    "fps": 2.0,
    "max_duration": 300,
    "do_sample_frames": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
# GLM-4.6V's sampling: its frame cap and horizon (seconds)
_MAX_FRAMES_46V = 640
_MAX_SECONDS_46V = 2400


def sample_indices(
    total: int, fps: float, target: float, max_duration: float, duration: float | None = None
) -> list[int]:
    """GLM-4.1V / 4.5V: which of `total` frames at `fps` to keep for `target` frames a second
    (evenly over max_duration seconds for a longer video), repeats dropped, an even count."""
    last = total - 1
    duration = duration or round(last / fps) + 1
    if duration <= max_duration:
        n = max(math.floor(duration * target), 1)
        picked = [min(last, math.ceil(i * fps / target)) for i in range(n)]
    else:
        n = int(max_duration * target)
        if n >= total:
            picked = list(range(total))
        else:
            seconds = np.linspace(0, duration, n, endpoint=True)
            picked = [min(last, math.ceil(t * fps)) for t in seconds]
    return _even(picked)


def sample_indices_46v(
    total: int, fps: float, temporal: int, duration: float | None = None
) -> list[int]:
    """GLM-4.6V: which of `total` frames at `fps` to keep: `temporal` x (3, 1 or 0.5 by the
    video's length) frames a second, at most 640, repeats dropped, an even count."""
    last = total - 1
    duration = duration or round(last / fps) + 1
    seconds = min(duration, _MAX_SECONDS_46V)
    rate = 3.0 if seconds <= 30 else 1.0 if seconds <= 300 else 0.5  # frame pairs a second
    want = min(int(seconds * rate * temporal), _MAX_FRAMES_46V)
    if total < want:
        picked = np.linspace(0, last, want, dtype=int).tolist()
    else:
        # a frame each 1 / (temporal * rate) seconds (time = index * (1 / fps)) up to the
        # video's whole seconds
        picked, due, step, per_frame = [], 0.0, 1 / (temporal * rate), 1 / fps
        for i in range(total):
            if i * per_frame >= due:
                due += step
                picked.append(i)
                if due >= int(duration):
                    break
    if len(picked) < want:
        lo, hi = (picked[0], picked[-1]) if picked else (0, max(last, 0))
        picked = np.linspace(lo, hi, want, dtype=int).tolist()
    elif len(picked) > want:
        picked = np.linspace(0, last, want, dtype=int).tolist()
    return _even(picked)


def _even(indices: list[int]) -> list[int]:
    """`indices` without repeats (first kept), the last repeated to an even count."""
    out = list(dict.fromkeys(int(i) for i in indices))
    return out + out[-1:] if len(out) % 2 else out


def check_kwargs(kwargs: dict[str, Any], v46: bool) -> dict[str, Any]:
    qwen3_check_kwargs(kwargs)
    if v46 and "fps" in kwargs:
        raise ValueError(
            "mm_processor_kwargs['fps'] is not taken by GLM-4.6V: it samples its videos at a "
            "rate set by their length (give do_sample_frames=False and your own frames)"
        )
    return kwargs


class Glm4vVideoProcessor(Qwen3VideoProcessor):
    """Turns a prompt's videos into GLM's timestamped frame pairs (`ImageInput`s): Qwen3-VL's
    template with lone <|video|> placeholders, each pair a run of <|image|>, its time after
    it."""

    placeholder = "<|video|>"
    wrapped = False  # (<|begin_of_video|> / <|end_of_video|> stay)
    stamp_first = False
    uncovered = (
        "image-token runs (GLM's frame pairs are image runs: hand a prompt's processed "
        "images and videos over together as images)"
    )

    def _configure(self, path: Path, config: Any) -> None:
        # <|video|> is the prompt's placeholder; each frame pair is a run of <|image|>
        self.video_token_id = int(config.video_token_id)
        self.image_token_id = self.run_token_id = int(config.image_token_id)
        self.start_id = int(config.image_start_token_id)
        self.end_id = int(config.image_end_token_id)
        raw, own = raw_settings(path)
        kind = raw.get("video_processor_type") if own else None
        if kind in ("Glm46VVideoProcessor", "Glm4vVideoProcessor"):
            self.v46 = kind == "Glm46VVideoProcessor"
        else:
            self.v46 = GLM46V in (config.architectures or ())
        self.settings = tower_settings(path, config, _DEFAULTS, raw, own)
        self.settings["fps"] = float(self.settings["fps"])

    def check_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return check_kwargs(kwargs, self.v46)

    def _fits(self, m: ImageInput) -> bool:
        """Qwen3-VL's pairs, their grids whole merge blocks."""
        merge, grid = self.settings["merge_size"], m.image_size
        return super()._fits(m) and not (grid[1] % merge or grid[2] % merge)  # type: ignore[index]

    def _load(
        self, i: int, item: Any, kwargs: dict[str, Any]
    ) -> list[tuple[torch.Tensor, tuple[int, int, int], str]]:
        """Video i's pairs: (patch rows [h*w, C*tp*p*p], grid (1, h, w), timestamp text)."""
        video, meta, indices = indexed_frames(i, item)
        rate = meta.get("fps")
        fps = _DEFAULT_FPS if rate is None else video_fps(i, rate)
        s = self.settings
        sample = kwargs.get("do_sample_frames", meta.get("do_sample_frames"))
        if sample is None:  # frames a loader sampled, or without a rate, are kept as they are
            sample = s["do_sample_frames"] and rate is not None and "frames_indices" not in meta
        elif sample and rate is None:
            raise ValueError(
                f"multi_modal_data['video'][{i}]: sampling its frames (do_sample_frames) needs "
                "the video's fps in its metadata, e.g. (frames, {'fps': 30.0})"
            )
        tp = s["temporal_patch_size"]
        if sample:
            duration = meta.get("duration")
            if duration is not None and (
                isinstance(duration, bool)
                or not isinstance(duration, int | float)
                or not duration > 0
            ):
                raise ValueError(
                    f"multi_modal_data['video'][{i}]: duration must be a number of seconds > 0"
                )
            total = video.shape[0]
            if self.v46:
                keep = sample_indices_46v(total, fps, tp, duration)
            else:
                target = float(kwargs.get("fps", s["fps"]))
                keep = sample_indices(total, fps, target, s["max_duration"], duration)
            video, indices = video[torch.tensor(keep)], [indices[k] for k in keep]
        if video.shape[0] < tp:
            raise ValueError(
                f"multi_modal_data['video'][{i}]: {video.shape[0]} frame(s); GLM-4.xV's videos "
                f"need at least {tp} (or let it sample them: give the metadata's fps)"
            )
        size, count = s["size"], video.shape[0]
        factor = s["patch_size"] * s["merge_size"]
        height, width = video.shape[-2:]
        lo, hi = size["shortest_edge"], size["longest_edge"]
        h, w = smart_resize(count, height, width, factor, tp, lo, hi)
        rows, (t, gh, gw) = patch_rows(video, h, w, s)
        per = gh * gw
        # each pair's first frame's time, as HF takes every second frame's (for any tp)
        times = [k / fps for k in indices[::2]][:t]
        times += [times[-1]] * (t - len(times))
        return [
            (rows[k * per : (k + 1) * per].contiguous(), (1, gh, gw), self._stamp(times[k]))
            for k in range(t)
        ]

    def _stamp(self, seconds: float) -> str:
        return f"{seconds:.1f} seconds" if self.v46 else str(int(seconds))
