"""The image half of the dual-encoder embedding models, CLIP's `CLIPModel` and SigLIP's
`SiglipModel` as vLLM's `CLIPEmbeddingModel` / `SiglipEmbeddingModel` (their text towers:
models/dual_encoder_text.py).

    prompt: text of special tokens only (vLLM's `{"prompt": "", "multi_modal_data":
            {"image": img}}`: the empty text and whatever BOS / EOS the tokenizer adds)
            -> [PLACEHOLDER]                                            (`DualEncoderLayout`)
    image:  the checkpoint's image processor -> pixels [3, S, S] -> the vision tower
            (multimodal/vision_transformer.py) ->
            CLIP:   post_layernorm(CLS row) -> visual_projection       (`CLIPImageEmbedder`)
            SigLIP: post_layernorm(rows) -> the attention-pooling head  (`SiglipImageEmbedder`)
            (HF's get_image_features)

The feature row travels as the placeholder's input embedding: `row_width` columns, the
feature on the left and a flag column last set to 1 (text rows' embeddings leave it 0), so the
model tells image rows from text rows in a mixed step. A prompt is a text or one image: both,
or several images, are refused by name as vLLM refuses them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.models.dual_encoder_text import row_width
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import Layout
from paged_engine.multimodal.vision_transformer import FinalNormTower, VisionMLP


class CLIPImageEmbedder(nn.Module):
    """CLIPModel's `vision_model` and `visual_projection`: one flagged row [1, width] an
    image."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision = config.vision_config
        self.vision_model = FinalNormTower(vision)
        self.projection_dim = int(config.projection_dim)
        self.visual_projection = nn.Linear(vision.hidden_size, self.projection_dim, bias=False)
        self.width = row_width(int(config.text_config.hidden_size), self.projection_dim)

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        weight = self.visual_projection.weight
        pixels = torch.stack([m.pixel_values for m in images]).to(weight.device, weight.dtype)
        tower = self.vision_model
        cls = tower.post_layernorm(tower(pixels, [tower.depth])[0][:, 0])  # [N, D]: CLS rows
        return _flagged(self.visual_projection(cls), self.width)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's vision_model / visual_projection tensors (others passed over);
        ValueError naming a missing or unexpected one."""
        picked = (
            (n, t)
            for n, t in weights
            if n.startswith(("vision_model.", "visual_projection."))
            and not n.endswith(".position_ids")
        )
        return load_named_weights(self, picked)


def _flagged(features: torch.Tensor, width: int) -> list[torch.Tensor]:
    """[N, F] features -> each image's row [1, width]: zero-padded, the image flag last."""
    rows = F.pad(features, (0, width - features.shape[-1]))
    rows[:, -1] = 1.0
    return list(rows[:, None])


class SiglipPoolingHead(nn.Module):
    """SigLIP's `head`: a learned probe attends over the rows (torch's MultiheadAttention, as
    HF builds it), then a residual MLP over its LayerNorm."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        d = config.hidden_size
        self.probe = nn.Parameter(torch.empty(1, 1, d))
        self.attention = nn.MultiheadAttention(d, config.num_attention_heads, batch_first=True)
        self.layernorm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, L, D] -> [N, D]
        probe = self.probe.expand(x.shape[0], -1, -1)
        h = self.attention(probe, x, x, need_weights=False)[0]
        return (h + self.mlp(self.layernorm(h)))[:, 0]


class SiglipImageEmbedder(nn.Module):
    """SiglipModel's `vision_model` with its pooling head: one flagged row [1, width] an
    image, vision_config.hidden_size wide (the text head's projection_size: checked)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision, text = config.vision_config, config.text_config
        if not getattr(vision, "vision_use_head", True):
            raise ValueError(
                "vision_config.vision_use_head=False is not supported: SiglipModel's image "
                "embedding is its pooling head's output"
            )
        feature = int(vision.hidden_size)
        if int(text.projection_size) != feature:
            raise ValueError(
                f"text_config.projection_size={text.projection_size} differs from "
                f"vision_config.hidden_size={feature}: text and image embeddings must share a "
                "width"
            )
        self.vision_model = FinalNormTower(vision)
        self.vision_model.head = SiglipPoolingHead(vision)
        self.width = row_width(int(text.hidden_size), feature)

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        tower = self.vision_model
        weight = tower.head.probe
        pixels = torch.stack([m.pixel_values for m in images]).to(weight.device, weight.dtype)
        return _flagged(tower.head(tower.last(pixels)), self.width)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's vision_model tensors (others passed over); ValueError naming a
        missing or unexpected one."""
        picked = (
            (n, t)
            for n, t in weights
            if n.startswith("vision_model.") and not n.endswith(".position_ids")
        )
        return load_named_weights(self, picked)


class DualEncoderLayout(Layout):
    """One placeholder an image prompt, pixels [3, S, S] at the tower's image_size."""

    takes_embeds = False  # vLLM's image_embeds input: not for a dual encoder

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        # (Layout's own fields are LLaVA's: set here instead)
        self.config = config
        self.placeholder = placeholder
        self.fixed = 1
        self.special = set(getattr(tokenizer, "all_special_ids", None) or ())
        self.side = int(config.vision_config.image_size)
        self.name = config.architectures[0]

    def pixel_shape(self, size: Any) -> tuple[int, ...]:
        return (3, self.side, self.side)

    def segment(self, loaded: Any) -> list[int]:  # (its own: `splice` places it)
        return [self.placeholder]

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """The prompt's special tokens dropped, the one image's placeholder in their place."""
        if len(segments) != 1:
            raise ValueError(
                f"multi_modal_data['image'] has {len(segments)} images: {self.name} embeds "
                "one image a prompt"
            )
        if any(t not in self.special for t in ids):
            raise self._both()
        return [self.placeholder], [0]

    def finish(self, ids: list[int], images: tuple[ImageInput, ...]) -> tuple[ImageInput, ...]:
        """The images of a prompt that is their placeholder alone (a text holding the
        placeholder's own token, with an image, is refused: the text tower would pool it)."""
        if ids != [self.placeholder] or len(images) != 1:
            raise self._both()
        return images

    def _both(self) -> ValueError:
        return ValueError(
            f"prompt: {self.name} embeds a text or an image, not both: give the image with an "
            'empty prompt ("")'
        )
