"""CLIP (`CLIPModel`, openai/clip-vit-*) and SigLIP (`SiglipModel`, google/siglip-*) served as
multimodal embedding models, as vLLM's `CLIPEmbeddingModel` / `SiglipEmbeddingModel`: a text
prompt embeds to the text tower's projected feature, an image prompt to the vision tower's
(multimodal/dual_encoder.py), L2-normalized by the pooler. This file holds the text towers:

    ids -> token + position embedding -> layers (CLIP: causal; SigLIP: bidirectional)
        -> final_layer_norm -> CLIP: text_projection / SigLIP: text_model.head     (every row)

pooled as vLLM pools them: CLIP at the LAST token (the EOS its tokenizer appends; HF's
get_text_features pools the first EOS), SigLIP by CLS over rows vLLM flips within each
sequence (so the last token, HF's `last_hidden_state[:, -1]`, comes first).

The checkpoint's config is read through models/text_wrappers.py ("CLIPModel" / "SiglipModel"
-> these classes on a copy of text_config; CLIP's `projection_dim` carried), so the engine sees
an encoder (engine/encoder.py: one step a sequence, no KV cache). An image prompt is one
placeholder token (`PLACEHOLDER`) whose feature row the image path computes
(multimodal/archs.py kind "dual_encoder"); the row rides in the step's input embeddings,
`row_width` wide: the text embedding (or the image feature) on the left and a flag column last,
1 on image rows. The model passes image rows through and runs the text tower on the rest; a
sequence is all text or one image.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.attention import AttentionMetadata
from paged_engine.models.bert import EncoderShell, sequence_bounds
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.vision_transformer import VisionAttention, VisionLayer

PLACEHOLDER = 0  # the image token id (vLLM's CLIP's; never embedded as text)


def row_width(text_hidden: int, feature_dim: int) -> int:
    """Columns of a step's input embeddings: the wider of text embedding and feature, then
    the image flag."""
    return max(text_hidden, feature_dim) + 1


class TextAttention(VisionAttention):
    """Each token over its own sequence (CLIP: itself and earlier tokens only)."""

    def __init__(self, hidden: int, num_heads: int, causal: bool) -> None:
        super().__init__(hidden, num_heads)
        self.causal = causal

    def forward(self, x: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:  # [T, D]
        t = x.shape[0]
        q, k, v = (
            p(x).view(t, self.num_heads, self.head_dim).transpose(0, 1)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )  # [heads, T, d]
        out = torch.zeros_like(q)  # rows past the last sequence: padding
        for lo, hi in bounds:
            out[:, lo:hi] = F.scaled_dot_product_attention(
                q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], is_causal=self.causal
            )
        return self.out_proj(out.transpose(0, 1).reshape(t, -1))


class TextLayer(VisionLayer):
    """The towers' pre-norm layer (HF's names: layer_norm1, self_attn, layer_norm2, mlp)."""

    def __init__(self, config: Any, causal: bool) -> None:
        super().__init__(config)
        self.self_attn = TextAttention(config.hidden_size, config.num_attention_heads, causal)

    def forward(self, x: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), bounds)
        return x + self.mlp(self.layer_norm2(x))


class TextEmbeddings(nn.Module):
    def __init__(self, config: Any, width: int) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.width = width

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, width]: the token embedding, zero-padded (flag column 0: text)."""
        x = self.token_embedding(input_ids)
        return F.pad(x, (0, self.width - x.shape[-1]))


class TextEncoder(nn.Module):
    def __init__(self, config: Any, causal: bool) -> None:
        super().__init__()
        n = int(config.num_hidden_layers)
        self.layers = nn.ModuleList(TextLayer(config, causal) for _ in range(n))


class TextTransformer(nn.Module):
    """`text_model` (SigLIP's with its `head`: the projection)."""

    def __init__(self, config: Any, causal: bool, width: int, head: int | None) -> None:
        super().__init__()
        self.embeddings = TextEmbeddings(config, width)
        self.encoder = TextEncoder(config, causal)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        if head is not None:
            self.head = nn.Linear(config.hidden_size, head)


class DualEncoderText(EncoderShell):
    """A text tower and its projection, passing the image rows of a step through."""

    prefix: ClassVar[str] = ""
    embed_path: ClassVar[str] = "text_model.embeddings.token_embedding"
    causal: ClassVar[bool]
    flipped: ClassVar[bool] = False  # each sequence's rows reversed (vLLM's SigLIP)

    def __init__(self, config: Any, feature_dim: int, head: bool) -> None:
        super().__init__(config)
        self.hidden = int(config.hidden_size)
        self.feature_dim = feature_dim
        width = row_width(self.hidden, feature_dim)
        self.text_model = TextTransformer(config, self.causal, width, feature_dim if head else None)

    def project(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, feature_dim]
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list,
        attn_metadata: AttentionMetadata,
        embeds: torch.Tensor | None = None,  # [T, width]: images' rows flagged in the last column
    ) -> torch.Tensor:  # [T, feature_dim]
        bounds = sequence_bounds(attn_metadata)
        emb = self.text_model.embeddings
        x = emb.token_embedding(input_ids) if embeds is None else embeds[:, : self.hidden]
        x = x + emb.position_embedding(positions)
        for layer in self.text_model.encoder.layers:
            x = layer(x, bounds)
        out = self.project(self.text_model.final_layer_norm(x))
        if self.flipped:
            out = out.clone()
            for lo, hi in bounds:
                out[lo:hi] = out[lo:hi].flip(0)
        if embeds is None:
            return out
        image = embeds[:, -1:] > 0  # [T, 1]; an image sequence is its one row: no flip to undo
        return torch.where(image, embeds[:, : self.feature_dim], out)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        # the wrapper's vision weights and logit scale / bias never reach here (text_wrappers)
        return load_named_weights(
            self, weights, skip=lambda n: n.endswith(".position_ids"), strict=strict
        )


class CLIPEmbeddingModel(DualEncoderText):
    """CLIPModel's text tower and text_projection (`projection_dim` wide)."""

    causal = True
    # vLLM's @default_pooling_type("LAST"): the EOS token closes every CLIP text prompt
    default_pooler_config: ClassVar[dict] = {"pooling_type": "LAST", "normalize": True}

    def __init__(self, config: Any) -> None:
        if getattr(config, "projection_dim", None) is None:
            raise ValueError("projection_dim is required (CLIPConfig's, carried to the text model)")
        super().__init__(config, int(config.projection_dim), head=False)
        self.text_projection = nn.Linear(self.hidden, self.feature_dim, bias=False)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.text_projection(x)

    @staticmethod
    def pooled_width(config: Any) -> int:
        """The embedding's width (engine/llm_engine.py: `dimensions`), not the text hidden."""
        return int(config.projection_dim)


class SiglipEmbeddingModel(DualEncoderText):
    """SiglipModel's text tower and its head (text_config.projection_size wide)."""

    causal = False
    flipped = True
    # vLLM's @default_pooling_type("CLS") over its flipped rows: the last token
    default_pooler_config: ClassVar[dict] = {"pooling_type": "CLS", "normalize": True}

    def __init__(self, config: Any) -> None:
        super().__init__(config, int(config.projection_size), head=True)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.text_model.head(x)

    @staticmethod
    def pooled_width(config: Any) -> int:
        """The embedding's width (engine/llm_engine.py: `dimensions`), not the text hidden."""
        return int(config.projection_size)
