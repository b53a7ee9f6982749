"""Transformers modeling backend for vision-language checkpoints (vLLM's
`TransformersMultiModalForCausalLM` / `TransformersMultiModalMoEForCausalLM`, and
`TransformersMultiModalEmbeddingModel`: the same text half without its LM head, pooled by the
engine as `runner="pooling"` pools the causal one).

vLLM builds HF's whole `*ForConditionalGeneration` and runs it with its attention swapped. Here
the two halves go where paged's native image path puts them, so the prompt side (placeholder
expansion, pixel values, the prefix cache keyed by each image's hash) is paged's own processor
for the wrapper (multimodal/archs.py) and nothing changes on the engine side:

    the language model   models/multimodal_text.py's text-only config (its MARKER names the
                         wrapper) served by causal.py's backbone: HF's decoder
                         with paged attention; `TransformersMultiModalForCausalLM` below takes
                         the step's input embeddings (token embeddings with image rows in place,
                         worker/image_embeds.py) as HF's `inputs_embeds`
    the image features   `TransformersImageEncoder`: HF's own base model of the wrapper (vision
                         tower, projector; its language model built empty and dropped) and its
                         `get_image_features(pixel_values)`: each image's projected rows, which
                         image_embeds.py splices at the image's placeholders as HF's
                         `masked_scatter` does

Served: the wrappers of `SUPPORTED` (LLaVA with a CLIP, SigLIP or Pixtral tower, Mistral 3, Aya
Vision, Command A Vision, LLaVA-NeXT, LLaVA-OneVision's images, Idefics3, SmolVLM: each image,
tile or view a run of placeholders, decoders with plain 1-D rope), whose HF classes support
custom attention. Per image kind (multimodal/archs.py image_kind) the encoder calls HF's
`get_image_features` as HF's own forward does:

    llava, aya_vision,   one call on the stacked views; a row block a view
      cohere2_vision
    pixtral              one call an image, with its `image_sizes`
    llava_next           one call on every image's views (base view, then tiles), with their
                         `image_sizes`: HF's `pack_image_features` unpads the tile map, scales
                         it down (OneVision's anyres_max) and appends `image_newline` to each
                         row, so a packed image is paged's AnyRes.tokens rows; OneVision's
                         one-view images (those of a prompt holding several) go in a call of
                         their own marked by `batch_num_images`, a view and a newline each
    idefics3             one call, a tile a batch row: the tower (its patch mask all ones:
                         tiles are full squares, as HF's processor makes them), the
                         connector's pixel shuffle and projection: a row block a tile

Refused by name at engine start: M-RoPE wrappers (Qwen2-VL and its kin: positions come from
the image grid), Gemma 3 (its images attend bidirectionally), and every other wrapper (another
image path than HF's `get_image_features` on paged's pixels, audio); videos on OneVision are
refused by paged's input processor, which has no OneVision video path (multimodal/video_archs.py);
a tower paged's processor for the wrapper does not take is refused when the encoder is built;
sequence classifiers of these checkpoints are refused by pooling.py.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from paged_engine.models.multimodal_text import MARKER
from paged_engine.models.transformers_backend.causal import TransformersForCausalLM
from paged_engine.models.transformers_backend.pooling import TransformersEmbeddingModel
from paged_engine.models.transformers_backend.selection import _refuse
from paged_engine.models.utils import default_weight_loader
from paged_engine.multimodal.inputs import ImageInput

# vLLM's architecture names for this backend on a vision-language checkpoint (the embedding
# one pools: TransformersMultiModalEmbeddingModel below)
VLLM_NAMES = (
    "TransformersMultiModalForCausalLM",
    "TransformersMultiModalMoEForCausalLM",
    "TransformersMultiModalEmbeddingModel",
)
# wrapper -> paged's image kinds it runs (multimodal/archs.py image_kind; module doc)
SUPPORTED: dict[str, tuple[str, ...]] = {
    "LlavaForConditionalGeneration": ("llava", "pixtral"),
    "AyaVisionForConditionalGeneration": ("aya_vision",),
    "Cohere2VisionForConditionalGeneration": ("cohere2_vision",),
    "Mistral3ForConditionalGeneration": ("pixtral",),
    "LlavaNextForConditionalGeneration": ("llava_next",),
    "LlavaOnevisionForConditionalGeneration": ("llava_next",),
    "Idefics3ForConditionalGeneration": ("idefics3",),
    "SmolVLMForConditionalGeneration": ("idefics3",),
}
_ONEVISION = "LlavaOnevisionForConditionalGeneration"
# the attribute of HF's base model holding its language model (Idefics3 / SmolVLM: text_model)
_TEXT_ATTRS = ("language_model", "text_model")
_WHY: dict[str, str] = {
    **dict.fromkeys(
        (
            "Qwen2VLForConditionalGeneration",
            "Qwen2_5_VLForConditionalGeneration",
            "Qwen3VLForConditionalGeneration",
            "Qwen3VLMoeForConditionalGeneration",
            "Glm4vForConditionalGeneration",
            "Glm4vMoeForConditionalGeneration",
        ),
        "M-RoPE positions (3-D, from the image grid) are not supported",
    ),
    "Gemma3ForConditionalGeneration": "its images attend bidirectionally (token_type_ids), "
    "which paged's causal attention cannot do",
}


def check_multimodal(hf_config) -> None:
    """ValueError naming the wrapper unless this backend serves it (`hf_config`: the text-only
    config models/multimodal_text.py derived from the wrapper)."""
    wrapper = getattr(hf_config, MARKER, None)
    if wrapper in SUPPORTED:
        return
    why = _WHY.get(wrapper, "only " + ", ".join(sorted(SUPPORTED)) + " run on this backend")
    raise _refuse(f"vision-language architecture {wrapper}: {why}")


class TransformersMultiModalForCausalLM(TransformersForCausalLM):
    """The text half: HF's decoder on the step's input embeddings where images run."""

    takes_embeddings = True  # token embeddings with image rows (worker/image_embeds.py)


class TransformersMultiModalEmbeddingModel(
    TransformersEmbeddingModel, TransformersMultiModalForCausalLM
):
    """vLLM's name for embeddings of a vision-language checkpoint: the text half without its LM
    head (pooling.py's embedding model), pooled by the engine (the final normed hidden state at
    the last token, normalized, unless `pooler_config` says otherwise), images spliced in as
    for generation."""


def _empty_text(config):
    """`config` with its language model shrunk to nothing (no layers, one-token vocab): the
    wrapper's base model builds it, the encoder never runs it."""
    stub = copy.deepcopy(config)
    text = stub.get_text_config()
    text.num_hidden_layers = 0
    if getattr(text, "layer_types", None) is not None:
        text.layer_types = []
    text.vocab_size = 1
    text.pad_token_id = None
    return stub


class TransformersImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding, by HF's `get_image_features` (the
    `encode` / `load_weights` contract of multimodal/archs.py's encoders)."""

    def __init__(self, config) -> None:  # the wrapper's config (config.json as HF reads it)
        from transformers import AutoModel

        from paged_engine.multimodal.archs import image_kind

        super().__init__()
        wrapper = next((a for a in config.architectures or () if a in SUPPORTED), None)
        if wrapper is None:
            raise _refuse(f"architectures {config.architectures}: no Transformers image path")
        kind = image_kind(config)
        if kind not in SUPPORTED[wrapper]:
            tower = getattr(config.vision_config, "model_type", None)
            raise _refuse(f"{wrapper} with vision_config.model_type={tower!r} is not supported")
        self.kind, self.onevision = kind, wrapper == _ONEVISION
        base = AutoModel.from_config(_empty_text(config), dtype=torch.get_default_dtype())
        attr = next((a for a in _TEXT_ATTRS if isinstance(getattr(base, a, None), nn.Module)), None)
        if attr is None:
            raise _refuse(f"{type(base).__name__} has no {_TEXT_ATTRS} to leave to the engine")
        setattr(base, attr, None)  # the engine's decoder serves the text
        self.base = base

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each image's feature rows [L, D] from its pixel values: [3, H, W] (one size for all,
        in one call; a Pixtral tower's: one call an image, with its size) or LLaVA-NeXT's
        [views, 3, S, S]."""
        param = next(self.base.parameters())
        pixels = [m.pixel_values.to(param.device, param.dtype) for m in images]
        if self.kind == "llava_next":
            return self._anyres(pixels, [m.image_size for m in images])
        if self.kind == "idefics3":
            return self._tiles(torch.stack(pixels))
        if self.kind != "pixtral":
            out = self.base.get_image_features(pixel_values=torch.stack(pixels), return_dict=True)
            return [f.reshape(-1, f.shape[-1]) for f in out.pooler_output]
        rows = []
        for x in pixels:
            sizes = torch.tensor([x.shape[1:]], device=param.device)  # [1, 2]: (H, W)
            out = self.base.get_image_features(
                pixel_values=x[None], image_sizes=sizes, return_dict=True
            )
            rows.append(out.pooler_output[0])
        return rows

    def _anyres(self, pixels: list[torch.Tensor], sizes: list) -> list[torch.Tensor]:
        """LLaVA-NeXT / OneVision: HF's tower, projector and packing on each image's views
        [views, 3, S, S] with its (h, w); [p * p + h' * (w' + 1), D] an image (module doc)."""
        rows: list[torch.Tensor | None] = [None] * len(pixels)
        tiled = [i for i, x in enumerate(pixels) if x.shape[0] > 1]
        alone = [i for i, x in enumerate(pixels) if x.shape[0] == 1]
        if any(sizes[i] is None for i in tiled):
            raise ValueError("a LLaVA-NeXT image needs its image_size (h, w)")
        # a one-view image's size is not read (nothing to unpad): its view's stands in
        sizes = [s or tuple(x.shape[-2:]) for s, x in zip(sizes, pixels, strict=True)]
        if alone and not self.onevision:
            raise ValueError("a LLaVA-NeXT image has a base view and tiles, got one view")
        if tiled:
            self._pack(rows, pixels, sizes, tiled, [1] * len(tiled))
        if alone:  # OneVision: HF gives each image of a prompt holding n > 1 one view and a
            # newline; a lone one goes with a copy of itself, whose rows are dropped
            group = alone + alone[:1] * (len(alone) == 1)
            self._pack(rows, pixels, sizes, group, [len(group)])
        return rows  # type: ignore[return-value]

    def _pack(
        self, rows: list, pixels: list, sizes: list, group: list[int], counts: list[int]
    ) -> None:
        """rows[i] for i in `group` from one get_image_features call; `counts`: HF's
        batch_num_images (images a prompt: 1 tiles an image, n > 1 gives each one view)."""
        kwargs = {"batch_num_images": torch.tensor(counts)} if self.onevision else {}
        out = self.base.get_image_features(
            pixel_values=torch.cat([pixels[i] for i in group]),  # [sum views, 3, S, S]
            image_sizes=torch.tensor([list(sizes[i]) for i in group], device=pixels[0].device),
            return_dict=True,
            **kwargs,
        )
        for i, f in zip(group, out.pooler_output, strict=False):  # (a copy's rows dropped)
            rows[i] = f

    def _tiles(self, pixels: torch.Tensor) -> list[torch.Tensor]:  # [N, 3, S, S] -> N x [n, D]
        """Idefics3 / SmolVLM: a tile a batch row of one image, so HF's patch mask is all ones
        and its pooled output a tile's rows; HF drops an all-zero tile as batch padding."""
        out = self.base.get_image_features(pixel_values=pixels[:, None], return_dict=True)
        rows = list(out.pooler_output)
        if len(rows) != pixels.shape[0] or any(f.shape[0] == 0 for f in rows):
            raise ValueError("pixel_values: an all-zero tile, which HF drops as padding")
        return rows

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's tower and projector tensors (and LLaVA-NeXT's `image_newline`) by
        HF name (`model.X` as transformers 5 saves them, or `X` as older saves do); the
        language model's are passed over. ValueError naming a missing tensor or one of the
        wrong shape."""
        params = dict(self.base.named_parameters())
        ours = {n.split(".")[0] for n in params}  # the base's modules but the emptied text
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.split(".")[0] not in ours:
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"{type(self).__name__}: unexpected weight {name!r}")
            try:
                default_weight_loader(param, tensor)  # the shape checked, then copied
            except ValueError as e:
                raise ValueError(f"{type(self).__name__}: weight {name!r}: {e}") from e
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"{type(self).__name__}: missing weights {missing[:8]}")
        return loaded


__all__ = [
    "SUPPORTED",
    "VLLM_NAMES",
    "TransformersImageEncoder",
    "TransformersMultiModalEmbeddingModel",
    "TransformersMultiModalForCausalLM",
    "check_multimodal",
]
