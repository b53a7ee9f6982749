"""Llama 4's image path (Llama4ForConditionalGeneration: Scout, Maverick), as transformers runs it.

    image -> the checkpoint's image processor (Llama4ImageProcessor): resized without distortion
        onto the best canvas of rows x cols tiles of S x S (at most max_patches tiles), padded,
        cut into tiles; with more than one tile, the whole image squeezed to S x S ("global")
        last; pixels [tiles, 3, S, S]
    prompt: each <|image|> a user writes becomes (Llama4Processor's layout, every piece a
        special token, so tokens are spliced, not text)
        <|image_start|> [per row: tile runs split by <|tile_x_separator|>, then
        <|tile_y_separator|>] <|image|> <|patch|> x n <|image_end|>
      the row part only when the image has more than one tile
    each tile -> vision_model (below) -> multi_modal_projector.linear_1 (no bias)
        -> n = (S / patch)^2 * pixel_shuffle_ratio^2 rows, one per <|patch|>

How this tower differs from the ViTs of vision_transformer.py (whose attention it reuses):
    patch_embedding   unfold + linear (no bias): a conv of kernel = stride = patch
    CLS token         appended after the patches, not before; positional_embedding_vlm is one
                      learned row per token (CLS last), then layernorm_pre
    layers            pre-LayerNorm (input_layernorm / post_attention_layernorm, eps 1e-5 as HF
                      builds them whatever norm_eps says), q / k / v / o with biases, two-way
                      attention scaled by head_dim^-0.5, fc1 -> GELU (exact, whatever
                      hidden_act says) -> fc2
    2-D rope          interleaved pairs (Meta's complex form), float32: pair j < head_dim / 4
                      turns by (col + 1) * f_j, the next head_dim / 4 pairs by (row + 1) * f_j,
                      f_j = theta^(-4j / head_dim); the CLS token does not turn
    after the layers  layernorm_post, CLS dropped, pixel shuffle (1 / pixel_shuffle_ratio = s:
                      each s x s block of patches one row, block row-major, features
                      (a * s + b) * D + d for patch (s * I + a, s * J + b)), then
                      vision_adapter.mlp: fc1 (no bias) -> GELU -> fc2 (no bias) -> GELU

The image processor: transformers' Llama4ImageProcessor where torchvision imports, else
`Llama4TorchProcessor` here (multimodal/torch_processors.py's table), its steps in torch alone:
    canvas      transformers' find_supported_resolutions / get_best_fit: the canvases of at
                most max_patches tiles, the least upscaling (float32 scales), else the least
                downscaling, ties to the smallest area; upscaled at most to one tile's side
                (unless resize_to_max_canvas)
    resize      aspect kept (floor of the limiting side's scale), bilinear with antialias on the
                uint8 image, padded right / bottom with 0 to the canvas
    normalize   in bfloat16: x * rescale_factor, then (x - mean) / std (Meta's order)
    tiles       rows x cols row-major, then (more than one) the whole image resized to S x S

Refused by name: vision_config.pixel_shuffle_ratio whose inverse is not an integer dividing the
patch grid, widths that do not chain (intermediate_size != hidden_size * s^2,
projector_input_dim != projector_output_dim, projector_output_dim != vision_output_dim), a
non-square image_size / patch_size. Image features as input (vLLM's image_embeds) are not taken.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.torch_processors import (
    ProcessorKwargs,
    TorchImageProcessor,
    resize,
    square_size,
)
from paged_engine.multimodal.vision_transformer import VisionAttention

ARCH = "Llama4ForConditionalGeneration"
START, END, IMAGE = "<|image_start|>", "<|image_end|>", "<|image|>"
TILE_X, TILE_Y = "<|tile_x_separator|>", "<|tile_y_separator|>"
_LN_EPS = 1e-5  # nn.LayerNorm's default: every norm of HF's Llama4VisionModel


def _side(vision: Any, name: str) -> int:
    value = getattr(vision, name)
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"vision_config.{name}={value} is not square")
        value = value[0]
    return int(value)


def shuffle_scale(config: Any) -> int:
    """s = 1 / pixel_shuffle_ratio: patches merged per side into one feature row."""
    vision = config.vision_config
    ratio = float(vision.pixel_shuffle_ratio)
    s = round(1 / ratio) if ratio > 0 else 0
    grid = _side(vision, "image_size") // _side(vision, "patch_size")
    if s < 1 or abs(s * ratio - 1) > 1e-6 or grid % s:
        raise ValueError(
            f"vision_config.pixel_shuffle_ratio={ratio} must be 1 / s for an integer s dividing "
            f"the tower's {grid} patches a side"
        )
    return s


def tile_tokens(config: Any) -> int:
    """n: placeholders (= feature rows) of one tile."""
    vision = config.vision_config
    grid = _side(vision, "image_size") // _side(vision, "patch_size")
    return (grid // shuffle_scale(config)) ** 2


def image_tokens(rows: int, cols: int, n: int, patch: int, ids: dict[str, int]) -> list[int]:
    """The token ids an image's <|image|> becomes for a rows x cols tiling (Llama4Processor's
    _prompt_split_image); `ids` maps START, END, IMAGE, TILE_X, TILE_Y to their ids."""
    out = [ids[START]]
    if rows * cols > 1:
        for _ in range(rows):
            for c in range(cols):
                out += [patch] * n
                if c < cols - 1:
                    out.append(ids[TILE_X])
            out.append(ids[TILE_Y])
    return [*out, ids[IMAGE], *([patch] * n), ids[END]]


def _rope_angles(vision: Any) -> torch.Tensor:
    """[grid^2 + 1, head_dim / 2] float32: each token's angle per rotated pair (CLS last: 0)."""
    grid = _side(vision, "image_size") // _side(vision, "patch_size")
    head_dim = int(vision.hidden_size) // int(vision.num_attention_heads)
    if head_dim % 4:
        raise ValueError(
            f"vision_config.hidden_size / num_attention_heads = {head_dim} must be a multiple "
            "of 4 (rope: head_dim / 4 pairs per axis)"
        )
    rope = getattr(vision, "rope_parameters", None) or {}
    theta = float(rope.get("rope_theta", 10000.0))
    half = head_dim // 2
    freq = 1.0 / theta ** (torch.arange(0, half, 2)[: half // 2].float() / half)
    idx = torch.arange(grid * grid)
    cols, rows = (idx % grid + 1).float(), (idx // grid + 1).float()
    angles = torch.cat([cols[:, None] * freq, rows[:, None] * freq], dim=-1)
    return torch.cat([angles, angles.new_zeros(1, half)])


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, L, D] turned pairwise (x[2i], x[2i+1]) in float32; cos, sin [L, D / 2]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


class _Attention(VisionAttention):
    """VisionAttention with the 2-D rope on q and k; HF's o_proj is out_proj here."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, length, _ = x.shape  # [N, L, D]
        q, k, v = (
            p(x).view(n, length, self.num_heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(_turn(q, cos, sin), _turn(k, cos, sin), v)
        return self.out_proj(out.transpose(1, 2).reshape(n, length, -1))


class _MLP(nn.Module):
    def __init__(self, width: int, inner: int, bias: bool, act_after: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, inner, bias=bias)
        self.fc2 = nn.Linear(inner, inner if act_after else width, bias=bias)
        self.act_after = act_after  # the adapter's GELU after fc2 too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc2(F.gelu(self.fc1(x)))
        return F.gelu(x) if self.act_after else x


class _Layer(nn.Module):
    def __init__(self, vision: Any) -> None:
        super().__init__()
        hidden = int(vision.hidden_size)
        self.input_layernorm = nn.LayerNorm(hidden, eps=_LN_EPS)
        self.self_attn = _Attention(hidden, int(vision.num_attention_heads))
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=_LN_EPS)
        self.mlp = _MLP(hidden, int(vision.intermediate_size), bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _PatchEmbedding(nn.Module):
    def __init__(self, channels: int, patch: int, hidden: int) -> None:
        super().__init__()
        self.patch = patch
        self.linear = nn.Linear(channels * patch * patch, hidden, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, C, S, S] -> [N, L, D]
        return self.linear(F.unfold(pixels, self.patch, stride=self.patch).transpose(1, 2))


class _Encoder(nn.Module):  # the checkpoint's `vision_model.model.layers` nesting
    def __init__(self, vision: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(vision) for _ in range(int(vision.num_hidden_layers)))


class _Adapter(nn.Module):  # vision_adapter: pixel shuffle, then its MLP
    def __init__(self, vision: Any, scale: int) -> None:
        super().__init__()
        self.scale = scale
        width, out = int(vision.projector_input_dim), int(vision.projector_output_dim)
        if int(vision.intermediate_size) != int(vision.hidden_size) * scale**2 or width != out:
            raise ValueError(
                f"vision_config.intermediate_size={vision.intermediate_size} must be "
                f"hidden_size * {scale**2} (the shuffled width) and projector_input_dim="
                f"{width} equal projector_output_dim={out}, as HF's adapter chains them"
            )
        self.mlp = _MLP(int(vision.intermediate_size), width, bias=False, act_after=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, grid^2, D] -> [N, n, out]
        n, length, dim = x.shape
        s, blocks = self.scale, round(length**0.5) // self.scale
        x = x.view(n, blocks, s, blocks, s, dim).permute(0, 1, 3, 2, 4, 5)
        return self.mlp(x.reshape(n, blocks * blocks, s * s * dim))


class VisionModel(nn.Module):
    """HF's Llama4VisionModel (weight names kept): tiles -> the adapter's rows."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision = config.vision_config
        hidden, patch = int(vision.hidden_size), _side(vision, "patch_size")
        tokens = (_side(vision, "image_size") // patch) ** 2 + 1
        self.patch_embedding = _PatchEmbedding(int(vision.num_channels), patch, hidden)
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.positional_embedding_vlm = nn.Parameter(torch.empty(tokens, hidden))
        self.layernorm_pre = nn.LayerNorm(hidden, eps=_LN_EPS)
        self.layernorm_post = nn.LayerNorm(hidden, eps=_LN_EPS)
        self.model = _Encoder(vision)
        self.vision_adapter = _Adapter(vision, shuffle_scale(config))
        angles = _rope_angles(vision)  # float32 whatever the module's dtype
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S]
        x = self.patch_embedding(pixels)
        x = torch.cat([x, self.class_embedding.expand(x.shape[0], 1, -1)], dim=1)
        x = self.layernorm_pre(x + self.positional_embedding_vlm)
        cos, sin = self.rope_cos.float(), self.rope_sin.float()
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.vision_adapter(self.layernorm_post(x)[:, :-1])


class _Projector(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        width = int(config.vision_config.vision_output_dim)
        if width != int(config.vision_config.projector_output_dim):
            raise ValueError(
                f"vision_config.vision_output_dim={width} must equal projector_output_dim="
                f"{config.vision_config.projector_output_dim} (the adapter feeds the projector)"
            )
        self.linear_1 = nn.Linear(width, int(config.text_config.hidden_size), bias=False)


class Llama4ImageEncoder(nn.Module):
    """Tiles -> rows of the text model's input embedding, one per <|patch|>."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.tile_tokens = tile_tokens(config)
        self.vision_model = VisionModel(config)
        self.multi_modal_projector = _Projector(config)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, n, D]
        return self.multi_modal_projector.linear_1(self.vision_model(pixels))

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        weight = self.multi_modal_projector.linear_1.weight
        pixels = torch.stack([m.pixel_values for m in images])  # type: ignore[misc]
        return list(self(pixels.to(weight.device, weight.dtype)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `[model.]vision_model.*` and `[model.]multi_modal_projector.*`
        tensors (any other name is passed over); ValueError naming a missing or unexpected
        one."""

        def ours(name: str) -> str | None:
            name = name.removeprefix("model.")
            if not name.startswith(("vision_model.", "multi_modal_projector.")):
                return None
            return name.replace(".self_attn.o_proj.", ".self_attn.out_proj.")

        picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)


class _Llama4Kwargs(ProcessorKwargs, total=False):
    size: dict[str, int]
    max_patches: int
    resize_to_max_canvas: bool


def llama4_canvases(max_patches: int, side: int) -> torch.Tensor:
    """transformers' find_supported_resolutions: [n, 2] (height, width) canvases of tiles, in
    its order (tile counts down from max_patches, grouped by aspect ratio)."""
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for chunks in range(max_patches, 0, -1):
        pairs = [(i, chunks // i) for i in range(1, int(chunks**0.5) + 1) if chunks % i == 0]
        factors = sorted({f for pair in pairs for f in pair})
        for h in factors:
            by_ratio.setdefault(h / (chunks // h), []).append((h, chunks // h))
    return torch.tensor([(h * side, w * side) for v in by_ratio.values() for h, w in v])


def llama4_best_fit(size: tuple[int, int], canvases: torch.Tensor, to_max: bool) -> torch.Tensor:
    """transformers' get_best_fit (float32 scales, as it computes them): (height, width)."""
    scale_w = canvases[:, 1] / size[1]
    scale_h = canvases[:, 0] / size[0]
    scales = torch.where(scale_h > scale_w, scale_w, scale_h)
    up = scales[scales >= 1]
    if len(up) > 0:
        chosen = torch.max(up) if to_max else torch.min(up)
    else:
        chosen = torch.max(scales[scales < 1])
    fits = canvases[scales == chosen]
    return fits[torch.argmin(fits[:, 0] * fits[:, 1])] if len(fits) > 1 else fits[0]


def _no_distortion(size: tuple[int, int], target: tuple[Any, Any]) -> tuple[int, int]:
    """transformers' get_max_res_without_distortion; `target` may hold 0-d int64 tensors (as
    transformers passes them), whose float32 scales it keeps."""
    (h, w), (th, tw) = size, target
    scale_w, scale_h = tw / w, th / h
    if scale_w < scale_h:
        return int(min(math.floor(h * scale_w), th)), int(tw)
    return int(th), int(min(math.floor(w * scale_h), tw))


class Llama4TorchProcessor(TorchImageProcessor):
    """Llama4ImageProcessor: each image resized (aspect kept, downscaled as little as possible,
    upscaled only to one tile side) onto its best canvas of rows x cols tiles of S x S (at most
    max_patches), padded right / bottom with 0, rescaled and normalized in bfloat16, cut into
    tiles row-major; with more than one tile the whole image resized to S x S last.
    Out: pixel_values [tiles of all images, 3, S, S] bfloat16, aspect_ratios [images, 2]."""

    name = "Llama4ImageProcessor"
    defaults: ClassVar[dict[str, Any]] = {
        "do_resize": True,
        "size": {"height": 336, "width": 336},
        "resample": 2,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
        "max_patches": 16,
        "resize_to_max_canvas": False,
    }
    valid_kwargs = _Llama4Kwargs

    def check(self, s: dict[str, Any]) -> None:
        super().check(s)
        square_size(s, self.name)
        if not s["do_resize"]:
            raise ValueError(f"{self.name}'s do_resize=False is not supported (nor by HF's)")

    def _normalize(self, x: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
        if s["do_rescale"] and s["do_normalize"]:  # as Meta's code: in bfloat16
            x = x.to(torch.bfloat16) * s["rescale_factor"]
            mean = torch.tensor(s["image_mean"], dtype=torch.bfloat16)[:, None, None]
            std = torch.tensor(s["image_std"], dtype=torch.bfloat16)[:, None, None]
            return (x - mean) / std
        if s["do_rescale"]:
            return x * s["rescale_factor"]
        if s["do_normalize"]:  # transformers' torchvision normalize refuses the uint8 image
            raise ValueError(f"{self.name}: do_normalize without do_rescale is not supported")
        return x

    def preprocess(self, images: list[torch.Tensor], s: dict[str, Any]) -> dict[str, Any]:
        side = square_size(s, self.name)
        canvases = llama4_canvases(int(s["max_patches"]), side)
        to_max = bool(s["resize_to_max_canvas"])
        tiles, ratios = [], []
        for x in images:
            h, w = x.shape[-2:]
            target = llama4_best_fit((h, w), canvases, to_max)
            if to_max:
                bound: tuple[Any, Any] = (target[0], target[1])
            else:  # upscaled at most to one tile's side
                bound = (min(max(h, side), target[0]), min(max(w, side), target[1]))
            nh, nw = _no_distortion((h, w), bound)
            out = resize(x, (max(nh, 1), max(nw, 1)), s["resample"])
            th, tw = int(target[0]), int(target[1])
            out = F.pad(out, (0, tw - out.shape[-1], 0, th - out.shape[-2]))
            out = self._normalize(out, s)
            rows, cols = th // side, tw // side
            grid = out.view(3, rows, side, cols, side).permute(1, 3, 0, 2, 4)
            tiles.append(grid.reshape(rows * cols, 3, side, side))
            if rows * cols > 1:
                whole = self._normalize(resize(x, (side, side), s["resample"]), s)
                tiles.append(whole[None])
            ratios.append((rows, cols))
        return {"pixel_values": torch.cat(tiles), "aspect_ratios": torch.tensor(ratios)}
