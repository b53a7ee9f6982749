"""Idefics2's image path (Idefics2ForConditionalGeneration): SigLIP at the image's own size, a
gated MLP into the text width, then a perceiver resampler to a fixed number of rows.

    image -> the checkpoint's image processor: resized (shortest / longest edge), with
        do_image_splitting also cut in 4 crops (the crops, then the whole image); each view's
        pixels [3, h, w] (the processor's padding cut off: `pixel_attention_mask`)
    each view -> SigLIP-style tower at h / p x w / p patches (every layer, post_layernorm):
        position ids bucket the patch grid's fractions (row / rows, col / cols) into the
        side x side table of image_size / patch_size, as transformers' Idefics2 embeddings do
        -> connector.modality_projection: down(act(gate(x)) * up(x)) into the text width
        -> connector.perceiver_resampler: n learned latents; each of `resampler_depth` layers
           latents += attn(q = norm(latents), k / v = [norm(context); norm(latents)])
           latents += mlp(norm(latents))      (RMSNorms; GQA heads; scale head_dim^-0.5)
           then a final RMSNorm -> n = resampler_n_latents rows
    prompt (Idefics2Processor, on the text): each <image> becomes
        <fake_token_around_image> <image> x n <fake_token_around_image>   (x 5 when split)
        then "<fake><fake>" -> "<fake>" and a space after a <fake> followed by a character
        other than whitespace or "<" (layouts_tiles.py Idefics2Layout runs it on the whole prompt)

A view is one `ImageInput` (image_size = its (h, w)), so views of one image are apart as
Idefics3's tiles are. A view is run alone at its size: transformers pads the views of a batch
to one size and masks the padding out of both attentions, which leaves each view's rows as
they are alone. Only the tower's self-attention and the resampler's cross-attention see
the view, so nothing is masked here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.norm import RMSNorm
from paged_engine.multimodal.idefics3 import TowerConnectorEncoder
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.vision_transformer import FinalNormTower, VisionEmbeddings

ARCH = "Idefics2ForConditionalGeneration"
FAKE, IMAGE = "<fake_token_around_image>", "<image>"
_CLOSING_FAKE = re.compile(rf"{re.escape(FAKE)}(?=[^\s<])")


def image_tokens(config: Any) -> int:
    """n: placeholders (= resampler latents) of one view."""
    return int(config.perceiver_config.resampler_n_latents)


def prompt_text(text: str, marks: int, views: list[int], n: int) -> str:
    """`text` with its `marks` <image>s replaced as Idefics2Processor does (image i by
    views[i] runs), then its "<fake><fake>" merge and space after a closing <fake>."""
    pieces = text.split(IMAGE)
    assert len(pieces) == marks + 1 == len(views) + 1
    runs = [FAKE + (IMAGE * n + FAKE) * k for k in views]
    out = "".join(p for piece, run in zip(pieces, runs) for p in (piece, run)) + pieces[-1]
    return _CLOSING_FAKE.sub(f"{FAKE} ", out.replace(FAKE + FAKE, FAKE))


def bucketed_position_ids(rows: int, cols: int, side: int) -> torch.Tensor:
    """Idefics2's ids of a rows x cols patch grid in a side x side table, as transformers
    computes them (float32 fractions, bucketized by an arange of boundaries)."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    h = torch.arange(rows, dtype=torch.float32) * (1.0 / torch.tensor(rows))
    w = torch.arange(cols, dtype=torch.float32) * (1.0 / torch.tensor(cols))
    bucket_h = torch.bucketize(h.clamp(max=1.0 - 1e-6), boundaries, right=True)
    bucket_w = torch.bucketize(w.clamp(max=1.0 - 1e-6), boundaries, right=True)
    return (bucket_h[:, None] * side + bucket_w[None, :]).flatten()


class _Embeddings(VisionEmbeddings):
    """SigLIP's patch and position embeddings for a view of any size (ids by its grid)."""

    def __init__(self, vision: Any) -> None:
        super().__init__(vision, has_cls=False)
        self.patch = int(vision.patch_size)
        self.side = int(vision.image_size) // self.patch

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, h, w] -> [N, L, D]
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        rows, cols = x.shape[-2:]
        ids = bucketed_position_ids(rows, cols, self.side).to(x.device)
        return x.flatten(2).transpose(1, 2) + self.position_embedding(ids)


class Tower(FinalNormTower):
    """Idefics2's `vision_model` (SigLIP's weight names), embeddings by the view's grid."""

    def __init__(self, vision: Any) -> None:
        super().__init__(vision)
        self.embeddings = _Embeddings(vision)


