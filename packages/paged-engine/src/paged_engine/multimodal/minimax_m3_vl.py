"""MiniMax M3's image path (MiniMaxM3SparseForConditionalGeneration), as transformers runs it:

    image -> MiniMaxM3VLImageProcessor (torchvision only; `MiniMaxM3ImageProcessor` is its
        steps in torch where torchvision is missing): resized by Qwen2-VL's smart_resize rule
        to multiples of patch * merge pixels (bicubic, antialiased), normalized by CLIP's
        mean / std, cut into patch rows [h*w, 3 * tp * p * p] (the frame repeated over the
        temporal patch), each merge x merge block's rows consecutive; grid (1, h, w)
    -> the tower (`vision_tower`): Conv3d patch embedding without bias, pre LayerNorm, CLIP
        layers (LayerNorms, biased q / k / v / out projections, fc1 / GELU / fc2) attending
        within the image; a 3-D axial rope over the first 6 * (head_dim // 3 // 2) head dims:
        F = (head_dim // 3) // 2 frequencies of theta^(-2i / 2F) for each of the patch's
        (t, h, w) indices, laid out [t | h | w | t | h | w] and rotated by halves
    -> the projector (`multi_modal_projector`): linear_1, GELU, linear_2 on every patch row,
        then each merge block's m^2 rows side by side through merge_linear_1, GELU,
        merge_linear_2 -> [h*w / m^2, text hidden]
    prompt: the image token becomes "]<]start of image[>[", the image token once per merged
        patch and "]<]end of image[>[" (MiniMaxM3VLProcessor); the decoder's positions stay 1-D.

Checkpoints: transformers 5's names and the release's (`vision_tower.vision_model.*`,
`patch_merge_mlp.*`). Refused by name: other vision model types, rope types other than axial,
head sizes that do not split into heads. Videos are refused by the input processor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import Loaded, Size, digest, token_ids
from paged_engine.multimodal.layouts_qwen import Exaone45Layout
from paged_engine.multimodal.qwen2_vl_vision import (
    _group_by_length,
    _int_field,
    _PatchEmbed,
    _segment_attention,
)
from paged_engine.multimodal.torch_processors import (
    ProcessorKwargs,
    TorchImageProcessor,
    normalize,
    resize,
)

MODEL_TYPE = "minimax_m3_vl_vision"
START, END = "]<]start of image[>[", "]<]end of image[>["
_CLIP_MEAN, _CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
_DEFAULTS = {  # MiniMaxM3VLImageProcessor's class attributes
    "do_resize": True,
    "resample": 3,  # bicubic
    "size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 451584},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": _CLIP_MEAN,
    "image_std": _CLIP_STD,
    "do_convert_rgb": True,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


def smart_size(height: int, width: int, factor: int, low: int, high: int) -> tuple[int, int]:
    """(h, w), multiples of `factor` nearest the image's aspect, with low <= h * w <= high
    (transformers' smart_resize of this family)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image {height} x {width}: an aspect ratio over 200 is refused")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > high:
        beta = math.sqrt(height * width / high)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < low:
        beta = math.sqrt(low / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


class _Kwargs(ProcessorKwargs, total=False):
    size: dict[str, int]
    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int


class MiniMaxM3ImageProcessor(TorchImageProcessor):
    """MiniMaxM3VLImageProcessor's steps in torch alone: images -> pixel_values
    [sum of h * w, 3 * tp * p * p] float32 (merge blocks' rows consecutive), image_grid_thw
    [images, 3] of (1, h, w)."""

    name = "MiniMaxM3VLImageProcessor"
    defaults: ClassVar[dict[str, Any]] = {**_DEFAULTS, "min_pixels": None, "max_pixels": None}
    valid_kwargs = _Kwargs

    def check(self, s: dict[str, Any]) -> None:
        super().check(s)
        if s["size"] == [672, 672]:  # the release's stale value, which transformers replaces
            s["size"] = dict(_DEFAULTS["size"])
        size = s["size"]
        if not isinstance(size, dict) or not (
            size.get("shortest_edge") and size.get("longest_edge")
        ):
            raise ValueError(f"{self.name} size={size!r}: shortest_edge and longest_edge needed")

    def preprocess(self, images: list[torch.Tensor], s: dict[str, Any]) -> dict[str, Any]:
        p, tp, m = int(s["patch_size"]), int(s["temporal_patch_size"]), int(s["merge_size"])
        low = s["min_pixels"] or s["size"]["shortest_edge"]
        high = s["max_pixels"] or s["size"]["longest_edge"]
        out, grids = [], []
        for x in images:
            if s["do_resize"]:
                size = smart_size(*x.shape[-2:], p * m, int(low), int(high))
                x = resize(x, size, s["resample"])
            x = normalize(x, s).float()
            c, h, w = x.shape
            blocks = x.view(c, h // p // m, m, p, w // p // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
            rows = blocks.unsqueeze(5).expand(-1, -1, -1, -1, -1, tp, -1, -1)
            out.append(rows.reshape(h // p * (w // p), c * tp * p * p))
            grids.append((1, h // p, w // p))
        return {"pixel_values": torch.cat(out), "image_grid_thw": torch.tensor(grids)}


def axial_rope_theta(v: Any, model_type: str) -> float:
    """vision_config's rope_theta (10000 unset); ValueError naming the field for a model_type
    other than `model_type` or a rope_type other than "axial" (MiniMax-M3's and Inkling2's
    towers)."""
    if getattr(v, "model_type", None) != model_type:
        raise ValueError(f"vision_config.model_type={v.model_type!r}; supported: {model_type!r}")
    rope = getattr(v, "rope_parameters", None) or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision_config.rope_parameters.rope_type={rope['rope_type']!r}")
    return float(rope.get("rope_theta", 10000.0))


def rope_tables(grid: tuple[int, int, int], merge: int, dim: int, theta: float):
    """cos, sin [t*h*w, 1, 6F] float32 of one grid's patches in the processor's row order."""
    t, h, w = grid
    rows = torch.arange(h).view(h // merge, 1, merge, 1).expand(-1, w // merge, -1, merge)
    cols = torch.arange(w).view(1, w // merge, 1, merge).expand(h // merge, -1, merge, -1)
    pos = torch.stack(
        [
            torch.arange(t).repeat_interleave(h * w),
            rows.flatten().repeat(t),
            cols.flatten().repeat(t),
        ],
        dim=-1,
    )  # [P, 3]: (t, h, w), merge blocks consecutive
    spatial = 2 * ((dim // 3) // 2)
    inv_freq = 1.0 / theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial)
    angles = (pos[..., None].float() * inv_freq).flatten(1).repeat(1, 2)[:, None]
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The first cos.shape[-1] dims of x [P, H, D] rotated by halves, the rest as they are."""
    r = cos.shape[-1]
    rot, rest = x[..., :r].float(), x[..., r:]
    x1, x2 = rot.chunk(2, dim=-1)
    out = rot * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([out.to(x.dtype), rest], dim=-1)


class _Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x, cos, sin, groups: list[torch.Tensor]) -> torch.Tensor:  # x: [P, D]
        n = x.shape[0]
        q, k, v = (
            f(x).view(n, self.num_heads, -1) for f in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = _segment_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, groups)
        return self.out_proj(out.reshape(n, -1))


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = get_act_fn(act, "vision_config.hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, act: str, eps: float) -> None:
        super().__init__()
        self.self_attn = _Attention(dim, heads)
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(dim, eps), nn.LayerNorm(dim, eps)
        self.mlp = _MLP(dim, hidden, act)

    def forward(self, x, cos, sin, groups) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), cos, sin, groups)
        return x + self.mlp(self.layer_norm2(x))


class MiniMaxM3VisionTower(nn.Module):
    """`vision_tower`: patch rows [P, 3 * tp * p * p] of grids -> [P, vision hidden]."""

    def __init__(self, v: Any) -> None:
        super().__init__()
        self.theta = axial_rope_theta(v, MODEL_TYPE)
        dim, heads = _int_field(v, "hidden_size"), _int_field(v, "num_attention_heads")
        if dim % heads:
            raise ValueError(f"vision_config.num_attention_heads={heads} must divide {dim}")
        self.head_dim, self.merge = dim // heads, _int_field(v, "spatial_merge_size")
        self.embeddings = _PatchEmbed(
            _int_field(v, "num_channels"),
            _int_field(v, "temporal_patch_size"),
            _int_field(v, "patch_size"),
            dim,
            bias=False,
        )
        eps = float(v.layer_norm_eps)
        self.pre_layrnorm = nn.LayerNorm(dim, eps)
        inter, act = _int_field(v, "intermediate_size"), v.hidden_act
        depth = _int_field(v, "num_hidden_layers")
        self.layers = nn.ModuleList(_Layer(dim, heads, inter, act, eps) for _ in range(depth))

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixels))
        tables = [rope_tables(g, self.merge, self.head_dim, self.theta) for g in grids]
        cos, sin = (torch.cat(c).to(x.device) for c in zip(*tables, strict=True))
        segments, start = [], 0  # each image (all its frames) attends within itself
        for t, h, w in grids:
            segments.append(torch.arange(start, start + t * h * w))
            start += t * h * w
        groups = _group_by_length(segments)
        for layer in self.layers:
            x = layer(x, cos, sin, groups)
        return x


class MiniMaxM3Projector(nn.Module):
    """`multi_modal_projector`: [P, vision hidden] -> [P / m^2, text hidden]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        v, text = config.vision_config, int(config.text_config.hidden_size)
        hidden, self.blocks = int(config.projector_hidden_size), int(v.spatial_merge_size) ** 2
        self.linear_1 = nn.Linear(int(v.hidden_size), hidden)
        self.linear_2 = nn.Linear(hidden, text)
        self.merge_linear_1 = nn.Linear(text * self.blocks, hidden)
        self.merge_linear_2 = nn.Linear(hidden, text)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear_2(F.gelu(self.linear_1(x))).view(-1, self.merge_linear_1.in_features)
        return self.merge_linear_2(F.gelu(self.merge_linear_1(x)))


# the release's names -> transformers 5's (its conversion mapping), tried in order
_RENAMES = (
    ("vision_tower.vision_model.embeddings.patch_embedding.", "vision_tower.embeddings.proj."),
    ("vision_tower.vision_model.encoder.layers.", "vision_tower.layers."),
    ("vision_tower.vision_model.pre_layrnorm.", "vision_tower.pre_layrnorm."),
    ("patch_merge_mlp.linear_", "multi_modal_projector.merge_linear_"),
)
_OURS = ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.")


class MiniMaxM3ImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding, one per placeholder."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.vision_tower = MiniMaxM3VisionTower(config.vision_config)
        self.multi_modal_projector = MiniMaxM3Projector(config)

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        param = next(self.parameters())
        pixels = torch.cat([m.pixel_values for m in images]).to(param.device, param.dtype)
        grids = [tuple(int(x) for x in m.image_size) for m in images]  # type: ignore[union-attr]
        rows = self.multi_modal_projector(self.vision_tower(pixels, grids))  # type: ignore[arg-type]
        return list(rows.split([m.length for m in images]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str:
            name = name.removeprefix("model.")
            for theirs, ours in _RENAMES:
                name = name.replace(theirs, ours) if name.startswith(theirs) else name
            return name

        picked = ((n, w) for n, w in weights if n.removeprefix("model.").startswith(_OURS))
        return load_named_weights(self, picked, rename=rename)


class MiniMaxM3Layout(Exaone45Layout):
    """Qwen2-VL's patch rows and run by the merged grid, the run between the start and end
    tokens (the image's `ImageInput` is the run alone); 1-D positions."""

    takes_embeds = False

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        super().__init__(config, placeholder, tokenizer)
        self.bounds = token_ids(tokenizer, START, END)

    def segment(self, loaded: Loaded) -> list[int]:
        start, end = self.bounds
        return [start, *([self.placeholder] * self.length(loaded[1])), end]

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        pixels, size = loaded
        return [ImageInput(pixels, at + 1, self.length(size), digest(pixels, size), size)]

    def length(self, size: Size) -> int:
        if size is not None and len(size) == 3 and size[0] != 1:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not (1, h, w)")
        return super().length(size)
