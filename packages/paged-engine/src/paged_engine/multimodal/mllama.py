"""Llama 3.2 Vision's image tower (`MllamaForConditionalGeneration`'s vision_model and
multi_modal_projector; models/mllama.py is the text decoder that cross-attends to its output).

    image -> MllamaImageProcessor: up to T = max_num_tiles tiles of S x S, padded with zero
        tiles to T: pixels [T, 3, S, S], its aspect ratio id (0: padding) and real tiles n
    per tile: conv patches (S / p)^2 + 1 class row = P rows, a gated pre-tile aspect-ratio
        embedding, the gated position / tile-position embedding, LayerNorm; rows padded to a
        multiple of 8 (Pp)
    local transformer over the image's T * Pp rows (its layers' outputs kept), LayerNorm,
        the gated post-tile embedding, the gated global transformer; the pad rows dropped
    out = [global output | the kept local layers' outputs (intermediate_layers_indices,
        stacked feature-major as HF stacks them)] -> multi_modal_projector -> [T * P, D_text]

The tower's mask is HF's (and Meta's): a pad row (a padded tile, or a row past P) is hidden
from pad rows only; real rows see every row. HF runs each image with all T tiles, padded
ones included, and so does `encode`: the cross-attention of text rows before the first image
reads the padded tiles' rows too (models/mllama.py). The tower runs whole on every rank.

`host_image` is the host side of one image: the checkpoint's image processor's output as
(pixels [T, 3, S, S], (real tiles, aspect ratio id)); multimodal/mllama_layout.py places it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn


def num_patches(vision: Any) -> int:
    """P: a tile's patch rows and its class row."""
    return (int(vision.image_size) // int(vision.patch_size)) ** 2 + 1


class _AspectEmbedding(nn.Module):
    """A per-aspect-ratio row added to each tile (HF's MllamaPrecomputedAspectRatioEmbedding)."""

    def __init__(self, vision: Any) -> None:
        super().__init__()
        self.tiles, self.width = int(vision.max_num_tiles), int(vision.hidden_size)
        ids = len(vision.supported_aspect_ratios) + 1
        self.embedding = nn.Embedding(ids, self.tiles * self.width)
        self.gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, ar_ids: torch.Tensor) -> torch.Tensor:  # x: [N, T, *, D]
        e = self.embedding(ar_ids).view(-1, self.tiles, 1, self.width)
        return x + e * self.gate.tanh()


class _PositionEmbedding(nn.Module):
    """(1 - tanh g) * per-patch rows + tanh g * per-aspect-ratio tile rows."""

    def __init__(self, vision: Any) -> None:
        super().__init__()
        self.tiles, self.width = int(vision.max_num_tiles), int(vision.hidden_size)
        self.rows = num_patches(vision)
        ids = len(vision.supported_aspect_ratios) + 1
        self.gate = nn.Parameter(torch.zeros(1))
        self.embedding = nn.Parameter(torch.zeros(self.rows, self.width))
        self.tile_embedding = nn.Embedding(ids, self.tiles * self.rows * self.width)

    def forward(self, x: torch.Tensor, ar_ids: torch.Tensor) -> torch.Tensor:  # [N, T, P, D]
        g = self.gate.tanh()
        x = x + (1 - g) * self.embedding
        tiles = self.tile_embedding(ar_ids).view(-1, self.tiles, self.rows, self.width)
        return x + g * tiles


class _Attention(nn.Module):
    def __init__(self, vision: Any) -> None:
        super().__init__()
        d = int(vision.hidden_size)
        self.heads = int(vision.attention_heads)
        self.q_proj, self.k_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.v_proj, self.o_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:  # x: [N, L, D]
        n, length, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, length, self.heads, -1).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.o_proj(out.transpose(1, 2).reshape(n, length, d))


class _Layer(nn.Module):
    """Pre-LN attention and GELU MLP; the global layers gate both branches with tanh."""

    def __init__(self, vision: Any, gated: bool) -> None:
        super().__init__()
        d, eps = int(vision.hidden_size), float(vision.norm_eps)
        self.self_attn = _Attention(vision)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(d, int(vision.intermediate_size))
        self.mlp.fc2 = nn.Linear(int(vision.intermediate_size), d)
        self.act = get_act_fn(vision.hidden_act, "vision_config.hidden_act")
        self.input_layernorm = nn.LayerNorm(d, eps=eps)
        self.post_attention_layernorm = nn.LayerNorm(d, eps=eps)
        self.gated = gated
        if gated:
            self.gate_attn = nn.Parameter(torch.zeros(1))
            self.gate_ffn = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), bias)
        x = x + (self.gate_attn.tanh() * h if self.gated else h)
        h = self.mlp.fc2(self.act(self.mlp.fc1(self.post_attention_layernorm(x))))
        return x + (self.gate_ffn.tanh() * h if self.gated else h)


def _stack(vision: Any, count: int, gated: bool) -> nn.Module:
    module = nn.Module()
    module.layers = nn.ModuleList(_Layer(vision, gated) for _ in range(count))
    return module


