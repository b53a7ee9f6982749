"""Florence-2 (`Florence2ForConditionalGeneration`, transformers 5's model_type "florence2"):
a DaViT image tower whose projected rows go in front of BART's encoder input (models/bart.py).

    pixels [3, H, W] -> per stage s: conv patch embed (stride 4, then 2; a LayerNorm after the
        first conv, before the later ones) -> per block: spatial block (depthwise conv
        residual, windowed multi-head attention, depthwise conv residual, MLP) then channel
        block (the same with attention over channel groups: queries are channels, keys
        channels, each scaled by tokens^-0.5) -> [C, h, w]
    projector: + learned 2-D positions (columns' table in the first C/2 channels, rows' in the
        rest) -> [h * w, C] + the cosine temporal row of frame 0 -> rows = [mean of all; each]
        [h * w + 1, C] -> image_projection -> LayerNorm -> [h * w + 1, d_model]
    BART encoder input: [image rows ; shared(text ids) * embed_scale], learned positions over
        all of it (p + 2), then BART's encoder; the decoder cross-attends to every row

As transformers' Florence2Model (the image rows take the processor's leading <image> tokens'
places) and vLLM 0.10's florence2.py (the rows replace the encoder prompt's leading
pad-token run). Windowed attention pads each map to whole windows with zeros after norm1 and
lets every window position, the padding included, be a key (no mask), as both do. The
temporal table row is recomputed (`visual_temporal_embed.pos_idx_to_embed` not read); the head
is tied to the shared embedding without final_logits_bias (transformers' lm_head; vLLM skips
the bias).

Served as BART is (the cross-attention slots of worker/cross_attention.py): a sequence's two
items (multimodal/florence2_prompt.py: the image's pixels, then the encoder text's ids) are one
slot's content, encoded once (`encode_cross`). The tower and projector run whole on every
tensor-parallel rank (as Mllama's tower). Refused by name (`florence2_engine_config`):
limit_mm_per_prompt's image count other than 1, a projection_dim other than d_model, the
Hub's remote-code layout (vision_config.model_type "davit": microsoft/Florence-2-*; convert it
with transformers' conversion script or use the florence-community checkpoints), and what BART
refuses.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.models.bart import BartForConditionalGeneration, BartModel, bart_engine_config
from paged_engine.models.encoder_decoder import CrossPlan, lift_fields, one_image_a_prompt
from paged_engine.models.utils import CausalLMBase
from paged_engine.multimodal.inputs import ImageInput

ARCH = "Florence2ForConditionalGeneration"
# the text model's fields the engine and BART's helpers read at the top level
_TEXT_FIELDS = (
    "vocab_size",
    "d_model",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "encoder_layers",
    "decoder_layers",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "activation_function",
    "scale_embedding",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "decoder_start_token_id",
)


def is_florence2(hf_config: Any) -> bool:
    return ARCH in (getattr(hf_config, "architectures", None) or ())


def florence2_engine_config(config: Any, hf_config: Any) -> None:
    """Refuse (ValueError naming the field) the remote-code layout; put the text model's
    fields at the top level; then BART's checks on them."""
    vision = hf_config.vision_config
    if getattr(vision, "model_type", None) == "davit" or hasattr(vision, "dim_embed"):
        raise ValueError(
            "vision_config.model_type='davit' (the Hub's remote-code Florence-2 layout) is not "
            "supported: serve a transformers-native checkpoint (model_type 'florence2', e.g. "
            "florence-community/Florence-2-base)"
        )
    one_image_a_prompt(config, "Florence-2")
    text = hf_config.text_config
    lift_fields(hf_config, text, _TEXT_FIELDS)
    if int(vision.projection_dim) != int(text.d_model):
        raise ValueError(
            f"vision_config.projection_dim={vision.projection_dim} must equal the text model's "
            f"d_model={text.d_model} (the image rows go into its encoder)"
        )
    bart_engine_config(config, hf_config)


def conv_out(side: int, vision: Any) -> int:
    """A side of the last stage's feature map for an input side of `side` pixels."""
    for k, s, p in zip(vision.patch_size, vision.patch_stride, vision.patch_padding, strict=True):
        side = (side + 2 * int(p) - int(k)) // int(s) + 1
    return side


def image_rows(height: int, width: int, vision: Any) -> int:
    """The projector's rows for an image of height x width pixels: each map cell and the mean."""
    return conv_out(height, vision) * conv_out(width, vision) + 1


class ConvEmbed(nn.Module):
    def __init__(self, vision: Any, s: int) -> None:
        super().__init__()
        dim_in = int(vision.in_channels) if s == 0 else int(vision.embed_dim[s - 1])
        dim = int(vision.embed_dim[s])
        self.pre_norm = bool(vision.patch_prenorm[s])
        k, st, p = (
            int(x[s]) for x in (vision.patch_size, vision.patch_stride, vision.patch_padding)
        )
        self.conv = nn.Conv2d(dim_in, dim, kernel_size=k, stride=st, padding=p)
        self.norm = nn.LayerNorm(dim_in if self.pre_norm else dim)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, C, h, w], normed over C
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            return self.conv(self._norm(x))
        return self._norm(self.conv(x))


