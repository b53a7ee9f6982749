"""The vision towers of LLaVA-style checkpoints: CLIP's and SigLIP's ViT, in HF's weight names
(and Idefics3 / SmolVLM's, SigLIP's with transformers' bucketed position ids).

    pixels [N, 3, H, W] -> patch conv (+ CLS for CLIP) + position embedding
        -> pre_layrnorm (CLIP) -> encoder layers -> hidden_states[k] for the layers asked for

    layer:  x = x + attn(layer_norm1(x));  x = x + mlp(layer_norm2(x))   (bidirectional attention)

`hidden_states` follows transformers' indexing: entry 0 is the encoder's input (after CLIP's
pre-layernorm), entry i the output of layer i. Only `num_layers` layers are built, those up to
the deepest one read (LLaVA reads layer -2: the last layer is never computed), and the tower's
post_layernorm / pooling head are not used by a LLaVA wrapper.
Images are run at the tower's own `image_size` (the image processor resized them): position
embeddings are not interpolated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn

# vision_config.model_type -> whether the tower has a CLS token and a pre-layernorm
TOWERS = {
    "clip_vision_model": True,
    "siglip_vision_model": False,
    "idefics3_vision": False,
    "smolvlm_vision": False,
    "idefics2_vision": False,  # its ids by each view's grid (multimodal/idefics2.py)
}
# towers whose position ids are bucketed fractions of the patch grid (transformers' Idefics3)
_BUCKETED = ("idefics3_vision", "smolvlm_vision")


def _bucketed_position_ids(side: int) -> torch.Tensor:
    """Idefics3's ids for a full side x side grid, computed as transformers does (float32
    fractions bucketed by an arange of boundaries: equal to row * side + col up to rounding)."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side, dtype=torch.float32)
    step = 1.0 / torch.tensor([side], dtype=torch.float32)
    coords = (torch.arange(side, dtype=torch.float32)[None, :] * step[:, None])[0]
    bucket = torch.bucketize(coords.clamp(max=1.0 - 1e-6), boundaries, right=True)
    return (bucket[:, None] * side + bucket[None, :]).flatten()


def pixel_shuffle(x: torch.Tensor, s: int, rows: int | None = None) -> torch.Tensor:
    """[N, side^2, D] (patches row-major) -> [N, (side / s)^2, s * s * D]: each s x s block of
    patches one row, blocks row-major, patch (a, b) of a block at features (a * s + b) * D
    (Aya Vision's and Command A Vision's projectors, Idefics3's connector, InternVL's; with
    `rows`, a rows x (L / rows) grid: LFM2-VL's projector)."""
    n, length, dim = x.shape
    h = round(length**0.5) if rows is None else rows
    w = length // h
    x = x.reshape(n, h // s, s, w // s, s, dim).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(n, (h // s) * (w // s), s * s * dim)


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        if hidden % num_heads:
            raise ValueError(
                f"vision_config.hidden_size={hidden} is not a multiple of "
                f"vision_config.num_attention_heads={num_heads}"
            )
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, L, D]
        n, length, _ = x.shape
        q, k, v = (
            p(x).view(n, length, self.num_heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        return self.out_proj(out.transpose(1, 2).reshape(n, length, -1))


class VisionMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = get_act_fn(config.hidden_act, "vision_config.hidden_act")
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attn = VisionAttention(config.hidden_size, config.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEmbeddings(nn.Module):
    def __init__(self, config, has_cls: bool) -> None:
        super().__init__()
        d, p = config.hidden_size, config.patch_size
        side = config.image_size // p
        self.num_patches = side**2
        self.patch_embedding = nn.Conv2d(config.num_channels, d, p, stride=p, bias=not has_cls)
        self.class_embedding = nn.Parameter(torch.empty(d)) if has_cls else None
        self.position_embedding = nn.Embedding(self.num_patches + int(has_cls), d)
        bucketed = getattr(config, "model_type", None) in _BUCKETED
        ids = _bucketed_position_ids(side) if bucketed else None
        self.register_buffer("position_ids", ids, persistent=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, C, H, W] -> [N, L, D]
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        x = x.flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            cls = self.class_embedding.expand(x.shape[0], 1, -1)
            x = torch.cat([cls, x], dim=1)
        if self.position_ids is None:
            return x + self.position_embedding.weight
        return x + self.position_embedding(self.position_ids)


class VisionEncoder(nn.Module):
    def __init__(self, config, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(num_layers))


class VisionTransformer(nn.Module):
    """`vision_model` of HF's CLIPVisionModel / SiglipVisionModel (weight names kept)."""

    def __init__(self, config, num_layers: int) -> None:
        super().__init__()
        model_type = getattr(config, "model_type", None)
        if model_type not in TOWERS:
            raise ValueError(
                f"vision_config.model_type={model_type!r} is not supported; supported: "
                f"{sorted(TOWERS)}"
            )
        self.has_cls = TOWERS[model_type]
        self.image_size = int(config.image_size)
        self.embeddings = VisionEmbeddings(config, self.has_cls)
        self.pre_layrnorm = (
            nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if self.has_cls else None
        )
        self.encoder = VisionEncoder(config, num_layers)

    @property
    def num_positions(self) -> int:
        """Tokens per image in every hidden state: the patches, plus CLIP's CLS token."""
        return self.embeddings.num_patches + int(self.has_cls)

    def forward(self, pixels: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
        """hidden_states[i] for each i in `layers` (0 <= i <= num_layers; see the module)."""
        x = self.embeddings(pixels)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = {0: x}
        for i, layer in enumerate(self.encoder.layers, start=1):
            x = layer(x)
            states[i] = x
        return [states[i] for i in layers]


class FinalNormTower(VisionTransformer):
    """`vision_model` with every layer, then post_layernorm (transformers' last_hidden_state):
    SigLIP as Idefics3 / SmolVLM and Gemma 3 read it."""

    def __init__(self, vision_config) -> None:
        super().__init__(vision_config, int(vision_config.num_hidden_layers))
        eps = vision_config.layer_norm_eps
        self.post_layernorm = nn.LayerNorm(vision_config.hidden_size, eps=eps)
        self.depth = int(vision_config.num_hidden_layers)

    def last(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.post_layernorm(self(pixels, [self.depth])[0])
