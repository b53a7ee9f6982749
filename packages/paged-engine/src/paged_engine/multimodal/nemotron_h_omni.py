"""Nemotron-H Omni's image path (NemotronH_Omni_Reasoning_V3): a C-RADIO tower at each image's
own patch grid, pixel shuffle and a relu^2 projector into the Nemotron-H decoder
(models/nemotron_h.py, through text_wrappers.py's row). The prompt side and the torch copy of
its torchvision-only image processor: multimodal/nemotron_h_omni_processor.py.

    image -> patches [h * w, 3 * p * p] (row-major, each channel-major), normalized by the
        image processor (the tower's input conditioner is external in this wrapper)
    tower (transformers' RadioModel, the Hub's names `vision_model.radio_model.model.*`):
        patch_generator.embedder (no bias) + the pos_embed table [max/p x max/p] bilinearly
            resized to a square of the grid's longer side (align_corners False, float32), cut
            to h x w; cls_token.token rows (num_cls_tokens + num_registers) in front
        DINOv2 blocks over the image's rows alone: x += ls1 * attn(norm1(x)) (fused qkv with
            biases, proj), x += ls2 * fc2(gelu(fc1(norm2(x))))
        features: the rows past the prefix
    -> vision_final_layernorm (only where text_config.num_nextn_predict_layers > 0; the Hub's
       `vision_projector.vision_final_layernorm`) -> pixel shuffle by downsample_ratio (as
       transformers' `pixel_shuffle` on [1, h, w, D]) -> mlp1: RMSNorm (float32, eps 1e-5) ->
       linear_1 -> relu^2 -> linear_2 (no biases): h * w / 4 rows for 0.5

Refused by name: vision_config.use_swiglu_ffn, a downsample_ratio other than 0.5 (the
processor's merge and the shuffle both assume 2 x 2), vision_hidden_size other than
vision_config.hidden_size. Videos (tubelets, EVS pruning) are not run; audio (the Parakeet
encoder): multimodal/nemotron_h_omni_audio.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput

_TOWER = "vision_model.radio_model.model."


def check_config(config: Any) -> None:
    """ValueError naming the first field this path does not run."""
    vision = config.vision_config
    if getattr(vision, "use_swiglu_ffn", False):
        raise ValueError("vision_config.use_swiglu_ffn=True is not supported (the GELU MLP only)")
    if float(config.downsample_ratio) != 0.5:
        raise ValueError(f"downsample_ratio={config.downsample_ratio} is not supported (only 0.5)")
    if int(config.vision_hidden_size) != int(vision.hidden_size):
        raise ValueError(
            f"vision_hidden_size={config.vision_hidden_size} differs from "
            f"vision_config.hidden_size={vision.hidden_size}"
        )
    if str(vision.hidden_act) != "gelu":
        raise ValueError(f"vision_config.hidden_act={vision.hidden_act!r} is not supported: gelu")


class _Scale(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lambda1 = nn.Parameter(torch.ones(width))


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int, bias: bool) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(
                f"vision_config.hidden_size={width} is not a multiple of {heads} heads"
            )
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width, bias=bias)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [L, D], one image's rows
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.heads, -1).permute(1, 2, 0, 3)
        out = F.scaled_dot_product_attention(q, k, v)  # [heads, L, head_dim], all see all
        return self.proj(out.transpose(0, 1).reshape(x.shape[0], -1))


class _MLP(nn.Module):
    def __init__(self, width: int, inner: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, inner)
        self.fc2 = nn.Linear(inner, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _Block(nn.Module):
    def __init__(self, vision: Any) -> None:
        super().__init__()
        d, eps = int(vision.hidden_size), float(vision.layer_norm_eps)
        self.norm1 = nn.LayerNorm(d, eps=eps)
        self.attn = _Attention(d, int(vision.num_attention_heads), bool(vision.qkv_bias))
        self.layer_scale1 = _Scale(d)
        self.norm2 = nn.LayerNorm(d, eps=eps)
        self.mlp = _MLP(d, int(d * float(vision.mlp_ratio)))
        self.layer_scale2 = _Scale(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x)) * self.layer_scale1.lambda1
        return x + self.mlp(self.norm2(x)) * self.layer_scale2.lambda1


class _PatchGenerator(nn.Module):
    def __init__(self, vision: Any) -> None:
        super().__init__()
        d, p = int(vision.hidden_size), int(vision.patch_size)
        self.side = int(vision.max_img_size) // p
        self.embedder = nn.Linear(int(vision.num_channels) * p * p, d, bias=False)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.side * self.side, d))
        prefix = int(vision.num_cls_tokens) + int(vision.num_registers)
        self.cls_token = nn.Module()
        self.cls_token.token = nn.Parameter(torch.zeros(prefix, d))

    def positions(self, h: int, w: int) -> torch.Tensor:
        """[h * w, D]: the table resized to a square of max(h, w), cut to h x w."""
        table = self.pos_embed.reshape(1, self.side, self.side, -1).permute(0, 3, 1, 2)
        big = max(h, w)
        table = F.interpolate(table.float(), size=(big, big), mode="bilinear", align_corners=False)
        table = table[..., :h, :w].to(self.pos_embed.dtype)
        return table.flatten(2)[0].t()

    def forward(self, patches: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """[h * w, 3 p p] -> [prefix + h * w, D]."""
        rows = self.embedder(patches) + self.positions(h, w)
        return torch.cat([self.cls_token.token, rows])


class RadioTower(nn.Module):
    """C-RADIO under the Hub's names (`patch_generator`, `blocks`), one image at a time."""

    def __init__(self, vision: Any) -> None:
        super().__init__()
        self.patch_generator = _PatchGenerator(vision)
        self.blocks = nn.ModuleList(_Block(vision) for _ in range(int(vision.num_hidden_layers)))
        self.prefix = int(vision.num_cls_tokens) + int(vision.num_registers)

    def forward(self, patches: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """[h * w, 3 p p] -> the patch rows' features [h * w, D]."""
        x = self.patch_generator(patches, h, w)
        for block in self.blocks:
            x = block(x)
        return x[self.prefix :]


class _RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)  # the weight multiply in float32 too


