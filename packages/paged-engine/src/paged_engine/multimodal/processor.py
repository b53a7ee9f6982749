"""Image prompts on the host: images -> pixel values, one placeholder -> a run of placeholders.

vLLM's prompt form: `{"prompt": "USER: <image>\\nWhat is this? ASSISTANT:",
"multi_modal_data": {"image": image_or_list}}` (or `prompt_token_ids`). Each image token in the
prompt stands for one image, in order; it becomes a run of as many copies of itself as the
image has feature rows (LLaVA: `tokens_per_image`, the same for every image; LLaVA-NeXT: by the
image's size, multimodal/llava_next.py), and the image becomes an `ImageInput` at that run. A
prompt whose runs are expanded already (token ids of an earlier output, or a client's HF
processor) is taken as it is. Images go through the checkpoint's own image processor
(preprocessor_config.json: resize, crop / tile, normalize), as HF's LlavaProcessor and
LlavaNextProcessor run them.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import torch

from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.llava import IMAGE_ARCHS, image_token_id, tokens_per_image
from paged_engine.multimodal.llava_next import ARCH as NEXT_ARCH
from paged_engine.multimodal.llava_next import AnyRes

logger = logging.getLogger(__name__)

_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def require_pillow():
    try:
        import PIL.Image
    except ImportError as e:
        raise ImportError("image inputs need Pillow: pip install 'paged-engine[vision]'") from e
    return PIL.Image


def wrapper_config(path: Path, trust_remote_code: bool = False) -> Any | None:
    """The checkpoint's own config when it is a wrapper whose images paged runs, else None."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    archs = getattr(config, "architectures", None) or []
    return config if any(a in IMAGE_ARCHS for a in archs) else None


def processor_saved(path: Path) -> bool:
    """Whether the checkpoint holds its image processor (transformers 5 saves it inside
    processor_config.json)."""
    return any((Path(path) / f).exists() for f in _PROCESSOR_FILES)


def _digest(pixels: torch.Tensor, size: tuple[int, int] | None) -> str:
    h = hashlib.blake2b(pixels.numpy().tobytes(), digest_size=16)
    h.update(repr(size).encode())
    return h.hexdigest()


