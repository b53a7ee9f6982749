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
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from paged_engine.multimodal import internvl
from paged_engine.multimodal.internvl import InternVLImageEncoder
from paged_engine.multimodal.layouts import splice_at_text
from paged_engine.multimodal.layouts_single_run import BoundedLayout

MARKER = "<image>"  # QianfanOCRProcessor's image_placeholder_token
_LAYERS = "vision_tower.layers."
_VISION_TYPE = "qianfan_ocr_vision"


def hub_vit_names(layers: tuple[str, str]) -> tuple[tuple[re.Pattern[str], str], ...]:
    """The Hub's InternVL-Chat tower and projector names -> transformers', applied in order;
    `layers` is (pattern, replacement): where the port keeps the encoder layers."""
    rows = (
        (r"^vision_model\.", "vision_tower."),
        (r"^mlp1\.0\.", "multi_modal_projector.layer_norm."),
        (r"^mlp1\.1\.", "multi_modal_projector.linear_1."),
        (r"^mlp1\.3\.", "multi_modal_projector.linear_2."),
        layers,
        (r"\.ls([12])$", r".lambda_\1"),
        (r"\.attn\.proj\.", ".attention.projection_layer."),
        (r"\.attn\.", ".attention."),
        (r"\.norm1\.", ".layernorm_before."),
        (r"\.norm2\.", ".layernorm_after."),
        (r"\.embeddings\.class_embedding$", ".embeddings.cls_token"),
        (r"\.embeddings\.position_embedding$", ".embeddings.position_embeddings"),
        (r"\.embeddings\.patch_embedding\.", ".embeddings.patch_embeddings.projection."),
    )
    return tuple((re.compile(pattern), repl) for pattern, repl in rows)


# the Hub's InternVL-Chat names -> transformers' (its conversion_mapping's "qianfan_ocr" rows),
# applied in order to every name (load_weights keeps the tower and projector ones)
_HUB_NAMES = hub_vit_names((r"encoder\.layers\.", "layers."))


def split_hub_names(
    weights: Iterable[tuple[str, torch.Tensor]], names: Sequence[tuple[re.Pattern[str], str]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """InternViT weights from the Hub's InternVL-Chat names into transformers': each name
    rewritten by every (pattern, replacement) of `names` in order, then a fused
    `attention.qkv` split in three (its q, k, v rows). Shared with internvl_chat.py."""
    for name, tensor in weights:
        for pattern, repl in names:
            name = pattern.sub(repl, name)
        head, _, leaf = name.rpartition(".attention.qkv.")
        if head:
            for part, chunk in zip("qkv", tensor.chunk(3, dim=0), strict=True):
                yield f"{head}.attention.{part}_proj.{leaf}", chunk
        else:
            yield name, tensor


def _hf_names(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Tower and projector weights in transformers' names (`model.` dropped), from either the
    Hub's names or transformers' own."""
    return split_hub_names(((n.removeprefix("model."), t) for n, t in weights), _HUB_NAMES)


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

    vision_type = _VISION_TYPE

    def build_tower(self, config, layer: int) -> nn.Module:
        """The tower up to hidden state `layer`; hidden_states[num_hidden_layers] is
        last_hidden_state in HF (tied): after `layernorm`."""
        vision = config.vision_config
        final_norm = layer == int(vision.num_hidden_layers) and not vision.use_mean_pooling
        return _QianfanTower(vision, layer, final_norm, self.side)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's tower and projector tensors, in the Hub's names (`vision_model.*`,
        `mlp1.*`) or transformers' (`[model.]vision_tower.*`, `[model.]multi_modal_projector.*`;
        the layers after the one read, an unused `layernorm` and
        `mask_token` passed over); ValueError naming a missing or unexpected one."""
        return self._load_tower(_hf_names(weights), _LAYERS, len(self.vision_tower.layers))


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
        return splice_at_text(self.tokenizer, ids, segments, MARKER, ", and no <IMG_CONTEXT>")