class Projector(nn.Module):
    """`mlp1` (transformers' multi_modal_projector): modules 0, 1, 3 of the Hub's Sequential."""

    def __init__(self, width: int, hidden: int, out: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [_RMSNorm(width, 1e-5), nn.Linear(width, hidden, bias=False), nn.Identity()]
        )
        self.layers.append(nn.Linear(hidden, out, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm, fc1, _, fc2 = self.layers
        return fc2(torch.relu(fc1(norm(x))).square())


def pixel_shuffle(x: torch.Tensor, scale: float) -> torch.Tensor:
    """transformers' pixel_shuffle on [1, h, w, D] (its reshapes in its order):
    [1, h * scale, w * scale, D / scale^2]."""
    n, h, w, c = x.shape
    x = x.view(n, h, int(w * scale), int(c / scale)).transpose(1, 2).contiguous()
    x = x.view(n, int(w * scale), int(h * scale), int(c / (scale * scale)))
    return x.transpose(1, 2).contiguous()


class NemotronOmniImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding, one per placeholder."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        check_config(config)
        vision, text = config.vision_config, config.text_config
        d = int(vision.hidden_size)
        self.ratio = float(config.downsample_ratio)
        self.radio = RadioTower(vision)
        self.final_norm = (
            nn.LayerNorm(d, eps=float(vision.layer_norm_eps))
            if int(getattr(text, "num_nextn_predict_layers", 0) or 0) > 0
            else None
        )
        merged = d * round(1 / self.ratio) ** 2
        hidden = int(config.projector_hidden_size)
        self.mlp1 = Projector(merged, hidden, int(text.hidden_size))

    def forward(self, patches: torch.Tensor, h: int, w: int) -> torch.Tensor:
        x = self.radio(patches, h, w)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return self.mlp1(pixel_shuffle(x.view(1, h, w, -1), self.ratio).flatten(0, 2))

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        weight = self.radio.patch_generator.embedder.weight
        out = []
        for m in images:
            assert m.pixel_values is not None and m.image_size is not None
            h, w = (int(v) for v in m.image_size)
            out.append(self(m.pixel_values.to(weight.device, weight.dtype), h, w))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's tower (`vision_model.radio_model.model.*`; its video embedder
        passed over), `mlp1.*` and `vision_projector.vision_final_layernorm.*` (any other name
        is passed over); ValueError naming a missing or unexpected one."""

        def ours(name: str) -> str | None:
            if name.startswith(_TOWER):
                inner = name.removeprefix(_TOWER)
                return None if inner.startswith("patch_generator.video_") else f"radio.{inner}"
            if name.startswith("mlp1."):
                layer, rest = name.removeprefix("mlp1.").split(".", 1)
                return f"mlp1.layers.{layer}.{rest}"
            if name.startswith("vision_projector.vision_final_layernorm."):
                return "final_norm." + name.rsplit(".", 1)[1]
            return None

        picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)


def merge_size(config: Any) -> int:
    return round(1 / float(config.downsample_ratio))


def tokens(config: Any, h: int, w: int) -> int:
    """Placeholders of an h x w patch grid; ValueError unless the merge divides it."""
    m = merge_size(config)
    if h <= 0 or w <= 0 or h % m or w % m:
        raise ValueError(f"multi_modal_data['image']: a {h} x {w} patch grid is not in {m}s")
    return h * w // (m * m)