class GatedMLP(nn.Module):
    def __init__(self, width: int, inner: int, out: int, act: str, where: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, inner, bias=False)
        self.up_proj = nn.Linear(width, inner, bias=False)
        self.down_proj = nn.Linear(inner, out, bias=False)
        self.act = get_act_fn(act, where)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _CrossAttention(nn.Module):
    def __init__(self, perceiver: Any) -> None:
        super().__init__()
        width, heads = int(perceiver.hidden_size), int(perceiver.resampler_n_heads)
        self.heads, self.kv_heads = heads, int(perceiver.num_key_value_heads)
        self.head_dim = int(perceiver.resampler_head_dim)
        if heads % self.kv_heads:
            raise ValueError(
                f"perceiver_config.resampler_n_heads={heads} is not a multiple of "
                f"perceiver_config.num_key_value_heads={self.kv_heads}"
            )
        self.q_proj = nn.Linear(width, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, width, bias=False)

    def forward(self, latents: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        n, q_len, _ = latents.shape
        both = torch.cat([context, latents], dim=1)  # keys: the view's rows, then the latents
        q = self.q_proj(latents).view(n, q_len, self.heads, self.head_dim).transpose(1, 2)
        k, v = (
            p(both).view(n, both.shape[1], self.kv_heads, self.head_dim).transpose(1, 2)
            for p in (self.k_proj, self.v_proj)
        )
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v)  # no mask: every key is the view's
        return self.o_proj(out.transpose(1, 2).reshape(n, q_len, -1))


class _PerceiverLayer(nn.Module):
    def __init__(self, perceiver: Any) -> None:
        super().__init__()
        width, eps = int(perceiver.hidden_size), float(perceiver.rms_norm_eps)
        self.input_latents_norm = RMSNorm(width, eps)
        self.input_context_norm = RMSNorm(width, eps)
        self.self_attn = _CrossAttention(perceiver)
        self.post_attention_layernorm = RMSNorm(width, eps)
        act = perceiver.hidden_act
        self.mlp = GatedMLP(width, 4 * width, width, act, "perceiver_config.hidden_act")

    def forward(self, latents: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        context = self.input_context_norm(context)
        latents = latents + self.self_attn(self.input_latents_norm(latents), context)
        return latents + self.mlp(self.post_attention_layernorm(latents))


class _Resampler(nn.Module):
    def __init__(self, perceiver: Any) -> None:
        super().__init__()
        width = int(perceiver.hidden_size)
        self.latents = nn.Parameter(torch.ones(int(perceiver.resampler_n_latents), width))
        depth = int(perceiver.resampler_depth)
        self.layers = nn.ModuleList(_PerceiverLayer(perceiver) for _ in range(depth))
        self.norm = RMSNorm(width, float(perceiver.rms_norm_eps))

    def forward(self, context: torch.Tensor) -> torch.Tensor:  # [N, L, D] -> [N, n, D]
        latents = self.latents.expand(context.shape[0], -1, -1)
        for layer in self.layers:
            latents = layer(latents, context)
        return self.norm(latents)


class _Connector(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        text, perceiver = config.text_config, config.perceiver_config
        if int(perceiver.hidden_size) != int(text.hidden_size):
            raise ValueError(
                f"perceiver_config.hidden_size={perceiver.hidden_size} is not the text "
                f"hidden_size {text.hidden_size}"
            )
        self.modality_projection = GatedMLP(
            int(config.vision_config.hidden_size),
            int(text.intermediate_size),
            int(text.hidden_size),
            text.hidden_act,
            "text_config.hidden_act",
        )
        self.perceiver_resampler = _Resampler(perceiver)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.perceiver_resampler(self.modality_projection(x))


class Idefics2ImageEncoder(TowerConnectorEncoder):
    """Views -> rows of the text model's input embedding, one per placeholder (Idefics3's
    forward and weight loading)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.vision_model = Tower(config.vision_config)
        self.connector = _Connector(config)

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each view's rows; views of one size run as one batch."""
        weight = self.connector.modality_projection.down_proj.weight
        out: list[torch.Tensor | None] = [None] * len(images)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, m in enumerate(images):
            assert m.pixel_values is not None
            by_shape.setdefault(tuple(m.pixel_values.shape), []).append(i)
        for group in by_shape.values():
            pixels = torch.stack([images[i].pixel_values for i in group])  # type: ignore[misc]
            for i, rows in zip(group, self(pixels.to(weight.device, weight.dtype)), strict=True):
                out[i] = rows
        return out  # type: ignore[return-value]
