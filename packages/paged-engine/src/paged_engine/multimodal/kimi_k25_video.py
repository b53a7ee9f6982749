"""Videos for Kimi K2.5 / K2.6 (Kimi_K25ForConditionalGeneration): frames -> timestamped chunks.

    frames [T, H, W, 3] uint8 (a list of frames, or (frames, metadata) as vLLM's loader gives)
      -> sampled at `fps` (2) frames a second of the metadata's fps (frame k * T // n of n =
         int(T / rate * fps)), unless a loader sampled them already (metadata frames_indices),
         do_sample_frames=False, or n is past T (kept whole; transformers refuses, as here
         when do_sample_frames=True asks)
      -> cut into chunks of temporal_patch_size (4) frames, the last one shorter
      -> each frame as Kimi's image rule takes an image (kimi_k25.py's torch copy: NaViT size
         under the *video* processor's max_patches, 4096 by default, bicubic with antialias,
         zero-padded to merge * patch pixels, normalized), a chunk's frames' patches
         frame-major: [t * h * w, 3, p, p], grid (t, h, w)
    prompt: each <|kimi_k25_video_placeholder|> becomes, per chunk,
         HH:MM:SS.mmm <|media_begin|> "video" <|media_content|>
             <|kimi_k25_video_placeholder|> x (h * w / m^2) <|media_end|>
         the time of the chunk's first frame (its index / the metadata's fps, 24 without
         one), seconds truncated and milliseconds truncated, as Kimi_K25Processor writes it

The tower (moonvit.py) runs a chunk as one sequence: frame f adds a temporal sinusoid,
attention spans the chunk, and each merge block is averaged over the chunk's frames, so a
chunk gives h * w / m^2 rows whatever its t: an `ImageInput` of grid (t, h, w) that
KimiImageEncoder reads as it reads an image. The decoder is plain causal DeepSeek-V3 with
1-D positions: no M-RoPE, nothing two-way.

vLLM (kimi_k25.py) serves videos as "vision_chunk" items of 4 frames with the chunk prompt
above, but writes each run as <|media_pad|> (media_placeholder_token_id, the images' token);
the run here is transformers' (Kimi_K25Processor repeats the video placeholder token), so a
prompt's image and video runs stay apart (images processed ahead are told by their token).
The chunk's rows replace either token, so the model's input is the same; only the prompt ids
of the runs differ from vLLM's. Timestamps are tokenized on their own (Qwen3-VL's cache; HF
tokenizes the joined text).

Settings: the checkpoint's video processor (video_preprocessor_config.json or
processor_config.json's "video_processor") over transformers' Kimi_K25VideoProcessor
defaults; without one, those defaults with the tower's patch and merge sizes. Refused by name:
saved patch_size / merge_size that are not the tower's, temporal_patch_size past
vision_config.pos_emb_time (videos then not taken), sampling by fps without the metadata's
fps, sampling asked of too few frames, frames_indices that do not fit, and chunks processed
ahead that do not fit the prompt.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from paged_engine.multimodal import kimi_k25
from paged_engine.multimodal.gemma4_video import sample_indices
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.qwen3_video import Qwen3VideoProcessor, check_kwargs
from paged_engine.multimodal.qwen_video import (
    _DEFAULT_FPS,
    indexed_frames,
    tower_checked_settings,
    video_fps,
)

ARCHS = (kimi_k25.ARCH,)
KWARGS = ("fps", "do_sample_frames")  # mm_processor_kwargs a video takes (input_processor.py)
PLACEHOLDER = "<|kimi_k25_video_placeholder|>"
# transformers' Kimi_K25VideoProcessor class defaults
_DEFAULTS: dict[str, Any] = {
    "fps": 2,
    "do_sample_frames": True,
    "temporal_patch_size": 4,
    "max_patches": 4096,
    "size": {"max_height": 512, "max_width": 512},
    "patch_size": 14,
    "merge_size": 2,
    "do_resize": True,
    "resample": 3,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def stamp(seconds: float) -> str:
    """HH:MM:SS.mmm as Kimi_K25Processor writes a chunk's time (gmtime's whole seconds, the
    fraction's milliseconds truncated)."""
    return time.strftime("%H:%M:%S", time.gmtime(seconds)) + f".{int(seconds % 1 * 1000):03d}"


