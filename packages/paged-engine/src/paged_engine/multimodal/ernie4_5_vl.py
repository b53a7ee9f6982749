"""ERNIE 4.5 VL's image path (Ernie4_5_VLMoeForConditionalGeneration): Qwen2-VL's NaViT tower
with a linear patch embedding, a resampler merging 2 x 2 patches (and two frames, which an image
duplicates), Qwen2-VL's M-RoPE table.

    image -> the checkpoint's image processor (Ernie4_5_VLMoeImageProcessor[Pil]: resized to
        multiples of patch * merge pixels between min / max pixels, normalized, cut into h x w
        patches in Qwen2-VL's merge-block order) -> pixel rows [h*w, C*p*p], grid (1, h, w)
    -> vision_tower (`[model.]vision_tower.` in transformers 5, the Hub's `[model.]vision_model.`):
        patch_embed.proj (a bias-free Linear), Qwen2-VL's blocks (qwen2_vl_vision.py: LayerNorm
        pre-norms of vision_config.rms_norm_eps, fused qkv, head_dim / 4 rope frequencies per
        axis rotated by halves in float32, attention within the image, fc1 -> hidden_act ->
        fc2), the final LayerNorm `ln`
    -> resampler_model (HF's Ernie4_5_VLMoeVariableResolutionResamplerModel): each m x m block
        of patches (consecutive rows) one row -> spatial_linear (fc1, GELU, fc2, LayerNorm) ->
        [row, row] (an image is its own second frame) -> temporal_linear (fc1 from twice the
        width, GELU, fc2, LayerNorm) -> mlp (to the text width) -> after_norm (RMSNorm of
        text_config.rms_norm_eps) -> [(h/m) * (w/m), text hidden]; the Hub's
        `spatial_linear.0 / .2 / .3` are fc1 / fc2 / ln
    prompt: <|IMAGE_START|> <|IMAGE_PLACEHOLDER|> x (h*w / m^2) <|IMAGE_END|>  (the processor
        repeats the lone placeholder: QwenLayout's runs)

Positions: Ernie4_5_VLMoeModel.get_rope_index is Qwen2-VL's for images (multimodal/mrope.py:
the image's rows start + (0, i, j), text after it from start + max(h, w) / m). The decoder, its
3-D rope and its modality-routed experts: models/ernie4_5_vl_moe.py.

Refused by name: vision_config.model_type other than ernie4_5_vl_moe_vision, temporal_merge_size
other than 2 (HF's resampler assumes it), a vision rope_type other than axial; an image grid not
(1, h, w) with h, w multiples of spatial_merge_size; videos (not run here).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal import qwen2_vl_vision as qwen
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts_qwen import OneFrameLayout, one_frame_grid
from paged_engine.multimodal.layouts_qwen import grid_merge_size as merge_size

MODEL_TYPES = frozenset({"ernie4_5_vl_moe_vision"})
# checkpoint prefix (after an optional `model.`) -> ours
_PREFIXES = (("vision_model.", "vision_tower."), ("vision_tower.", "vision_tower."))
_RESAMPLER = "resampler_model."
_HUB_MLP = {"0": "fc1", "2": "fc2", "3": "ln"}  # the Hub's nn.Sequential indices


def patch_dim(config: Any) -> int:
    """Width of a pixel row: channels x patch x patch (one temporal patch)."""
    return patch_dim_of(config.vision_config)


class ErnieVisionTower(nn.Module):
    """HF's Ernie4_5_VLMoeVisionTransformerPretrainedModel (its names)."""

    def __init__(self, v: Any) -> None:
        super().__init__()
        model_type = getattr(v, "model_type", None)
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"vision_config.model_type={model_type!r} is not supported; supported: "
                f"{sorted(MODEL_TYPES)}"
            )
        dim, heads = qwen._int_field(v, "hidden_size"), qwen._int_field(v, "num_heads")
        self.head_dim = qwen._head_dim(v, dim, heads)
        self.theta = qwen._rope_theta(v)
        self.merge = qwen._int_field(v, "spatial_merge_size")
        eps = float(getattr(v, "rms_norm_eps", 1e-6))
        act = getattr(v, "hidden_act", None)
        if not isinstance(act, str):
            raise ValueError(f"vision_config.hidden_act={act!r} is not supported")
        hidden = qwen._int_field(v, "intermediate_size")
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Linear(patch_dim_of(v), dim, bias=False)
        self.blocks = nn.ModuleList(
            qwen._Block(dim, heads, qwen._MLP(dim, hidden, act), rms=False)
            for _ in range(qwen._int_field(v, "depth"))
        )
        for block in self.blocks:
            block.norm1.eps = block.norm2.eps = eps
        self.ln = nn.LayerNorm(dim, eps=eps)

    def _positions(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """[P, 2] (row, column) of every patch in merge-block order: Qwen2-VL's (it reads
        only `merge`)."""
        return qwen.QwenVisionEncoder._positions(self, grids)  # type: ignore[arg-type]

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel rows [sum h*w, C*p*p] (merge-block order) -> [sum h*w, D]."""
        weight = self.patch_embed.proj.weight
        x = self.patch_embed.proj(pixels.to(weight.device, weight.dtype))
        cos, sin = qwen._rotary_tables(self._positions(grids), self.head_dim, self.theta, x.device)
        frames = [g.to(x.device) for g in qwen._frame_segments(grids)]
        for block in self.blocks:
            x = block(x, cos, sin, frames)
        return self.ln(x)


def patch_dim_of(v: Any) -> int:
    """A vision_config's pixel row width: channels x patch x patch."""
    return qwen._int_field(v, "in_channels", 3) * qwen._int_field(v, "patch_size") ** 2


class _ResamplerMLP(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, eps: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_dim, out_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(out_dim, out_dim)
        self.ln = nn.LayerNorm(out_dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.fc2(self.act(self.fc1(x))))


class _RMSNorm(nn.Module):
    """HF's Ernie4_5_VLMoeRMSNorm: weight * x / rms(x), in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class ErnieResampler(nn.Module):
    """HF's Ernie4_5_VLMoeVariableResolutionResamplerModel on images (one frame each)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        v = config.vision_config
        self.merge = merge_size(config)
        temporal = int(getattr(v, "temporal_merge_size", 2))
        if temporal != 2:
            raise ValueError(
                f"vision_config.temporal_merge_size={temporal}: only 2 (HF's resampler)"
            )
        eps = float(getattr(v, "rms_norm_eps", 1e-6))
        wide = qwen._int_field(v, "hidden_size") * self.merge**2
        self.spatial_linear = _ResamplerMLP(wide, wide, eps)
        self.temporal_linear = _ResamplerMLP(2 * wide, wide, eps)
        text = config.text_config
        self.mlp = nn.Linear(wide, int(text.hidden_size))
        self.after_norm = _RMSNorm(int(text.hidden_size), float(text.rms_norm_eps))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One image's patches [h*w, D] (merge-block order) -> [h*w / m^2, text hidden]."""
        x = self.spatial_linear(x.reshape(-1, self.spatial_linear.fc1.in_features))
        x = self.temporal_linear(torch.cat([x, x], dim=-1))  # the image twice: its two frames
        return self.after_norm(self.mlp(x))


class ErnieImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding, one per placeholder."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.merge = merge_size(config)
        self.vision_tower = ErnieVisionTower(config.vision_config)
        self.resampler_model = ErnieResampler(config)

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        out = []
        for m in images:
            h, w = one_frame_grid(m.image_size, self.merge)
            x = self.vision_tower(m.pixel_values, [(1, h, w)])  # type: ignore[arg-type]
            out.append(self.resampler_model(x))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The tower's and resampler's tensors (transformers 5's names or the Hub's; the text
        model's are passed over); ValueError naming a missing or unexpected one."""
        return load_named_weights(self, (x for x in map(_ours, weights) if x is not None))


def _ours(item: tuple[str, torch.Tensor]) -> tuple[str, torch.Tensor] | None:
    """A checkpoint tensor under our name, or None for the text model's."""
    name, tensor = item
    name = name.removeprefix("model.")
    for theirs, ours in _PREFIXES:
        if name.startswith(theirs):
            return ours + name.removeprefix(theirs), tensor
    if name.startswith(_RESAMPLER):
        parts = name.split(".")
        if len(parts) == 4 and parts[1].endswith("_linear") and parts[2] in _HUB_MLP:
            parts[2] = _HUB_MLP[parts[2]]
        return ".".join(parts), tensor
    return None


class ErnieLayout(OneFrameLayout):
    """Pixel rows [h*w, C*p*p], size the grid (1, h, w); a run of h*w / m^2 placeholders and
    Qwen2-VL's M-RoPE table (the decoder checks its rope: HF defaults a missing
    mrope_section to (22, 22, 20))."""

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        merge_size(config)  # ValueError naming a bad spatial_merge_size
        self.config = config
        self.placeholder = placeholder
        self.fixed = None

    def row_width(self) -> int:
        return patch_dim(self.config)
