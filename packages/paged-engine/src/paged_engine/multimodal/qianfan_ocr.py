"""The image encoder of QianfanOCRForConditionalGeneration (Qianfan-OCR in HF's form).

Qianfan-OCR is InternVL's wrapper (multimodal/internvl.py) around a Qwen3 decoder, with the
same host side (GotOcr2 tiles: a grid and, for more than one, a thumbnail; <img>, one run of
<IMG_CONTEXT> per tile, </img>: layouts_single_run.BoundedLayout), the same tower layer
(layer scale, LayerNorm / RMSNorm, optional q / k norm), pixel shuffle and projector. What
differs from InternVL:

    weight names   vision_tower.layers.{i}.*      (InternVL: vision_tower.encoder.layer.{i}.*)
    layer read     hidden_states[vision_feature_layer] where the last entry IS
                   last_hidden_state (HF ties it), so with use_mean_pooling False the tower's
                   `layernorm` runs for -1 and for num_hidden_layers alike (InternVL: -1 only)
    drop_path      stochastic depth, identity at inference (not built)

Prompt: an image is marked by the config's image_token_id (<IMG_CONTEXT>, InternVL's form) or,
in a prompt without that token, by "<image>" in its text (QianfanOCRProcessor's
image_placeholder_token, what its chat template writes); either becomes <img>, a run of
<IMG_CONTEXT> per tile, </img> (`QianfanLayout`). HF's expanded ids are taken as they are.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal import internvl
from paged_engine.multimodal.internvl import InternVLImageEncoder
from paged_engine.multimodal.layouts_single_run import BoundedLayout

MARKER = "<image>"  # QianfanOCRProcessor's image_placeholder_token
_LAYERS = "vision_tower.layers."
_VISION_TYPE = "qianfan_ocr_vision"
# the Hub's InternVL-Chat names -> transformers' (its conversion_mapping's "qianfan_ocr" rows),
# applied in order to every name (load_weights keeps the tower and projector ones)
_HUB_NAMES = (
    (re.compile(r"^vision_model\."), "vision_tower."),
    (re.compile(r"^mlp1\.0\."), "multi_modal_projector.layer_norm."),
    (re.compile(r"^mlp1\.1\."), "multi_modal_projector.linear_1."),
    (re.compile(r"^mlp1\.3\."), "multi_modal_projector.linear_2."),
    (re.compile(r"encoder\.layers\."), "layers."),
    (re.compile(r"\.ls1$"), ".lambda_1"),
    (re.compile(r"\.ls2$"), ".lambda_2"),
    (re.compile(r"\.attn\.proj\."), ".attention.projection_layer."),
    (re.compile(r"\.attn\."), ".attention."),
    (re.compile(r"\.norm1\."), ".layernorm_before."),
    (re.compile(r"\.norm2\."), ".layernorm_after."),
    (re.compile(r"\.embeddings\.class_embedding$"), ".embeddings.cls_token"),
    (re.compile(r"\.embeddings\.position_embedding$"), ".embeddings.position_embeddings"),
    (re.compile(r"\.embeddings\.patch_embedding\."), ".embeddings.patch_embeddings.projection."),
)


def _hf_names(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Tower and projector weights in transformers' names (`model.` dropped), from either the
    Hub's names or transformers' own; a fused `attention.qkv` split in three (q, k, v rows)."""
    for name, tensor in weights:
        name = name.removeprefix("model.")
        for pattern, repl in _HUB_NAMES:
            name = pattern.sub(repl, name)
        head, _, leaf = name.rpartition(".attention.qkv.")
        if head:
            for part, chunk in zip("qkv", tensor.chunk(3, dim=0), strict=True):
                yield f"{head}.attention.{part}_proj.{leaf}", chunk
        else:
            yield name, tensor