class KimiVideoProcessor(Qwen3VideoProcessor):
    """Turns a prompt's videos into Kimi K2.5's timestamped chunks (`ImageInput`s of grid
    (t, h, w)): Qwen3-VL's template with lone placeholders, the timestamp and
    <|media_begin|>video before <|media_content|>, runs of <|media_pad|>, plain positions."""

    kwargs_names = KWARGS
    placeholder = PLACEHOLDER
    wrapped = False

    def _configure(self, path: Path, config: Any) -> None:
        ids = self.tokenizer.convert_tokens_to_ids(
            [PLACEHOLDER, "<|media_content|>", "<|media_end|>"]
        )
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if any(i is None or i == unk for i in ids):
            raise ValueError(
                f"{path}: the tokenizer lacks {PLACEHOLDER}, <|media_content|> or <|media_end|>"
            )
        self.video_token_id, self.start_id, self.end_id = (int(i) for i in ids)
        self.run_token_id = self.video_token_id  # (transformers'; vLLM's: <|media_pad|>)
        vision = config.vision_config
        tower = {"patch_size": int(vision.patch_size), "merge_size": kimi_k25.merge_size(config)}
        s = tower_checked_settings(path, _DEFAULTS, tower)
        frames = int(getattr(vision, "pos_emb_time", 4))
        if not 1 <= int(s["temporal_patch_size"]) <= frames:
            raise ValueError(
                f"{path}: the video processor's temporal_patch_size={s['temporal_patch_size']} "
                f"is past vision_config.pos_emb_time={frames} (the tower's frame table)"
            )
        # each frame's steps: the image processor's torch copy with the video's settings
        self.frames = kimi_k25.KimiImageProcessor(s, config)  # (checks size and resample)
        keep = ("fps", "temporal_patch_size")
        self.settings = {**self.frames.settings, **{k: s[k] for k in keep}}
        self.settings["do_sample_frames"] = bool(s["do_sample_frames"])

    def check_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """`kwargs` (mm_processor_kwargs for videos); ValueError naming a bad one."""
        return check_kwargs(kwargs)  # fps > 0, do_sample_frames a bool, nothing else

    def positions(self, num_tokens: int, items: tuple[ImageInput, ...]) -> Any:
        return None  # plain positions: no M-RoPE table

    def _run_length(self, rows: torch.Tensor, grid: tuple[int, ...]) -> int:
        return grid[1] * grid[2] // self.settings["merge_size"] ** 2

    def _fits(self, m: ImageInput) -> bool:
        """Whether a chunk processed ahead is patch rows of t frames this tower reads, its run
        as long as its grid gives."""
        size, rows = m.image_size, m.pixel_values
        p, merge = self.settings["patch_size"], self.settings["merge_size"]
        return (
            rows is not None
            and m.embeds is None
            and size is not None
            and len(size) == 3
            and 1 <= size[0] <= self.settings["temporal_patch_size"]
            and min(size) > 0
            and size[1] % merge == 0
            and size[2] % merge == 0
            and not m.bidirectional
            and tuple(rows.shape) == (size[0] * size[1] * size[2], 3, p, p)
            and m.length == size[1] * size[2] // merge**2
        )

    def _load(  # type: ignore[override]
        self, i: int, item: Any, kwargs: dict[str, Any]
    ) -> list[tuple[torch.Tensor, tuple[int, int, int], str]]:
        """Video i's chunks: (patch rows [t * h * w, 3, p, p], grid (t, h, w), the text
        before its <|media_content|>)."""
        video, meta, indices = indexed_frames(i, item)
        rate = meta.get("fps")
        fps = _DEFAULT_FPS if rate is None else video_fps(i, rate)
        s = self.settings
        asked = kwargs.get("do_sample_frames", meta.get("do_sample_frames"))
        sample = s["do_sample_frames"] and "frames_indices" not in meta if asked is None else asked
        if sample:
            target = kwargs.get("fps", s["fps"])
            if rate is None:
                raise ValueError(
                    f"multi_modal_data['video'][{i}]: sampling {target} frames a second needs "
                    "the video's fps in its metadata, e.g. (frames, {'fps': 30.0}), or "
                    "mm_processor_kwargs={'do_sample_frames': False} to take every frame"
                )
            keep = sample_indices(video.shape[0], None, target, fps)
            if keep is None and asked:
                raise ValueError(
                    f"multi_modal_data['video'][{i}]: {video.shape[0]} frame(s) at {fps} fps, "
                    f"fewer than {target} frames a second asks for (do_sample_frames)"
                )
            if keep is not None:  # (else a short video keeps all its frames)
                video, indices = video[torch.tensor(keep)], [indices[k] for k in keep]
        tp = int(s["temporal_patch_size"])
        out = []
        for start in range(0, video.shape[0], tp):
            chunk = self.frames.preprocess(list(video[start : start + tp]), s)
            t = chunk["image_grid_thw"].shape[0]
            _, h, w = (int(v) for v in chunk["image_grid_thw"][0])
            text = f"{stamp(indices[start] / fps)}<|media_begin|>video"
            out.append((chunk["pixel_values"].float(), (t, h, w), text))
        return out