class MllamaVisionModel(nn.Module):
    def __init__(self, vision: Any) -> None:
        super().__init__()
        d, p = int(vision.hidden_size), int(vision.patch_size)
        self.tiles, self.rows = int(vision.max_num_tiles), num_patches(vision)
        self.keep = [int(i) for i in vision.intermediate_layers_indices]
        self.patch_embedding = nn.Conv2d(int(vision.num_channels), d, p, stride=p, bias=False)
        self.class_embedding = nn.Parameter(torch.zeros(d))
        self.gated_positional_embedding = _PositionEmbedding(vision)
        self.pre_tile_positional_embedding = _AspectEmbedding(vision)
        self.post_tile_positional_embedding = _AspectEmbedding(vision)
        self.layernorm_pre, self.layernorm_post = nn.LayerNorm(d), nn.LayerNorm(d)
        self.transformer = _stack(vision, int(vision.num_hidden_layers), gated=False)
        self.global_transformer = _stack(vision, int(vision.num_global_layers), gated=True)

    def forward(
        self, pixels: torch.Tensor, ar_ids: torch.Tensor, real_tiles: torch.Tensor
    ) -> torch.Tensor:
        """pixels [N, T, 3, S, S], ar_ids [N], real_tiles [N] -> [N, T, P, D * (1 + kept)]."""
        n, t = pixels.shape[:2]
        x = self.patch_embedding(pixels.flatten(0, 1)).flatten(2).transpose(1, 2)  # [NT, p, D]
        d = x.shape[-1]
        x = self.pre_tile_positional_embedding(x.view(n, t, -1, d), ar_ids)
        cls = self.class_embedding.expand(n, t, 1, d)
        x = self.gated_positional_embedding(torch.cat([cls, x], dim=2), ar_ids)  # [N, T, P, D]
        x = self.layernorm_pre(x)
        pad = -self.rows % 8
        padded = self.rows + pad
        x = F.pad(x, (0, 0, 0, pad)).view(n, t * padded, d)
        # a pad row (padded tile, or past P) hides pad rows only: HF's inv ⊗ inv * min
        is_pad = torch.arange(t, device=x.device)[None, :] >= real_tiles[:, None]  # [N, T]
        is_pad = is_pad[:, :, None] | (torch.arange(padded, device=x.device) >= self.rows)
        inv = is_pad.reshape(n, 1, t * padded).to(x.dtype)
        bias = (inv.transpose(1, 2) @ inv * torch.finfo(x.dtype).min)[:, None]  # [N, 1, L, L]
        kept = []
        for layer in self.transformer.layers:
            x = layer(x, bias)
            kept.append(x)
        x = self.layernorm_post(x).view(n, t, padded, d)
        x = self.post_tile_positional_embedding(x, ar_ids).view(n, t * padded, d)
        for layer in self.global_transformer.layers:
            x = layer(x, bias)
        x = x.view(n, t, padded, d)[:, :, : self.rows]
        inter = torch.stack([kept[i] for i in self.keep], dim=-1).reshape(n, t, padded, -1)
        return torch.cat([x, inter[:, :, : self.rows]], dim=-1)


class MllamaVisionTower(nn.Module):
    """The checkpoint's `model.vision_model` and `model.multi_modal_projector`."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision = config.vision_config
        self.vision_model = MllamaVisionModel(vision)
        width = int(vision.vision_output_dim)
        self.multi_modal_projector = nn.Linear(width, int(config.text_config.hidden_size))

    def forward(
        self, pixels: torch.Tensor, ar_ids: torch.Tensor, real_tiles: torch.Tensor
    ) -> torch.Tensor:
        """[N, T, 3, S, S] -> each image's T * P cross-attention states [N, T * P, D_text]."""
        w = self.multi_modal_projector.weight
        out = self.vision_model(pixels.to(w.device, w.dtype), ar_ids, real_tiles)
        return self.multi_modal_projector(out).flatten(1, 2)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """A checkpoint tensor's name under this module, or None for the text model's."""
        for prefix in ("model.vision_model.", "vision_model."):
            if name.startswith(prefix):
                return "vision_model." + name.removeprefix(prefix)
        for prefix in ("model.multi_modal_projector.", "multi_modal_projector."):
            if name.startswith(prefix):
                return "multi_modal_projector." + name.removeprefix(prefix)
        return None


def host_image(out: Any, tiles: int, side: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """MllamaImageProcessor's output for one image -> (pixels [T, 3, S, S] float32,
    (real tiles, aspect ratio id)); ValueError where its tiles are not the model's (their
    count or side: a tile smaller than a patch would fail the tower's convolution)."""
    pixels = out["pixel_values"][0][0].float()
    if tuple(pixels.shape) != (tiles, 3, side, side):
        raise ValueError(
            f"multi_modal_data['image']: the image processor gave pixel values of shape "
            f"{tuple(pixels.shape)}, not {(tiles, 3, side, side)} (vision_config.max_num_tiles "
            "and image_size): check max_image_tiles and size in preprocessor_config.json"
        )
    real = int(torch.as_tensor(out["aspect_ratio_mask"])[0][0].sum())
    return pixels, (real, int(torch.as_tensor(out["aspect_ratio_ids"])[0][0]))


def tower_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterable[tuple[str, torch.Tensor]]:
    """The tower's tensors of a checkpoint, named as MllamaVisionTower's parameters."""
    for name, w in weights:
        ours = MllamaVisionTower.checkpoint_name(name)
        if ours is not None:
            yield ours, w