class _QianfanTower(nn.Module):
    """HF's QianfanOCRVisionModel up to the hidden state read (its weight names kept)."""

    def __init__(self, vision, num_layers: int, final_norm: bool, side: int) -> None:
        super().__init__()
        patch = internvl._square(vision, "patch_size")
        self.embeddings = internvl._Embeddings(vision, side, patch)
        self.layers = nn.ModuleList(internvl._Layer(vision) for _ in range(num_layers))
        # `layernorm` (always a LayerNorm) is Identity in HF under use_mean_pooling
        self.layernorm = (
            nn.LayerNorm(vision.hidden_size, eps=vision.layer_norm_eps) if final_norm else None
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [T, C, S, S] -> [T, 1 + L, D]
        x = self.embeddings(pixels)
        for layer in self.layers:
            x = layer(x)
        return x if self.layernorm is None else self.layernorm(x)


class QianfanOCRImageEncoder(InternVLImageEncoder):
    """Images (each its tiles) -> rows of the text model's input embedding, one a placeholder;
    InternVL's forward and encode over Qianfan-OCR's tower."""

    def __init__(self, config) -> None:
        nn.Module.__init__(self)  # InternVL's __init__ would build (and check for) its own tower
        vision = config.vision_config
        model_type = getattr(vision, "model_type", None)
        if model_type != _VISION_TYPE:
            raise ValueError(
                f"vision_config.model_type={model_type!r} is not supported: {_VISION_TYPE!r}"
            )
        if vision.norm_type not in internvl._NORMS:
            raise ValueError(
                f"vision_config.norm_type={vision.norm_type!r} is not supported: {internvl._NORMS}"
            )
        strategy = config.vision_feature_select_strategy
        if strategy != "default":  # HF's square reshape fails with the CLS token kept
            raise ValueError(
                f"vision_feature_select_strategy={strategy!r} is not supported: 'default'"
            )
        self.side, self.scale = internvl._grid(config)
        self.image_size = internvl._square(vision, "image_size")
        self.num_channels = int(vision.num_channels)
        layer = internvl.feature_layer(config)
        total = int(vision.num_hidden_layers)
        # hidden_states[total] is last_hidden_state in HF (tied): after `layernorm`
        final_norm = layer == total and not vision.use_mean_pooling
        self.vision_tower = _QianfanTower(vision, layer, final_norm, self.side)
        width = int(vision.hidden_size) * self.scale**2
        self.multi_modal_projector = internvl._Projector(config, width)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's tower and projector tensors, in the Hub's names (`vision_model.*`,
        `mlp1.*`) or transformers' (`[model.]vision_tower.*`, `[model.]multi_modal_projector.*`;
        the layers after the one read, an unused `layernorm` and
        `mask_token` passed over); ValueError naming a missing or unexpected one."""
        built = len(self.vision_tower.layers)
        has_norm = self.vision_tower.layernorm is not None

        def ours(name: str) -> str | None:
            if not name.startswith(("vision_tower.", "multi_modal_projector.")):
                return None
            if name == "vision_tower.embeddings.mask_token":
                return None  # masked image modelling only
            if name.startswith("vision_tower.layernorm.") and not has_norm:
                return None
            index = name[len(_LAYERS) :].split(".")[0] if name.startswith(_LAYERS) else ""
            if index.isdigit() and int(index) >= built:
                return None  # after the layer read
            return name

        named = ((ours(n), t) for n, t in _hf_names(weights))
        picked = ((n, t) for n, t in named if n is not None)
        return load_named_weights(self, picked)


class QianfanLayout(BoundedLayout):
    """InternVL's tiles and <img> run </img>; a prompt without a lone <IMG_CONTEXT> may mark its
    images with "<image>" in its text, each replaced by its segment (the text between them
    tokenized piece by piece: the segments begin and end with special tokens, so HF's
    tokenization of the replaced text splits there too)."""

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        super().__init__(config, placeholder, tokenizer)
        self.tokenizer = tokenizer

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        if self.placeholder in ids or self.tokenizer is None:
            return super().splice(ids, segments)
        tok = self.tokenizer
        text = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        pieces = text.split(MARKER)
        if len(pieces) != len(segments) + 1:
            raise ValueError(
                f"multi_modal_data['image'] has {len(segments)} image(s) but the prompt has "
                f"{len(pieces) - 1} {MARKER} placeholder(s) (and no <IMG_CONTEXT>): put one "
                "per image where it belongs"
            )
        out, starts = tok.encode(pieces[0], add_special_tokens=False), []
        for segment, piece in zip(segments, pieces[1:], strict=True):
            starts.append(len(out))
            out += [*segment, *tok.encode(piece, add_special_tokens=False)]
        return out, starts
