"""Ovis2.5's Hub release (`Ovis2_5`, multimodal/ovis2_5_hub.py): one video per prompt, as vLLM
serves it (vLLM's ovis2_5.py and transformers_utils/processors/ovis2_5.py).

    frames [T, H, W, 3] uint8 (or a list of frames, or (frames, metadata); vLLM reads no
      metadata) -> each frame as the images' steps take an image (smart resize to multiples of
      patch * hidden_stride within 448^2 .. 1792^2 pixels, the release's SiglipImageProcessor
      settings, patches in merge-block order; multimodal/ovis2_5_hub.py `image_processor`);
      the frames' rows one after another -> rows [T * h * w, 3 * p * p], grid (T, h, w)
      (temporal_patch_size is 1: a frame is a temporal patch)
    prompt: the text split at "<video>" (text, not a token: the two pieces tokenized apart)
      -> <|image_pad|> x (T * h * w / merge^2 + 2) between them
    rows (multimodal/ovis2_5_hub.py's encoder): vte's video-start indicator (row V - 2, the
      remote's -303), the tower's visual rows of the whole grid (attention within each frame),
      the video-end indicator (row V - 1, -304)

vLLM's limit is one video per prompt. Refused by name: a second video, a video beside images in
one prompt (their runs would share <|image_pad|>; not served here), any mm_processor_kwargs
(vLLM's processor takes none), a prompt without exactly one "<video>".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from paged_engine.models.ovis2_5_hub import ARCH, IMAGE_PAD, INDICATORS
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import digest
from paged_engine.multimodal.ovis2_5 import check_config
from paged_engine.multimodal.ovis2_5_hub import image_processor
from paged_engine.multimodal.qwen_video import (
    VideoProcessor,
    _frames,
    known_kwargs,
    video_list,
    video_meta,
)

ARCHS = (ARCH,)
MARKER = "<video>"  # vLLM's VIDEO_TOKEN: text the processor splits on


class Ovis2_5HubVideoProcessor(VideoProcessor):
    """Turns a prompt's one video into an `ImageInput` (modality "video") at its "<video>"."""

    kwargs_names: tuple[str, ...] = ()

    def _configure(self, path: Path, config: Any) -> None:
        check_config(config)
        v = config.vision_config
        if int(v.num_visual_indicator_tokens) < INDICATORS:
            raise ValueError(
                f"vision_config.num_visual_indicator_tokens={v.num_visual_indicator_tokens}: "
                f"videos need the video start and end indicators ({INDICATORS})"
            )
        if self.tokenizer is None:
            raise ValueError(f"{ARCH}: the tokenizer is needed to place videos")
        file = path / "preprocessor_config.json"
        self.processor = image_processor(
            json.loads(file.read_text()) if file.is_file() else {}, config
        )
        self.video_token_id = int(config.image_token_id)  # a video's run is <|image_pad|> too
        self.merge = int(v.spatial_merge_size)
        self.row_width = int(v.num_channels) * int(v.patch_size) ** 2

    def check_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        known_kwargs(kwargs, self.kwargs_names)
        return kwargs

    def positions(self, num_tokens: int, items: tuple[ImageInput, ...]) -> Any:
        return None  # plain positions (a Qwen3 decoder)

    def process(
        self, token_ids: list[int], videos: Any, kwargs: dict[str, Any] | None = None
    ) -> tuple[list[int], list[ImageInput], list[tuple[int, int]]]:
        """(token ids with the video's run, [the video], [(its start, tokens added)]);
        ValueError naming multi_modal_data['video'] (or mm_processor_kwargs) for anything
        wrong."""
        self.check_kwargs(kwargs or {})
        items = video_list(videos, None)
        if len(items) != 1:
            raise ValueError(
                f"multi_modal_data['video'] has {len(items)} videos: {ARCH} takes one video per "
                "prompt (vLLM's limit)"
            )
        if self.video_token_id in token_ids and not isinstance(items[0], ImageInput):
            raise ValueError(
                f"multi_modal_data['video']: the prompt holds {IMAGE_PAD} tokens (images' runs "
                f"or its own); {ARCH} takes a video with no images beside it"
            )
        if isinstance(items[0], ImageInput):  # processed ahead (a server's)
            return self._placed(token_ids, items[0])
        rows, grid = self._load(items[0])
        t, h, w = grid
        length = t * h * w // self.merge**2 + 2
        out, start = self._splice(token_ids, length)
        video = ImageInput(rows, start, length, digest(rows, grid), grid, modality="video")
        return out, [video], [(start, len(out) - len(token_ids))]

    def _load(self, item: Any) -> tuple[Any, tuple[int, int, int]]:
        """(patch rows, grid (T, h, w)) of the video: each frame as the images' steps take it."""
        frames, meta = item if isinstance(item, tuple) and len(item) == 2 else (item, None)
        video_meta(0, meta)  # checked, not read (vLLM reads no metadata)
        video = _frames(0, frames)  # [T, 3, H, W] uint8, frames of one size
        from PIL import Image  # (the images extra: not needed to import this module)

        pil = [Image.fromarray(f.permute(1, 2, 0).numpy()) for f in video]
        out = self.processor(images=pil, return_tensors="pt")
        grids = {tuple(int(x) for x in g) for g in out["image_grid_thw"]}
        assert len(grids) == 1, grids  # frames of one size resize alike
        (_, h, w) = grids.pop()
        return out["pixel_values"], (len(pil), h, w)

    def _splice(self, token_ids: list[int], length: int) -> tuple[list[int], int]:
        """The prompt's text split at its one "<video>", the pieces tokenized apart and the run
        of `length` <|image_pad|> between them (vLLM's processor): (ids, the run's start)."""
        tok = self.tokenizer
        text = tok.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        pieces = text.split(MARKER)
        if len(pieces) != 2:
            raise ValueError(
                f"multi_modal_data['video'] has 1 video but the prompt has {len(pieces) - 1} "
                f"video placeholder(s) ({MARKER}): put one where it belongs"
            )
        head = tok.encode(pieces[0], add_special_tokens=False)
        tail = tok.encode(pieces[1], add_special_tokens=False)
        return head + [self.video_token_id] * length + tail, len(head)

    def _placed(
        self, token_ids: list[int], m: ImageInput
    ) -> tuple[list[int], list[ImageInput], list[tuple[int, int]]]:
        """A video processed ahead (`process`'s output): patch rows this tower reads, its run
        where the prompt holds it (expanded already, or at its "<video>")."""
        grid, rows = m.image_size, m.pixel_values
        if (
            m.modality != "video"
            or rows is None
            or m.embeds is not None
            or m.token_rows
            or grid is None
            or len(grid) != 3
            or grid[1] % self.merge
            or grid[2] % self.merge
            or tuple(rows.shape) != (grid[0] * grid[1] * grid[2], self.row_width)
            or m.length != rows.shape[0] // self.merge**2 + 2
        ):
            raise ValueError(
                "multi_modal_data['video']: this processed video is not patch rows this model "
                "reads (its grid, rows or run differ)"
            )
        run = token_ids[m.offset : m.offset + m.length]
        if (
            run == [self.video_token_id] * m.length
            and token_ids.count(self.video_token_id) == m.length
        ):
            return token_ids, [m], []
        out, start = self._splice(token_ids, m.length)
        if start != m.offset:
            raise ValueError(
                "multi_modal_data['video']: this processed video does not fit this prompt (its "
                "run starts elsewhere)"
            )
        return out, [m], [(start, len(out) - len(token_ids))]