class Mlp(nn.Module):
    def __init__(self, vision: Any, dim: int) -> None:
        super().__init__()
        hidden = int(dim * float(vision.mlp_ratio))
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = get_act_fn(vision.activation_function, "vision_config.activation_function")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class WindowAttention(nn.Module):
    """Heads attend within window x window tiles of the map (zero-padded to whole tiles)."""

    def __init__(self, vision: Any, dim: int, heads: int) -> None:
        super().__init__()
        self.window, self.heads = int(vision.window_size), heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=bool(vision.qkv_bias))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, h, w, C] -> [B, h * w, C]
        b, h, w, c = x.shape
        n = self.window
        x = F.pad(x, (0, 0, 0, (n - w % n) % n, 0, (n - h % n) % n))
        ph, pw = x.shape[1] // n, x.shape[2] // n
        tiles = x.view(b, ph, n, pw, n, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, n * n, c)
        q, k, v = (
            self.qkv(tiles).view(tiles.shape[0], n * n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        )
        o = F.scaled_dot_product_attention(q, k, v)  # [tiles, H, n*n, Dh], scale Dh^-0.5
        o = self.proj(o.transpose(1, 2).reshape(tiles.shape[0], n * n, c))
        o = o.view(b, ph, pw, n, n, c).permute(0, 1, 3, 2, 4, 5).reshape(b, ph * n, pw * n, c)
        return o[:, :h, :w].reshape(b, h * w, c)


class ChannelAttention(nn.Module):
    """Groups of channels attend to each other: a channel's query is its values over the
    tokens, scaled by tokens^-0.5."""

    def __init__(self, vision: Any, dim: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.qkv = nn.Linear(dim, 3 * dim, bias=bool(vision.qkv_bias))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, N, C]
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.groups, -1).permute(2, 0, 3, 4, 1)  # [B,G,Cg,N]
        o = F.scaled_dot_product_attention(q, k, v, scale=n**-0.5)  # [B, G, Cg, N]
        return self.proj(o.permute(0, 3, 1, 2).reshape(b, n, c))


