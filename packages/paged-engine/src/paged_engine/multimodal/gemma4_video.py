"""Videos for Gemma 4 (Gemma4ForConditionalGeneration): frames -> timestamped image-like runs.

    frames [T, H, W, 3] uint8 (a list of frames, or (frames, metadata) as vLLM's loader gives)
      -> sampled to num_frames (32) evenly, frame k * T // num_frames (or, with the saved
         num_frames null, `fps` a second of the video's metadata fps), unless a loader sampled
         them already (metadata frames_indices), do_sample_frames=False, or the video has no
         more frames than that (kept as they are)
      -> each frame as Gemma 4's image processor takes an image (multimodal/gemma4.py's torch
         copy: bicubic, antialiased, aspect kept, to the largest h x w patch grid in multiples
         of k within max_soft_tokens * k^2 patches, with the *video* processor's
         max_soft_tokens, 70 by default), rescaled to [0, 1], cut into patches [h * w, 3 p p]
    prompt: each <|video|> becomes, per frame and joined by a space,
         "mm:ss " <|image> <|video|> x (h * w / k^2) <image|>
         mm:ss the frame's time (its index / the metadata's fps, 24 without one) in whole
         minutes and seconds, truncated

How transformers runs it beside an image: get_video_features is the image's tower and
embedder over each frame on its own, so a frame is an `ImageInput` of patch grid (h, w) that
Gemma4ImageEncoder reads exactly as an image; only its run is of the video token, after its
timestamp text. With use_bidirectional_attention="vision" the mask's vision groups are runs of
image or video tokens (<|image> / <image|> cut them), so each frame's run attends both ways on
the sliding layers as an image's does: the frame is `bidirectional` and one step holds it
(core/token_plan.py whole_images). Unlike the Qwen / GLM videos here there is no M-RoPE and no
temporal patch: frames are not paired. Timestamps are tokenized on their own (Qwen3-VL's
cache); HF tokenizes the joined text, so a tokenizer merging "00:00" with the text just before
<|video|> would differ there. transformers refuses sampling a video with fewer frames than
num_frames; here such a video keeps all its frames unless do_sample_frames=True asks. Frames a
loader sampled keep their own indices for their times (transformers, asked to sample them
again, times them by their places in the given array).

Settings: the checkpoint's video processor (video_preprocessor_config.json or
processor_config.json's "video_processor") over transformers' Gemma4VideoProcessor defaults;
without one, those defaults with the tower's patch size and pooling kernel. Refused by name:
saved patch_size / pooling_kernel_size that are not the tower's (videos then not taken),
max_soft_tokens outside (70, 140, 280, 560, 1120), mm_processor_kwargs['fps'] while num_frames
is set (transformers would ignore it), sampling asked of too few frames or by fps without the
metadata's fps, frames_indices that do not fit, a frame run longer than
max_num_batched_tokens, a frame grid past the tower's position table, and videos processed
ahead that do not fit the prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from paged_engine.multimodal import gemma4
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.qwen3_video import Qwen3VideoProcessor, check_kwargs
from paged_engine.multimodal.qwen_video import (
    _DEFAULT_FPS,
    indexed_frames,
    tower_checked_settings,
    video_fps,
)

ARCHS = ("Gemma4ForConditionalGeneration",)
KWARGS = ("fps", "do_sample_frames")  # mm_processor_kwargs a video takes (input_processor.py)
# transformers' Gemma4VideoProcessor class defaults (patch_size / pooling: the tower's)
_DEFAULTS: dict[str, Any] = {
    "num_frames": 32,
    "fps": None,
    "do_sample_frames": True,
    "max_soft_tokens": 70,
    "do_resize": True,
    "resample": 3,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.0, 0.0, 0.0],
    "image_std": [1.0, 1.0, 1.0],
}


def sample_indices(total: int, num_frames: int | None, fps: float | None, rate: float | None):
    """transformers' default_sample_indices_fn: `num_frames` of `total` frames evenly
    (k * total // num_frames), else `fps` a second of a video at `rate`, else all; None where
    it wants more frames than there are."""
    if num_frames is None and fps is not None:
        assert rate is not None
        num_frames = max(1, int(total / rate * fps))
    if num_frames is None:
        return list(range(total))
    if num_frames > total:
        return None
    return [k * total // num_frames for k in range(num_frames)]


def stamp(seconds: float) -> str:
    """mm:ss, each truncated, as Gemma4Processor writes a frame's time."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


class Gemma4VideoProcessor(Qwen3VideoProcessor):
    """Turns a prompt's videos into Gemma 4's timestamped frames (`ImageInput`s): Qwen3-VL's
    template with lone <|video|> placeholders, runs as long as Gemma 4's images' and attending
    both ways where the config says; its kwargs check and timestamp tokenizer cache, none of
    its M-RoPE."""

    kwargs_names = KWARGS
    placeholder = "<|video|>"
    wrapped = False

    def _configure(self, path: Path, config: Any) -> None:
        gemma4.check_config(config)
        self.video_token_id = self.run_token_id = int(config.video_token_id)
        self.start_id, self.end_id = int(config.boi_token_id), int(config.eoi_token_id)
        self.two_way = gemma4.bidirectional(config)
        vision = config.vision_config
        tower = {"patch_size": int(vision.patch_size), "pooling_kernel_size": gemma4.kernel(config)}
        s = tower_checked_settings(path, _DEFAULTS, tower)
        # the frames' steps: the image processor's torch copy with the video's settings
        self.frames = gemma4.Gemma4TorchProcessor(s, config)  # (checks max_soft_tokens)
        self.settings = {**self.frames.settings, **{k: s[k] for k in ("num_frames", "fps")}}
        self.settings["do_sample_frames"] = bool(s["do_sample_frames"])

    def check_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """`kwargs` (mm_processor_kwargs for videos); ValueError naming a bad one."""
        check_kwargs(kwargs)  # fps > 0, do_sample_frames a bool, nothing else
        if "fps" in kwargs and self.settings["num_frames"] is not None:
            raise ValueError(
                "mm_processor_kwargs['fps'] is not taken by Gemma 4: it samples "
                f"num_frames={self.settings['num_frames']} frames evenly (transformers ignores "
                "fps then); give do_sample_frames=False and your own frames"
            )
        return kwargs

    def positions(self, num_tokens: int, items: tuple[ImageInput, ...]) -> Any:
        return None  # plain positions: no M-RoPE table

    def _run_length(self, rows: torch.Tensor, grid: tuple[int, ...]) -> int:
        return gemma4.image_tokens(self.config, grid)

    def _fits(self, m: ImageInput) -> bool:
        """Whether a frame processed ahead (this class's output) is patch rows of a frame
        this tower reads, its run as long as its grid gives."""
        size, rows = m.image_size, m.pixel_values
        ok = (
            rows is not None
            and m.embeds is None
            and size is not None
            and len(size) == 2
            and min(size) > 0
            and m.bidirectional == self.two_way
            and tuple(rows.shape) == (size[0] * size[1], gemma4.patch_dim(self.config))
        )
        try:
            return ok and m.length == gemma4.image_tokens(self.config, size)
        except ValueError:
            return False

    def _load(  # type: ignore[override]
        self, i: int, item: Any, kwargs: dict[str, Any]
    ) -> list[tuple[torch.Tensor, tuple[int, int], str]]:
        """Video i's frames: (patch rows [h * w, 3 p p], grid (h, w), the text before it)."""
        video, meta, indices = indexed_frames(i, item)
        rate = meta.get("fps")
        fps = _DEFAULT_FPS if rate is None else video_fps(i, rate)
        s = self.settings
        asked = kwargs.get("do_sample_frames", meta.get("do_sample_frames"))
        sample = s["do_sample_frames"] and "frames_indices" not in meta if asked is None else asked
        if sample:
            target = kwargs.get("fps", s["fps"])
            if s["num_frames"] is None and target is not None and rate is None:
                raise ValueError(
                    f"multi_modal_data['video'][{i}]: sampling {target} frames a second needs "
                    "the video's fps in its metadata, e.g. (frames, {'fps': 30.0})"
                )
            keep = sample_indices(video.shape[0], s["num_frames"], target, fps)
            if keep is None and asked:
                raise ValueError(
                    f"multi_modal_data['video'][{i}]: {video.shape[0]} frame(s), fewer than the "
                    f"num_frames={s['num_frames']} do_sample_frames asks for"
                )
            if keep is not None:
                video, indices = video[torch.tensor(keep)], [indices[k] for k in keep]
        p, k = s["patch_size"], s["pooling_kernel_size"]
        most = int(s["max_soft_tokens"]) * k**2
        height, width = video.shape[-2:]
        th, tw = (
            gemma4.gemma4_size(height, width, p, most, k) if s["do_resize"] else (height, width)
        )
        h, w = th // p, tw // p
        side = int(self.config.vision_config.position_embedding_size)
        if max(h, w) > side or h % k or w % k or not 0 < h * w <= most:
            raise ValueError(
                f"multi_modal_data['video'][{i}]: frames of {height} x {width} give a {h} x {w} "
                f"patch grid the tower does not take (blocks of {k}, at most {side} a side)"
            )
        n = (h // k) * (w // k)
        budget = getattr(self.engine_config, "max_num_batched_tokens", None)
        if self.two_way and budget is not None and n > budget:
            raise ValueError(
                f"multi_modal_data['video'][{i}]: a frame of {n} tokens is more than "
                f"max_num_batched_tokens={budget}, and its tokens attend to each other both "
                "ways, so one step must hold them all"
            )
        out = self.frames.preprocess(list(video), s)
        rows = out["pixel_values"][:, : h * w].float()  # padding rows dropped
        # each frame's "mm:ss " text; frames after the first joined to it by a space
        texts = [f"{' ' if f else ''}{stamp(t / fps)} " for f, t in enumerate(indices)]
        return [(rows[f].contiguous(), (h, w), texts[f]) for f in range(len(indices))]
