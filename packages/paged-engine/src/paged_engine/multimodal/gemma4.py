"""Gemma 4's image path (Gemma4ForConditionalGeneration: gemma-4-E2B / E4B / 26B-A4B / 31B).

Unlike Gemma 3 (a fixed-size SigLIP image pooled to 256 rows), an image keeps its aspect ratio
and the tower is a Gemma-style encoder over its own patch grid, each piece as transformers runs
it:

    image -> the checkpoint's image processor: resized (aspect kept) to an h x w patch grid
        (h, w multiples of the pooling kernel k, h * w <= max_soft_tokens * k^2), rescaled to
        [0, 1], cut into patches [h * w, 3 * p * p] (rows row-major, each patch (py, px, c));
        its padding to max patches is dropped here (HF masks it out of everything)
    patch embedder: input_proj(2 * (pixels - 0.5)) + table[0][col] + table[1][row]
    encoder layers (no final norm): Gemma 4's sandwich of four RMSNorms (scale `weight`, float32),
        attention over the image's patches both ways with q / k norms, a weightless v norm,
        scale 1, and a 2D RoPE: the first half of each head rotated by the column, the second
        by the row (NeoX halves in each, frequencies 1 / theta^(4i / head_dim)); a tanh-GELU
        gated MLP; with `use_clipped_linears` every projection clamps its input and output to
        the checkpoint's bounds
    pooler: each k x k block of patches averaged (row-major blocks) and times sqrt(hidden), in
        float32; with `standardize`, (x - std_bias) * std_scale
    embed_vision: a weightless RMSNorm (vision eps), then a projection to the text width
        -> h * w / k^2 rows, not scaled by the text embedding's sqrt(hidden)
    prompt: each <|image|> a user writes becomes <|image> + <|image|> x (h * w / k^2) + <image|>
        (HF's processor replaces it in the text; the three are special tokens)
    attention: with text_config.use_bidirectional_attention="vision" an image's soft tokens see
        each other both ways at prefill on the sliding layers only (the window's lower bound
        kept); full layers stay causal (models/gemma4.py `Gemma4Model`)
    per-layer inputs (E2B / E4B): an image's positions read the pad token's per-layer embedding
        and project the image rows (models/gemma4.py `Gemma4Model`)

The image processor: transformers' Gemma4ImageProcessor where torchvision imports, else
`Gemma4TorchProcessor` here (multimodal/torch_processors.py's table), its steps in torch alone
(transformers' own fallback, its PIL class, resamples otherwise: up to 2 / 255 apart): the
target size by transformers' get_aspect_ratio_preserving_size, bicubic with antialias on the
uint8 image, rescaled in float32, patches padded to max_soft_tokens * k^2 rows (positions -1).

Refused by name: a vision rope_parameters rope_type other than "axial", a head_dim not a
multiple of 4, pipeline parallelism with per-layer inputs (hidden_size_per_layer_input).
A video's frames run as images here (multimodal/gemma4_video.py); audio runs on the E2B / E4B
checkpoints (multimodal/gemma4_audio.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.distributed.parallel_state import get_parallel_state
from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.norm import UnitRMSNorm
from paged_engine.models.olmo2 import Olmo2RMSNorm
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.torch_processors import (
    ProcessorKwargs,
    TorchImageProcessor,
    normalize,
    resize,
)


def check_config(config: Any) -> None:
    """ValueError naming the vision_config field this tower does not run."""
    vision = config.vision_config
    rope = getattr(vision, "rope_parameters", None) or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(
            f"Gemma 4 vision_config.rope_parameters rope_type={rope['rope_type']!r} is not "
            "supported (only 'axial')"
        )
    if int(vision.head_dim) % 4:
        raise ValueError(
            f"Gemma 4 vision_config.head_dim={vision.head_dim} must be a multiple of 4"
        )


def kernel(config: Any) -> int:
    return int(config.vision_config.pooling_kernel_size)


def patch_dim(config: Any) -> int:
    return 3 * int(config.vision_config.patch_size) ** 2


def image_tokens(config: Any, grid: tuple[int, ...]) -> int:
    """Soft tokens (= feature rows) of an image of an h x w patch grid."""
    k = kernel(config)
    h, w = grid
    if h % k or w % k:
        raise ValueError(f"an image's {h} x {w} patch grid is not in blocks of {k}")
    check_position_table(h, w, int(config.vision_config.position_embedding_size), "tower's")
    return (h // k) * (w // k)


def check_position_table(h: int, w: int, side: int, whose: str) -> None:
    """ValueError naming multi_modal_data for an h x w patch grid past a learned position table
    of `side` a side (a long strip: transformers' table lookup would fail too)."""
    if max(h, w) > side:
        raise ValueError(
            f"multi_modal_data['image']: an image of {h} x {w} patches is longer than the "
            f"{whose} position table ({side} a side)"
        )


def bidirectional(config: Any) -> bool:
    """Whether an image's tokens attend to each other both ways (on the sliding layers)."""
    text = config.text_config
    return getattr(text, "use_bidirectional_attention", None) == "vision"


class ClippableLinear(nn.Module):
    """A bias-free projection (`.linear`), its input and output clamped to the checkpoint's
    bounds with `use_clipped_linears`."""

    def __init__(self, d_in: int, d_out: int, clipped: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out, bias=False)
        self.clipped = clipped
        if clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                bound = float("-inf") if name.endswith("min") else float("inf")
                setattr(self, name, nn.Parameter(torch.tensor(bound), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        x = self.linear(torch.clamp(x, self.input_min, self.input_max))
        return torch.clamp(x, self.output_min, self.output_max)


def rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D]; cos, sin [N, 2, D / 4] (column, row): each half of a head rotated by its
    axis, NeoX-style (its first and second quarters paired)."""
    out = []
    for axis, half in enumerate(x.chunk(2, dim=-1)):
        a, b = half.chunk(2, dim=-1)
        c, s = cos[:, None, axis], sin[:, None, axis]
        out += [a * c - b * s, b * c + a * s]
    return torch.cat(out, dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, vision: Any) -> None:
        super().__init__()
        d, clipped = int(vision.hidden_size), bool(vision.use_clipped_linears)
        self.heads, self.kv_heads = int(vision.num_attention_heads), int(vision.num_key_value_heads)
        self.head_dim = hd = int(vision.head_dim)
        eps = float(vision.rms_norm_eps)
        self.q_proj = ClippableLinear(d, self.heads * hd, clipped)
        self.k_proj = ClippableLinear(d, self.kv_heads * hd, clipped)
        self.v_proj = ClippableLinear(d, self.kv_heads * hd, clipped)
        self.o_proj = ClippableLinear(self.heads * hd, d, clipped)
        self.q_norm, self.k_norm = Olmo2RMSNorm(hd, eps), Olmo2RMSNorm(hd, eps)
        self.v_norm = UnitRMSNorm(eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, hd = x.shape[0], self.head_dim  # x: [N, D], one image's patches
        q = rope_2d(self.q_norm(self.q_proj(x).view(n, -1, hd)), cos, sin)
        k = rope_2d(self.k_norm(self.k_proj(x).view(n, -1, hd)), cos, sin)
        v = self.v_norm(self.v_proj(x).view(n, -1, hd))
        group = self.heads // self.kv_heads
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=1.0
        )
        return self.o_proj(out.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, vision: Any) -> None:
        super().__init__()
        d, i = int(vision.hidden_size), int(vision.intermediate_size)
        clipped = bool(vision.use_clipped_linears)
        self.gate_proj = ClippableLinear(d, i, clipped)
        self.up_proj = ClippableLinear(d, i, clipped)
        self.down_proj = ClippableLinear(i, d, clipped)
        self.act = get_act_fn(vision.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionLayer(nn.Module):
    def __init__(self, vision: Any) -> None:
        super().__init__()
        d, eps = int(vision.hidden_size), float(vision.rms_norm_eps)
        self.self_attn = VisionAttention(vision)
        self.mlp = VisionMLP(vision)
        for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            setattr(self, f"{name}_layernorm", Olmo2RMSNorm(d, eps))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class PatchEmbedder(nn.Module):
    def __init__(self, vision: Any) -> None:
        super().__init__()
        d, p = int(vision.hidden_size), int(vision.patch_size)
        self.input_proj = nn.Linear(3 * p * p, d, bias=False)
        self.position_embedding_table = nn.Parameter(
            torch.empty(2, int(vision.position_embedding_size), d)
        )

    def forward(
        self, patches: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        # patches: [N, 3 * p * p] float32 in [0, 1], scaled before the cast as HF does
        table, weight = self.position_embedding_table, self.input_proj.weight
        x = self.input_proj((2 * (patches.float() - 0.5)).to(weight.dtype))
        return x + (table[0][cols] + table[1][rows])


class _Encoder(nn.Module):  # the checkpoint's `vision_tower.encoder.layers` nesting
    def __init__(self, vision: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(vision) for _ in range(vision.num_hidden_layers))


class VisionTower(nn.Module):
    """One image's patches [h * w, 3 * p * p] -> pooled rows [h * w / k^2, D] (see the module)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision = config.vision_config
        self.k = kernel(config)
        self.width = int(vision.hidden_size)
        self.patch_embedder = PatchEmbedder(vision)
        self.encoder = _Encoder(vision)
        self.standardize = bool(getattr(vision, "standardize", False))
        if self.standardize:
            self.std_bias = nn.Parameter(torch.zeros(self.width), requires_grad=False)
            self.std_scale = nn.Parameter(torch.ones(self.width), requires_grad=False)
        theta = float((vision.rope_parameters or {}).get("rope_theta", 100.0))
        spatial = int(vision.head_dim) // 2
        exponents = torch.arange(0, spatial, 2, dtype=torch.float32) / spatial
        self.register_buffer("inv_freq", 1.0 / theta**exponents, persistent=False)

    def forward(self, patches: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
        h, w = grid
        device, k = patches.device, self.k
        rows, cols = (t.flatten() for t in torch.meshgrid(
            torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij"
        ))  # fmt: skip
        x = self.patch_embedder(patches, cols, rows)
        angles = torch.stack([cols, rows], -1)[..., None].float() * self.inv_freq  # [N, 2, D/4]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer in self.encoder.layers:
            x = layer(x, cos, sin)
        # HF: the block average in float32, rounded to the dtype, then scaled in float32
        blocks = x.float().view(h // k, k, w // k, k, self.width).mean(dim=(1, 3)).to(x.dtype)
        pooled = blocks.reshape(-1, self.width).float() * self.width**0.5
        if self.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return pooled.to(x.dtype)


class MultimodalEmbedder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        vision = config.vision_config
        width = int(vision.hidden_size)
        self.embedding_pre_projection_norm = UnitRMSNorm(float(vision.rms_norm_eps))
        self.embedding_projection = nn.Linear(
            width, int(config.text_config.hidden_size), bias=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))


class Gemma4ImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding (one row per soft token)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        check_config(config)
        per_layer = int(getattr(config.text_config, "hidden_size_per_layer_input", 0) or 0)
        if per_layer and get_parallel_state().pp_size > 1:  # later stages never see the images
            raise ValueError(
                "Gemma 4 images with per-layer inputs (text_config.hidden_size_per_layer_input) "
                "do not support pipeline parallelism"
            )
        self.vision_tower = VisionTower(config)
        self.embed_vision = MultimodalEmbedder(config)

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        weight = self.embed_vision.embedding_projection.weight
        out = []
        for m in images:  # each its own grid: one tower call an image
            assert m.pixel_values is not None and m.image_size is not None
            patches = m.pixel_values.to(weight.device)  # float32: the embedder casts
            out.append(self.embed_vision(self.vision_tower(patches, m.image_size)))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `[model.]vision_tower.*` and `[model.]embed_vision.*` tensors (the
        audio tower, its embedder and the text model are passed over); ValueError naming a
        missing or unexpected one."""

        def ours(name: str) -> str | None:
            name = name.removeprefix("model.")
            return name if name.startswith(("vision_tower.", "embed_vision.")) else None

        picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)


class _Gemma4Kwargs(ProcessorKwargs, total=False):
    patch_size: int
    max_soft_tokens: int
    pooling_kernel_size: int


_GEMMA4_SOFT_TOKENS = (70, 140, 280, 560, 1120)


def gemma4_size(height: int, width: int, patch: int, max_patches: int, k: int) -> tuple[int, int]:
    """transformers' get_aspect_ratio_preserving_size: the largest (height, width) in
    multiples of k * patch within max_patches patches, the aspect ratio kept."""
    factor = math.sqrt(max_patches * patch**2 / (height * width))
    unit = k * patch
    th = math.floor(factor * height / unit) * unit
    tw = math.floor(factor * width / unit) * unit
    if th == 0 and tw == 0:
        raise ValueError(f"a {height} x {width} image resizes to 0 x 0 patches of {unit}")
    longest = (max_patches // k**2) * unit
    if th == 0:
        th, tw = unit, min(math.floor(width / height) * unit, longest)
    elif tw == 0:
        th, tw = min(math.floor(height / width) * unit, longest), unit
    if th * tw > max_patches * patch**2:
        raise ValueError(f"a {height} x {width} image resizes past {max_patches} patches")
    return th, tw


class Gemma4TorchProcessor(TorchImageProcessor):
    """Gemma4ImageProcessor (its torchvision class; transformers' PIL class, which it falls
    back to, resamples differently, up to 2 / 255 apart): each image resized (bicubic, aspect
    kept) to the largest multiple of k * p a side within max_soft_tokens * k^2 patches,
    rescaled, cut into p x p patches row-major, each flattened (row, column, channel), padded
    to max_patches rows of 0. Out: pixel_values [images, max patches, p * p * 3],
    image_position_ids [images, max patches, 2] ((column, row); -1 on padding),
    num_soft_tokens_per_image."""

    name = "Gemma4ImageProcessor"
    defaults: ClassVar[dict[str, Any]] = {
        "do_resize": True,
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": False,
        "image_mean": [0.0, 0.0, 0.0],
        "image_std": [1.0, 1.0, 1.0],
        "do_convert_rgb": True,
        "patch_size": 16,
        "max_soft_tokens": 280,
        "pooling_kernel_size": 3,
    }
    valid_kwargs = _Gemma4Kwargs

    def check(self, s: dict[str, Any]) -> None:
        super().check(s)
        if s["max_soft_tokens"] not in _GEMMA4_SOFT_TOKENS:
            raise ValueError(
                f"{self.name}'s max_soft_tokens={s['max_soft_tokens']!r}: one of "
                f"{_GEMMA4_SOFT_TOKENS}"
            )

    def preprocess(self, images: list[torch.Tensor], s: dict[str, Any]) -> dict[str, Any]:
        p, k = int(s["patch_size"]), int(s["pooling_kernel_size"])
        most = int(s["max_soft_tokens"]) * k**2
        pixels, where, soft = [], [], []
        for x in images:
            if s["do_resize"]:
                x = resize(x, gemma4_size(*x.shape[-2:], p, most, k), s["resample"])
            x = normalize(x, s)
            c, h, w = x.shape
            rows = x.reshape(c, h // p, p, w // p, p).permute(1, 3, 2, 4, 0).reshape(-1, p * p * c)
            cols, lines = torch.meshgrid(torch.arange(w // p), torch.arange(h // p), indexing="xy")
            grid = torch.stack([cols, lines], dim=-1).reshape(-1, 2)
            pad = most - rows.shape[0]
            pixels.append(F.pad(rows, (0, 0, 0, pad)))
            where.append(F.pad(grid, (0, 0, 0, pad), value=-1))
            soft.append(rows.shape[0] // k**2)
        return {
            "pixel_values": torch.stack(pixels),
            "image_position_ids": torch.stack(where),
            "num_soft_tokens_per_image": torch.tensor(soft),
        }