class DaViTBlock(nn.Module):
    """The spatial or the channel block: conv residual, attention, conv residual, MLP."""

    def __init__(self, vision: Any, s: int, spatial: bool) -> None:
        super().__init__()
        dim = int(vision.embed_dim[s])
        self.spatial = spatial
        self.conv1 = nn.Conv2d(dim, dim, kernel_size=3, padding=1, groups=dim)
        self.norm1 = nn.LayerNorm(dim)
        if spatial:
            self.window_attn = WindowAttention(vision, dim, int(vision.num_heads[s]))
        else:
            self.channel_attn = ChannelAttention(vision, dim, int(vision.num_groups[s]))
        self.conv2 = nn.Conv2d(dim, dim, kernel_size=3, padding=1, groups=dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = Mlp(vision, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, C, h, w]
        b, c, h, w = x.shape
        t = (self.conv1(x) + x).flatten(2).transpose(1, 2)  # [B, h*w, C]
        y = self.norm1(t)
        if self.spatial:
            t = t + self.window_attn(y.view(b, h, w, c))
        else:
            t = t + self.channel_attn(y)
        x = t.transpose(1, 2).reshape(b, c, h, w)
        t = (self.conv2(x) + x).flatten(2).transpose(1, 2)
        t = t + self.ffn(self.norm2(t))
        return t.transpose(1, 2).reshape(b, c, h, w)


class DaViTLayer(nn.Module):
    def __init__(self, vision: Any, s: int) -> None:
        super().__init__()
        self.spatial_block = DaViTBlock(vision, s, spatial=True)
        self.channel_block = DaViTBlock(vision, s, spatial=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.channel_block(self.spatial_block(x))


class DaViT(nn.Module):
    """transformers' Florence2VisionBackbone (its names): pixels [B, 3, H, W] -> [B, C, h, w]."""

    def __init__(self, vision: Any) -> None:
        super().__init__()
        stages = range(len(vision.embed_dim))
        self.convs = nn.ModuleList(ConvEmbed(vision, s) for s in stages)
        self.blocks = nn.ModuleList(
            nn.ModuleList(DaViTLayer(vision, s) for _ in range(int(vision.depths[s])))
            for s in stages
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv, layers in zip(self.convs, self.blocks, strict=True):
            x = conv(x)
            for layer in layers:
                x = layer(x)
        return x


class PositionEmbedding2D(nn.Module):
    def __init__(self, vision: Any) -> None:
        super().__init__()
        num, dim = int(vision.max_position_embeddings), int(vision.embed_dim[-1])
        self.row_embeddings = nn.Embedding(num, dim // 2)
        self.column_embeddings = nn.Embedding(num, dim - dim // 2)

    def forward(self, h: int, w: int, device: torch.device) -> torch.Tensor:  # -> [C, h, w]
        cols = self.column_embeddings(torch.arange(w, device=device))  # [w, C - C/2]
        rows = self.row_embeddings(torch.arange(h, device=device))  # [h, C/2]
        grid = torch.cat([cols.expand(h, -1, -1), rows[:, None].expand(-1, w, -1)], dim=-1)
        return grid.permute(2, 0, 1)


class Florence2Projector(nn.Module):
    """transformers' Florence2MultiModalProjector: [B, C, h, w] -> [B, h * w + 1, d_model]."""

    def __init__(self, vision: Any) -> None:
        super().__init__()
        dim, out = int(vision.embed_dim[-1]), int(vision.projection_dim)
        self.max_side = int(vision.max_position_embeddings)
        self.image_projection = nn.Linear(dim, out, bias=False)
        self.image_proj_norm = nn.LayerNorm(out)
        self.image_position_embed = PositionEmbedding2D(vision)
        # frame 0's cosine temporal row (sin 0 = 0 at even channels, cos 0 = 1 at odd ones)
        frame0 = torch.zeros(dim)
        frame0[1::2] = 1.0
        self.register_buffer("frame0", frame0, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        assert max(h, w) <= self.max_side, "the host checks the map against the position table"
        x = x + self.image_position_embed(h, w, x.device).to(x.dtype)
        x = x.flatten(2).transpose(1, 2) + self.frame0.to(x.dtype)  # [B, h*w, C]
        x = torch.cat([x.mean(dim=1, keepdim=True), x], dim=1)
        return self.image_proj_norm(self.image_projection(x))


class Florence2ForConditionalGeneration(BartForConditionalGeneration):
    """BART's model (the wrapper's text_config) with the DaViT tower and projector beside it."""

    head_bias = False  # transformers' lm_head: the shared embedding, no final_logits_bias
    ignored_weights = (
        *BartForConditionalGeneration.ignored_weights,
        "visual_temporal_embed.pos_idx_to_embed",
        "final_logits_bias",
    )

    def __init__(self, config: Any) -> None:
        text = config.text_config
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        CausalLMBase.__init__(self, text, BartModel(text))
        self.wrapper_config = config
        self.vision_tower = DaViT(config.vision_config)
        self.multi_modal_projector = Florence2Projector(config.vision_config)

    @staticmethod
    def kv_cache_layout(config: Any) -> list[tuple[int, int]]:
        text = getattr(config, "text_config", config)
        return BartForConditionalGeneration.kv_cache_layout(text)

    def rename_weight(self, name: str) -> str:
        for ours in ("vision_tower.", "multi_modal_projector."):
            if name.startswith("model." + ours):
                return name[len("model.") :]
        if name.startswith("model.language_model."):
            return "model." + name[len("model.language_model.") :]
        return name

    def load_weights(self, weights, strict: bool = True) -> set[str]:
        return CausalLMBase.load_weights(self, weights, strict)

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """One image's pixels [3, H, W] -> its encoder rows [h * w + 1, d_model]."""
        dtype = self.multi_modal_projector.image_projection.weight.dtype
        maps = self.vision_tower(pixels[None].to(dtype))
        return self.multi_modal_projector(maps)[0]

    def cross_plan(self, items: Sequence[ImageInput]) -> CrossPlan:
        """A sequence's image and encoder text as a slot's content: all their rows, seen by
        every decoder row (the key: both items' hashes)."""
        if len(items) != 2 or [m.modality for m in items] != ["image", "text"]:
            raise RuntimeError(f"a Florence-2 sequence reached the worker with {len(items)} items")
        image, text = items
        pixels, ids = image.pixel_values, text.pixel_values
        assert pixels is not None and ids is not None
        vision = self.wrapper_config.vision_config
        rows = image_rows(int(pixels.shape[-2]), int(pixels.shape[-1]), vision) + ids.numel()
        key = f"{image.mm_hash}:{text.mm_hash}"
        return CrossPlan(key, rows, (rows,), 0, rows, (pixels, ids))

    def encode_cross(self, payloads: list) -> Iterator[tuple[torch.Tensor, ...]]:
        """(pixels, encoder text ids) pairs -> per decoder layer (k, v) [their rows, H, Dh]:
        each image through the tower, then all the step's encoder prompts in one BART run."""
        dev = self.model.shared.weight.device
        images = [self.encode_image(px.to(dev)) for px, _ in payloads]
        rows = self.model.encode_batch([ids.to(dev) for _, ids in payloads], images)
        for layer in self.model.decoder.layers:
            yield layer.encoder_attn.kv(rows)