class ImageProcessor:
    """Turns a prompt's images into `ImageInput`s placed in its token ids."""

    def __init__(self, path: Path, config: Any, limit: int | None = None) -> None:
        self.path = Path(path)
        self.image_token_id = image_token_id(config)
        self.image_size = int(config.vision_config.image_size)
        self.anyres = AnyRes.from_config(config) if NEXT_ARCH in config.architectures else None
        # placeholders an image takes; None where its size decides (LLaVA-NeXT)
        self.tokens_per_image = None if self.anyres else tokens_per_image(config)
        self.limit = limit  # images per prompt (limit_mm_per_prompt["image"]); None: any
        if not processor_saved(self.path):
            raise ValueError(
                f"{path} has neither preprocessor_config.json nor processor_config.json: the "
                "image processor of "
                f"{config.architectures[0]} is needed to run its images (pass "
                "limit_mm_per_prompt={'image': 0} to serve its text model only)"
            )
        self._hf = None  # transformers' image processor, loaded with the first image

    @property
    def hf(self):
        if self._hf is None:
            from transformers import AutoImageProcessor

            self._hf = AutoImageProcessor.from_pretrained(self.path)
        return self._hf

    def process(
        self, token_ids: list[int], images: Any
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """(token ids with each image's placeholder run, the images); ValueError naming
        multi_modal_data for anything wrong with the images or their placeholders. Items that
        are `ImageInput`s already (this method's output, e.g. from a server that processed the
        images on its request thread) are taken as they are once their runs check out."""
        items = list(images) if isinstance(images, (list, tuple)) else [images]
        if not items:
            raise ValueError("multi_modal_data['image'] is empty: give an image or leave it out")
        if self.limit is not None and len(items) > self.limit:
            raise ValueError(
                f"multi_modal_data['image'] has {len(items)} images, over "
                f"limit_mm_per_prompt={{'image': {self.limit}}}"
            )
        if all(isinstance(m, ImageInput) for m in items):
            token_ids = self.expand(token_ids, [self.length(m.image_size) for m in items])
            if [m.offset for m in items] != self._run_starts(token_ids) or any(
                m.length != self.length(m.image_size)
                or tuple(m.pixel_values.shape) != self.pixel_shape(m.image_size)
                for m in items
            ):
                raise ValueError(
                    "multi_modal_data['image']: these processed images do not fit this prompt "
                    "and model (their placeholder runs or pixel shapes differ)"
                )
            return token_ids, tuple(items)
        items = self._image_list(items)
        pixels, sizes = self._pixels(items)
        lengths = [self.length(size) for size in sizes]
        token_ids = self.expand(token_ids, lengths)
        starts = self._run_starts(token_ids)
        out = tuple(
            ImageInput(p, offset, n, _digest(p, size), size)
            for p, offset, n, size in zip(pixels, starts, lengths, sizes, strict=True)
        )
        return token_ids, out

    def length(self, size: tuple[int, int] | None) -> int:
        """Placeholders of an image of `size` (h, w; LLaVA-NeXT's depend on it)."""
        if self.anyres is None:
            assert self.tokens_per_image is not None
            return self.tokens_per_image
        if size is None:
            raise ValueError("multi_modal_data['image']: a processed image lacks its image_size")
        return self.anyres.tokens(size)

    def pixel_shape(self, size: tuple[int, int] | None) -> tuple[int, ...]:
        side = (self.image_size, self.image_size)
        if self.anyres is None:
            return (3, *side)
        assert size is not None  # length() checked it
        return (self.anyres.views(size), 3, *side)

    def _run_starts(self, ids: list[int]) -> list[int]:
        tid = self.image_token_id
        return [i for i, t in enumerate(ids) if t == tid and (i == 0 or ids[i - 1] != tid)]

    def _image_list(self, items: list[Any]) -> list[Any]:
        PIL_Image = require_pillow()
        for i, item in enumerate(items):
            if not isinstance(item, PIL_Image.Image):
                raise ValueError(
                    f"multi_modal_data['image'][{i}] must be a PIL.Image.Image, got "
                    f"{type(item).__name__}"
                )
        return items

    def _pixels(self, images: list[Any]) -> tuple[list[torch.Tensor], list[tuple[int, int] | None]]:
        """Each image's pixel values and, for LLaVA-NeXT, its (h, w) as the processor saw it."""
        try:
            rgb = [im.convert("RGB") for im in images]
            out = self.hf(images=rgb, return_tensors="pt")
        except Exception as e:  # a corrupt or truncated image, a size the processor refuses
            raise ValueError(
                f"multi_modal_data['image']: the image could not be processed: {e}"
            ) from e
        pixels = out["pixel_values"].float()
        sizes: list[tuple[int, int] | None] = [None] * len(images)
        if self.anyres is not None:  # [N, most views, 3, S, S], zero views after each's own
            sizes = [(int(h), int(w)) for h, w in out["image_sizes"].tolist()]
            views = [p[: self.anyres.views(size)] for p, size in zip(pixels, sizes, strict=True)]
        else:
            views = list(pixels)
        for p, size in zip(views, sizes, strict=True):
            if tuple(p.shape) != self.pixel_shape(size):
                raise ValueError(
                    f"the image processor gave pixel values of shape {tuple(p.shape)}, not "
                    f"{self.pixel_shape(size)} (the vision tower's image_size): check "
                    "preprocessor_config.json"
                )
        return views, sizes

    def expand(self, ids: list[int], lengths: list[int]) -> list[int]:
        """Each lone placeholder -> a run of its image's length; runs already that long stay
        (ValueError unless there is one placeholder or run per image). A server calls it to
        know the prompt's length before the engine takes the images."""
        tid = self.image_token_id
        runs: list[tuple[int, int]] = []  # (start, length)
        for i, t in enumerate(ids):
            if t != tid:
                continue
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
        if len(runs) != len(lengths) or any(
            length not in (1, n) for (_, length), n in zip(runs, lengths)
        ):
            found = ", ".join(str(length) for _, length in runs) or "none"
            want = ", ".join(str(n) for n in lengths)
            raise ValueError(
                f"multi_modal_data['image'] has {len(lengths)} image(s) but the prompt has "
                f"{len(runs)} image placeholder(s) (token id {tid}; runs of {found} tokens): "
                f"put one image token per image where it belongs (or runs of {want})"
            )
        out: list[int] = []
        last = 0
        for (start, length), n in zip(runs, lengths):
            out += ids[last:start]
            out += [tid] * n
            last = start + length
        return out + ids[last:]
