"""Videos for the Qwen2.5-Omni and Qwen3-Omni thinkers: Qwen2.5-VL's video path, Omni's clock.

    frames [T, H, W, 3] uint8 (or a list of frames, or (frames, metadata))
      -> Qwen2-VL's video processor (multimodal/qwen_video.py: each frame resized within the
         video size bounds, normalized, the last frame repeated to pairs) -> rows [t*h*w, ...]
    prompt: <|vision_bos|> <|VIDEO|> x (t*h*w / merge^2) <|vision_eos|> (Qwen3-Omni:
         <|vision_start|> <|video_pad|> ... <|vision_end|>)

A video is one `ImageInput` of grid (t, h, w) that the thinker's tower reads frame by frame
(multimodal/qwen_omni.py: Qwen2.5-VL's tower, or Qwen3-VL's with deepstack rows), as
QwenVideoProcessor makes for Qwen2.5-VL. What differs, as transformers runs the thinkers:
- The temporal step: frame group k has temporal index floor(k * second_per_grid *
  position_id_per_seconds) (the thinker config's, 25), second_per_grid = temporal_patch_size /
  fps, fps mm_processor_kwargs' else the processor's default, 2 (Qwen2.5-Omni) or 1
  (Qwen3-Omni); as transformers' Omni processors, the video's metadata rate is not read.
- The M-RoPE table (get_rope_index): the text after a video continues from its largest
  position + 1, start + max(last temporal index + 1, h, w), not Qwen2-VL's start + max(h, w);
  so this processor gives the table of every prompt with images and videos (the same rows as
  the image path's for images).
mm_processor_kwargs['use_audio_in_video']=True (each video with its clip in
multi_modal_data['audio']) interleaves a video's runs with its audio's: multimodal/omni_av.py.
Refused by name: an mm_processor_kwargs['fps'] whose Qwen3-Omni step is a fraction
(its get_rope_index keeps float positions, the table here is whole numbers), and what
QwenVideoProcessor refuses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from paged_engine.multimodal import omni_av, qwen_omni
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.mrope import MropePositions, mrope_positions
from paged_engine.multimodal.qwen_video import (
    VIDEO_KWARGS,
    QwenVideoProcessor,
    check_kwargs,
)

ARCHS = (
    qwen_omni.QWEN2_5_OMNI,
    qwen_omni.QWEN3_OMNI,
    "Qwen2_5OmniForConditionalGeneration",
    "Qwen3OmniMoeForConditionalGeneration",
)
# the processors' fps when none is given (Qwen2_5OmniProcessor / Qwen3OmniMoeProcessor)
_DEFAULT_FPS = {qwen_omni.QWEN2_5_OMNI: 2.0, qwen_omni.QWEN3_OMNI: 1.0}


def omni_positions(num_tokens: int, items: tuple[ImageInput, ...], merge: int) -> MropePositions:
    """Qwen2-VL's table with Omni's rule after each image / video: the next position is one
    past its largest, start + max(last temporal index + 1, h, w)."""
    base = mrope_positions(num_tokens, items, merge)
    table = base.table.copy()
    for m in items:
        assert m.image_size is not None
        h, w = m.image_size[1] // merge, m.image_size[2] // merge
        # (the run's first row is (start, start, start); its last temporal index start + t)
        last = int(base.table[0, m.end - 1] - base.table[1, m.offset])
        if (extra := last + 1 - max(h, w)) > 0:
            table[:, m.end :] += extra
    delta = int(table.max()) + 1 - num_tokens if num_tokens else 0
    return MropePositions(table, base.first, delta)


class OmniVideoProcessor(QwenVideoProcessor):
    """Qwen-Omni thinkers' videos (QwenVideoProcessor's runs) with Omni's temporal step; the
    M-RoPE table of the thinker's prompts (`places_images`: images too)."""

    places_images = True  # InputProcessor takes this table for prompts with images as well
    places_audio = True  # ... and hands it the audio items (a video's clip runs: omni_av.py)
    kwargs_names = (*VIDEO_KWARGS, "use_audio_in_video")

    def _configure(self, path: Path, config: Any) -> None:
        self.config = config = qwen_omni.thinker_config(config)
        super()._configure(path, config)
        self.tokens_per_second = None  # (QwenVideoProcessor's Qwen2.5-VL step: not Omni's)
        arch = next(a for a in config.architectures if a in _DEFAULT_FPS)
        self.default_fps = _DEFAULT_FPS[arch]
        # Qwen3-Omni's get_rope_index keeps float positions (Qwen2.5-Omni's floors them)
        self.fractional_refused = arch == qwen_omni.QWEN3_OMNI
        self.qwen3 = self.fractional_refused  # (omni_av.py: Qwen3-Omni's block layout)
        pps = getattr(config, "position_id_per_seconds", 25)
        if isinstance(pps, bool) or not isinstance(pps, int | float) or pps <= 0:
            raise ValueError(f"position_id_per_seconds={pps!r} is not supported: a number > 0")
        self.position_id_per_seconds = float(pps)

    def check_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if kwargs.get("use_audio_in_video"):  # (InputProcessor hands these to audio_in_video)
            raise ValueError(
                "mm_processor_kwargs['use_audio_in_video'] needs the videos and their audio "
                "in multi_modal_data"
            )
        return check_kwargs({k: v for k, v in kwargs.items() if k != "use_audio_in_video"})

    def audio_in_video(
        self, inputs: Any, token_ids: list[int], mm_data: dict, kwargs: dict[str, Any]
    ) -> tuple[list[int], tuple]:
        """InputProcessor.multimodal with use_audio_in_video=True (omni_av.py)."""
        return omni_av.process(inputs, token_ids, mm_data, kwargs)

    def positions(self, num_tokens: int, items: tuple[ImageInput, ...]) -> MropePositions:
        merge = self.settings["merge_size"]
        if any(omni_av.is_cut(m) for m in items):  # a video's block
            return omni_av.av_positions(num_tokens, items, merge, self.qwen3)
        visual = tuple(m for m in items if m.modality != "audio")  # (clips: text positions)
        return omni_positions(num_tokens, visual, merge)

    def _load(
        self, i: int, item: Any, kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, tuple[int, int, int], float]:
        rows, grid, _ = super()._load(i, item, kwargs)  # (the metadata checked there)
        fps = float(kwargs.get("fps", self.default_fps))
        tp = self.settings["temporal_patch_size"]
        # float32 as transformers computes it: the index is floor(k * step)
        step = float(np.float32(tp / fps) * np.float32(self.position_id_per_seconds))
        if self.fractional_refused and abs(step - round(step)) > 1e-4:
            raise ValueError(
                f"mm_processor_kwargs['fps']={fps:g}: Qwen3-Omni's temporal positions would "
                f"step by {tp} / fps * {self.position_id_per_seconds:g} = {step:.4g}, a fraction "
                "(transformers rotates by fractional positions; paged's M-RoPE positions are "
                "whole): give an fps that makes the step whole, e.g. 1 or 2"
            )
        return rows, grid, step
