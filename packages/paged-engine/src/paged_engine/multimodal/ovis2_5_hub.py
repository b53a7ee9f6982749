"""Ovis2.5's Hub release (`Ovis2_5`, remote code; config: models/ovis2_5_hub.py) served as vLLM
serves it (vLLM's ovis2_5.py, siglip2navit.py, transformers_utils/processors/ovis2_5.py), on
transformers' Ovis2_5 port's modules (multimodal/ovis2_5.py).

The maths, read from the remote modeling_ovis2_5.py and vLLM's files against transformers' port:
the tower (Conv2d patches, the bicubic-resized position table in merge-block order, SigLIP layers
with Qwen2.5-VL's 2-D rope at theta 10000, window / full attention by fullatt_block_indexes), the
visual tokenizer (merge x merge rows -> linear -> LayerNorm -> float32 softmax over the
visual_vocab_size - 4 visual tokens), the table `vte` (probs @ rows) and the Qwen3 decoder are
the port's per token. One thing differs: the order the tower's features are read in. The remote
reads its encoder's hidden_states[-1], which its encoder stores after putting the merged tokens
back from window order into patch order (reverse_indices); transformers' port reads its last
layer's output still in window order. So an image's visual rows here come in patch order (merged
tokens row-major): the input of the port's post_layernorm, which is exactly that state
(tests/engine/test_ovis2_5_hub.py checks this against HF's modules).

    prompt (vLLM's processor): each "<image>" of the text (text, not a token: the chunks between
        are tokenized apart) -> <|image_pad|> x (h * w / merge^2 + 2); the whole run takes the
        image's rows: vte's image-start indicator (row V - 4, the remote's -301), the visual
        rows, the image-end indicator (row V - 3, -302)
    pixels: smart resize to multiples of patch * hidden_stride within vLLM's 448^2 .. 1792^2
        pixels (an image under the factor widened first, as the remote), then the release's
        preprocessor_config.json (SiglipImageProcessor: resize to that size, rescale,
        normalize), patches in merge-block order, grid (1, h, w): transformers'
        Ovis2_5ImageProcessorPil with those settings runs the same steps

Refused by name: a preprocessor_config.json image_processor_type other than SiglipImageProcessor,
any mm_processor_kwargs, a tokenizer whose <|image_pad|> is not config.image_token_id. Videos (one
per prompt, as vLLM takes them): multimodal/ovis2_5_hub_video.py; the encoder gives a video's run
the video indicators (rows V - 2, V - 1) around the same visual rows.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paged_engine.models.ovis2_5_hub import IMAGE_PAD
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import Loaded, splice_at_text, token_ids
from paged_engine.multimodal.layouts_qwen import Ovis2_5Layout
from paged_engine.multimodal.ovis2_5 import (
    Ovis2_5ImageEncoder,
    Ovis2_5VisionTower,
    _VisualTokenizer,
    check_config,
)

MARKER = "<image>"  # vLLM's IMAGE_TOKEN: text the processor splits on
MIN_PIXELS = 448 * 448  # vLLM's processor's bounds (transformers_utils/processors/ovis2_5.py)
MAX_PIXELS = 1792 * 1792
_PROCESSOR_TYPES = ("SiglipImageProcessor", "SiglipImageProcessorFast", "SiglipImageProcessorPil")
_BICUBIC = 3  # SiglipImageProcessor's default resample (PIL)
# preprocessor_config.json settings the resize / rescale / normalize steps take
_SETTINGS = ("resample", "do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std")


def image_processor(saved: dict[str, Any], config: Any) -> Any:
    """transformers' Ovis2_5ImageProcessorPil running vLLM's steps with the release's
    preprocessor_config.json settings (see the module)."""
    from transformers.models.ovis2_5.image_processing_pil_ovis2_5 import (
        Ovis2_5ImageProcessorPil,
    )

    kind = saved.get("image_processor_type", "SiglipImageProcessor")
    if kind not in _PROCESSOR_TYPES:
        raise ValueError(
            f"preprocessor_config.json image_processor_type={kind!r} is not supported for "
            f"Ovis2_5: SiglipImageProcessor (resize, rescale, normalize)"
        )
    v = config.vision_config
    settings = {k: saved[k] for k in _SETTINGS if saved.get(k) is not None}
    settings.setdefault("resample", _BICUBIC)
    settings.setdefault("image_mean", [0.5, 0.5, 0.5])  # SiglipImageProcessor's defaults
    settings.setdefault("image_std", [0.5, 0.5, 0.5])
    return Ovis2_5ImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        patch_size=int(v.patch_size),
        merge_size=int(v.spatial_merge_size),
        temporal_patch_size=1,
        do_convert_rgb=True,
        **settings,
    )


class Ovis2_5HubLayout(Ovis2_5Layout):
    """Each "<image>" of the text -> a run of <|image_pad|> by the merged grid plus the two
    indicator places; the run is the image's span (see the module)."""

    saved: dict[str, Any] | None = None

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        check_config(config)
        self.config = config
        self.placeholder = placeholder  # <|image_pad|>: config.image_token_id
        self.tokenizer = tokenizer
        self.fixed = None
        if tokenizer is not None and token_ids(tokenizer, IMAGE_PAD)[0] != placeholder:
            raise ValueError(
                f"the tokenizer's {IMAGE_PAD} is id {token_ids(tokenizer, IMAGE_PAD)[0]}, not "
                f"config image_token_id {placeholder} (vLLM's id for Ovis2.5's Qwen3 tokenizer)"
            )

    def read_saved(self, path: Path) -> None:
        file = Path(path) / "preprocessor_config.json"
        self.saved = json.loads(file.read_text()) if file.is_file() else {}

    def image_processor(self) -> Any:
        return image_processor(self.saved or {}, self.config)

    def check_kwargs(self, kwargs: dict[str, Any]) -> None:
        if kwargs:
            raise ValueError(
                f"mm_processor_kwargs {sorted(kwargs)} are not supported for Ovis2_5 (vLLM's "
                "processor takes none)"
            )

    def segment(self, loaded: Loaded) -> list[int]:
        return [self.placeholder] * self.length(loaded[1])

    def span(self, m: ImageInput) -> list[int]:
        return [self.placeholder] * m.length

    @property
    def marker(self) -> int:
        return -1 if self.tokenizer is None else self.tokenizer.get_vocab().get(MARKER, -1)

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """The prompt's text split at each "<image>", the pieces tokenized apart and the
        segments put between them (vLLM's processor); ValueError naming multi_modal_data unless
        there is one "<image>" per image and no <|image_pad|> of the text's own."""
        tok = self.tokenizer
        if tok is None:
            raise ValueError("the tokenizer is needed to place Ovis2.5's images")
        if self.placeholder in ids:
            raise ValueError(
                f"multi_modal_data['image']: the prompt holds {IMAGE_PAD} tokens of its own "
                "outside its images' runs"
            )
        return splice_at_text(tok, ids, segments, MARKER)


class _PatchOrderTower(Ovis2_5VisionTower):
    """The port's tower read out as the remote reads it: merged tokens in patch order."""

    def _window_order(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        return torch.arange(sum(t * h * w for t, h, w in grids) // self.merge**2)


class Ovis2_5HubImageEncoder(Ovis2_5ImageEncoder):
    """Images -> [image-start row, visual rows in patch order, image-end row] per image (the
    port's encoder but for the read-out order); the Hub's weight names."""

    def __init__(self, config: Any) -> None:
        nn.Module.__init__(self)
        check_config(config)
        v = config.vision_config
        self.vision_tower = _PatchOrderTower(v)
        self.visual_tokenizer = _VisualTokenizer(v)
        self.vte = nn.Embedding(int(v.vocab_size), int(config.text_config.hidden_size))

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """The port's rows per item; a video's (modality "video") between the video-start and
        video-end indicators (the third and fourth) instead of the image's."""
        table = self.vte.weight
        first = self.visual_tokenizer.visual_vocab + 2  # <video>, </video>
        return [
            torch.cat([table[first : first + 1], r[1:-1], table[first + 1 : first + 2]])
            if m.modality == "video"
            else r
            for m, r in zip(images, super().encode(images), strict=True)
        ]
