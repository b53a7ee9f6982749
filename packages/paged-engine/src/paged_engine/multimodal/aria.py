"""Aria's image path (AriaForConditionalGeneration, rhymes-ai/Aria): an Idefics3-style SigLIP
tower, a projector of learned queries cross-attending to its patches, Aria's MoE decoder.

    image -> the checkpoint's AriaImageProcessor, with AriaProcessor's own defaults
        (max_image_size=980, split_image=False; mm_processor_kwargs override them): with
        split_image, cut into crops of S = max_image_size by the best of split_resolutions;
        each crop resized (longest side S, the other at least min_image_size), padded right /
        bottom to S x S, `pixel_mask` True on its top-left h x w pixels
    each crop -> tower (model_type idefics3_vision): patches of p pixels where the mask holds
        any pixel, a rows x cols grid (rows = ceil(h / p)), position ids bucketing the grid's
        fractions into the tower's image_size / p table -> hidden_states[vision_feature_layer]
        (before post_layernorm for -1: transformers does not tie it to last_hidden_state)
        -> projector: q = query[:Q] (Q = projector_patch_to_query_dict[(S / p)^2], by the
           crop's whole size), k / v = the crop's patches:
           a = linear(MHA(q_proj(LN(q)), k_proj(LN_kv(x)), v_proj(LN_kv(x))))
           (MHA: torch's nn.MultiheadAttention with its own in / out projections)
           rows = linear_out(gelu_tanh(linear_in(LN(a))))  -> Q rows of text hidden_size
    prompt: AriaProcessor replaces each image token (<|img|>) by crops * Q of it, one run

A crop is one `ImageInput` (image_size = (S, h, w): its side and valid pixels), so the crops
of an image are adjacent runs of Q. transformers runs the crops of a batch at S x S and masks
the padded patches out of the tower's attention (as keys) and out of the projector's; here
each crop runs alone on its valid patches, which gives the same rows. Weights:
`[model.]vision_tower.*` and `[model.]multi_modal_projector.*`. Refused by name: a tower other
than idefics3_vision, a list vision_feature_layer, a crop size whose patch count
projector_patch_to_query_dict lacks; mm_processor_kwargs min_image_size past the crop side, or
split_resolutions that are not [h, w] pairs of at most MOST_SPLIT_PIXELS (`check_kwargs`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.idefics2 import Tower
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import Layout, Loaded, Run, Size, _shape_error, digest

ARCH = "AriaForConditionalGeneration"
# AriaProcessor's image kwargs, which it passes over the image processor's saved settings
PROCESSOR_DEFAULTS = {"max_image_size": 980, "split_image": False}
MOST_SPLIT_PIXELS = 64 * 490 * 490  # a request's split resolution: at most 64 of the small crops
_PREFIXES = ("vision_tower.", "multi_modal_projector.")


def check_config(config: Any) -> int:
    """The hidden_states index the projector reads (0 = the embeddings); ValueError naming
    an unsupported vision_config.model_type or vision_feature_layer."""
    kind = getattr(config.vision_config, "model_type", None)
    if kind != "idefics3_vision":
        raise ValueError(f"vision_config.model_type={kind!r} is not supported: 'idefics3_vision'")
    layer, depth = config.vision_feature_layer, int(config.vision_config.num_hidden_layers)
    if isinstance(layer, bool) or not isinstance(layer, int) or not -depth - 1 <= layer <= depth:
        raise ValueError(
            f"vision_feature_layer={layer!r} is not supported: one layer index in "
            f"[{-depth - 1}, {depth}]"
        )
    return layer % (depth + 1)


def query_table(config: Any) -> dict[int, int]:
    return {int(k): int(v) for k, v in config.projector_patch_to_query_dict.items()}


def crop_tokens(config: Any, side: int) -> int:
    """Q: placeholders (= projector queries) of one crop of side x side pixels."""
    patches = (side // int(config.vision_config.patch_size)) ** 2
    table = query_table(config)
    if patches not in table:
        raise ValueError(
            f"crops of {side} pixels have {patches} patches, for which "
            f"projector_patch_to_query_dict ({table}) has no query count: set max_image_size "
            "to a crop size the checkpoint was trained with"
        )
    return table[patches]


def _valid_size(mask: torch.Tensor) -> tuple[int, int]:
    """(h, w) of a pixel_mask [S, S] true on its top-left h x w pixels alone."""
    h, w = int(mask.any(1).sum()), int(mask.any(0).sum())
    if h == 0 or not bool(mask[:h, :w].all()) or int(mask.sum()) != h * w:
        raise ValueError(
            "multi_modal_data['image']: the image processor gave a pixel_mask that is not a "
            "top-left box"
        )
    return h, w


class AriaLayout(Layout):
    """One run of crops * Q image tokens an image; each crop its own `ImageInput` of pixels
    [3, S, S] and image_size (S, h, w)."""

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        check_config(config)
        self.config = config
        self.placeholder = placeholder
        self.fixed = None

    def length(self, size: Size) -> int:
        return crop_tokens(self.config, size[0])  # type: ignore[index]

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        return (3, size[0], size[0])  # type: ignore[index]

    def check_kwargs(self, kwargs: dict[str, Any]) -> None:
        """mm_processor_kwargs refused before any pixel is made: a min_image_size past the
        crop side (the padding would go negative after a resize to it), split_resolutions the
        processor cannot tile or that would resize the image past MOST_SPLIT_PIXELS."""
        side = kwargs.get("max_image_size", PROCESSOR_DEFAULTS["max_image_size"])
        if side not in (490, 980):
            return  # the processor refuses it by name
        low = kwargs.get("min_image_size")
        if low is not None and (
            isinstance(low, bool) or not isinstance(low, int) or not 0 <= low <= side
        ):
            raise ValueError(
                f"mm_processor_kwargs['min_image_size'] must be an int in [0, {side}] "
                f"(max_image_size), got {low!r}"
            )
        splits = kwargs.get("split_resolutions")
        if splits is None:
            return
        pairs = isinstance(splits, list) and bool(splits)
        pairs = pairs and all(
            isinstance(r, (list, tuple))
            and len(r) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in r)
            and r[0] * r[1] <= MOST_SPLIT_PIXELS
            for r in splits
        )
        if not pairs:
            raise ValueError(
                "mm_processor_kwargs['split_resolutions'] must be a non-empty list of [height, "
                f"width] pixel pairs of at most {MOST_SPLIT_PIXELS} pixels, got {splits!r}"
            )

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image], **PROCESSOR_DEFAULTS)
        pixels, masks = out["pixel_values"].float(), torch.as_tensor(out["pixel_mask"])
        side = pixels.shape[-1] if pixels.dim() == 4 else 0
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (3, side, side) or not len(pixels):
            raise _shape_error(pixels, "[crops, 3, S, S]")
        if tuple(masks.shape) != (len(pixels), side, side):
            raise ValueError(
                f"multi_modal_data['image']: the image processor gave a pixel_mask of shape "
                f"{tuple(masks.shape)}"
            )
        try:
            crop_tokens(self.config, side)
        except ValueError as e:
            raise ValueError(f"multi_modal_data['image']: {e}") from e
        sizes = [_valid_size(m.bool()) for m in masks]
        return pixels, (side, *(x for hw in sizes for x in hw))

    def segment(self, loaded: Loaded) -> list[int]:
        side, crops = loaded[1][0], len(loaded[0])  # type: ignore[index]
        return [self.placeholder] * (crops * crop_tokens(self.config, side))

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        pixels, size = loaded
        side, n = size[0], crop_tokens(self.config, size[0])  # type: ignore[index]
        out = []
        for i, crop in enumerate(pixels.unbind(0)):
            crop_size = (side, size[1 + 2 * i], size[2 + 2 * i])  # type: ignore[index]
            out.append(ImageInput(crop, at + i * n, n, digest(crop, crop_size), crop_size))
        return out

    def fits(self, m: ImageInput) -> bool:
        size = m.image_size
        if size is None or len(size) != 3 or not all(0 < x <= size[0] for x in size[1:]):
            return False
        return super().fits(m)


class _CrossAttention(nn.Module):
    """Learned queries attend to the crop's patches (HF's AriaCrossAttention, names kept)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(width, width, bias=False)
        self.k_proj = nn.Linear(width, width, bias=False)
        self.v_proj = nn.Linear(width, width, bias=False)
        self.multihead_attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.linear = nn.Linear(width, width)
        self.layer_norm = nn.LayerNorm(width)
        self.layer_norm_kv = nn.LayerNorm(width)

    def forward(self, patches: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        # patches [N, P, D], queries [N, Q, D] -> [N, Q, D]
        q = self.q_proj(self.layer_norm(queries))
        kv = self.layer_norm_kv(patches)
        out, _ = self.multihead_attn(q, self.k_proj(kv), self.v_proj(kv), need_weights=False)
        return self.linear(out)


class _FeedForward(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.linear_in = nn.Linear(width, hidden, bias=False)
        self.act = get_act_fn("gelu_new")
        self.linear_out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_out(self.act(self.linear_in(x)))


class _Projector(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        vision = config.vision_config
        width, heads = int(vision.hidden_size), int(vision.num_attention_heads)
        self.query = nn.Parameter(torch.empty(max(query_table(config).values()), width))
        self.cross_attn = _CrossAttention(width, heads)
        self.layer_norm = nn.LayerNorm(width)
        self.feed_forward = _FeedForward(width, int(config.text_config.hidden_size))

    def forward(self, patches: torch.Tensor, num_queries: int) -> torch.Tensor:
        queries = self.query[:num_queries].expand(patches.shape[0], -1, -1)
        return self.feed_forward(self.layer_norm(self.cross_attn(patches, queries)))


class AriaImageEncoder(nn.Module):
    """Crops -> rows of the text model's input embedding, Q per crop."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.layer = check_config(config)
        self.patch = int(config.vision_config.patch_size)
        self.vision_tower = Tower(config.vision_config)
        self.multi_modal_projector = _Projector(config)

    def forward(self, pixels: torch.Tensor, valid: tuple[int, int]) -> torch.Tensor:
        """pixels [N, 3, S, S] of crops valid on their top-left h x w -> [N, Q, D]."""
        side, p = pixels.shape[-1], self.patch
        rows, cols = (min(math.ceil(x / p), side // p) for x in valid)
        patches = self.vision_tower(pixels[..., : rows * p, : cols * p], [self.layer])[0]
        return self.multi_modal_projector(patches, crop_tokens(self.config, side))

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each crop's rows; crops of one size and valid box run as one batch."""
        weight = self.multi_modal_projector.query
        out: list[torch.Tensor | None] = [None] * len(images)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, m in enumerate(images):
            assert m.pixel_values is not None and m.image_size is not None
            groups.setdefault(tuple(m.image_size), []).append(i)
        for size, group in groups.items():
            pixels = torch.stack([images[i].pixel_values for i in group])  # type: ignore[misc]
            rows = self(pixels.to(weight.device, weight.dtype), (size[1], size[2]))
            for i, r in zip(group, rows, strict=True):
                out[i] = r
        return out  # type: ignore[return-value]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `[model.]vision_tower.*` and `[model.]multi_modal_projector.*`
        tensors (any other name passed over); ValueError naming a missing or unexpected one."""

        def ours(name: str) -> str | None:
            name = name.removeprefix("model.")
            return name if name.startswith(_PREFIXES) else None

        picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)
