"""Inkling 2's image path (Inkling2ForConditionalGeneration, Inkling2LoopForConditionalGeneration),
as transformers runs it:

    image -> Inkling2ImageProcessor (torchvision only; `Inkling2TorchProcessor` is its steps in
        torch): no resize; an RGBA image composited over an 8-pixel checkerboard (204 / 153);
        padded right and down to whole `size` cells (S = patch * merge pixels) with -1 on the
        0-255 scale, normalized by mean / std 0.5, cut into one [S, S, 3] cell per text token
        in raster order; grid (1, rows, cols)
    -> the tower (`visual.backbone`): each cell's merge x merge patches (block order) through a
        bias-free linear patch embedding plus the learned [G, G] position table resampled
        bilinearly (align_corners False, border) to the image's patch grid; a class token
        (class + its position embedding) before each image's patches; ln_pre; ViT layers
        (LayerNorms, biased q / k / v / out projections, GELU MLP c_fc / c_proj, layer scales
        ls_1 / ls_2) attending within the image, a 2-D rope over interleaved channel pairs:
        F = head_dim / 4 frequencies theta^(-2i / (head_dim / 2)), the first half of the pairs
        turned by the patch's column + 1, the second by its row + 1 (the class token by 0)
    -> the merger (`visual.proj_in`, act, `visual.proj_out`) on each cell's m^2 patch states
        side by side -> one text-width row per cell
    prompt: the image token becomes one image token per cell (Inkling2Processor); the rows
        replace those tokens' (normed) embeddings; the decoder's positions stay 1-D.

Checkpoints: the release's names (`model.visual.*`, also what transformers saves) and
transformers' in-memory names (`model.vision_tower.*`). Refused by name: other vision model
types, rope types other than axial, head sizes that do not split into heads or pairs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import Layout, Loaded, Run, Size, _shape_error
from paged_engine.multimodal.minimax_m3_vl import axial_rope_theta
from paged_engine.multimodal.qwen2_vl_vision import _group_by_length, _int_field
from paged_engine.multimodal.torch_processors import (
    ProcessorKwargs,
    TorchImageProcessor,
    square_size,
)

MODEL_TYPE = "inkling2_vision"
_DEFAULTS = {  # Inkling2ImageProcessor's class attributes
    "size": {"height": 40, "width": 40},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": True,
}


def _rgb_over_checkerboard(image: Any) -> torch.Tensor:
    """A PIL image as RGB uint8 [3, H, W]; transparency over transformers' checkerboard."""
    import numpy as np

    has_alpha = getattr(image, "has_transparency_data", None)  # Pillow >= 10.1, as HF reads it
    if has_alpha is None:
        has_alpha = image.mode in ("RGBA", "RGBa", "LA", "La", "PA") or "transparency" in image.info
    x = torch.from_numpy(np.array(image.convert("RGBA" if has_alpha else "RGB"))).permute(2, 0, 1)
    if x.shape[0] != 4:
        return x.contiguous()
    h, w = x.shape[-2:]
    board = (torch.arange(h)[:, None] // 8 + torch.arange(w)[None, :] // 8) % 2
    background = torch.where(board == 0, 204, 153)
    rgba = x.to(torch.int32)
    alpha = rgba[3:4]
    return ((rgba[:3] * alpha + background * (255 - alpha) + 127) // 255).to(torch.uint8)


class _Kwargs(ProcessorKwargs, total=False):
    size: dict[str, int]


class Inkling2TorchProcessor(TorchImageProcessor):
    """Inkling2ImageProcessor's steps in torch: images -> pixel_values [cells, S, S, 3]
    float32 (raster order), image_grid_thw [images, 3] of (1, rows, cols)."""

    name = "Inkling2ImageProcessor"
    defaults: ClassVar[dict[str, Any]] = dict(_DEFAULTS)
    valid_kwargs = _Kwargs

    def load_image(self, image: Any) -> torch.Tensor:
        return _rgb_over_checkerboard(image)

    def preprocess(self, images: list[torch.Tensor], s: dict[str, Any]) -> dict[str, Any]:
        side = square_size(s, self.name)
        mean, std = torch.tensor(s["image_mean"]), torch.tensor(s["image_std"])
        out, grids = [], []
        for x in images:
            c, h, w = x.shape
            rows, cols = -(-h // side), -(-w // side)
            x = F.pad(x.float(), (0, cols * side - w, 0, rows * side - h), value=-1.0)
            if s["do_rescale"]:
                x = x * s["rescale_factor"]
            if s["do_normalize"]:
                x = (x - mean[:, None, None]) / std[:, None, None]
            cells = x.reshape(c, rows, side, cols, side).permute(1, 3, 2, 4, 0)
            out.append(cells.reshape(rows * cols, side, side, c))
            grids.append((1, rows, cols))
        return {"pixel_values": torch.cat(out), "image_grid_thw": torch.tensor(grids)}


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [P, H, D] with each channel pair (x1, x2) turned: x * cos + (-x2, x1) * sin."""
    y = x.float()
    pairs = y.view(*y.shape[:-1], -1, 2)
    turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return (y * cos + turned * sin).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x, cos, sin, groups: list[torch.Tensor]) -> torch.Tensor:  # x: [P, D]
        n = x.shape[0]
        q, k, v = (f(x).view(n, self.heads, -1) for f in (self.q_proj, self.k_proj, self.v_proj))
        q, k = _rotate_pairs(q, cos, sin), _rotate_pairs(k, cos, sin)
        out = torch.empty_like(q)
        for index in groups:  # each image (class token and patches) attends within itself
            rows = index.reshape(-1)
            qs, ks, vs = (
                t[rows].view(*index.shape, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)
            )
            o = F.scaled_dot_product_attention(qs, ks, vs)
            out[rows] = o.transpose(1, 2).reshape(rows.numel(), *q.shape[1:])
        return self.out_proj(out.reshape(n, -1))


class _Layer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, act: str, eps: float) -> None:
        super().__init__()
        self.self_attn = _Attention(dim, heads)
        self.ln_1, self.ln_2 = nn.LayerNorm(dim, eps), nn.LayerNorm(dim, eps)
        self.ls_1, self.ls_2 = nn.Module(), nn.Module()
        self.ls_1.gamma, self.ls_2.gamma = (
            nn.Parameter(torch.ones(dim)),
            nn.Parameter(torch.ones(dim)),
        )
        self.mlp = nn.Module()
        self.mlp.c_fc, self.mlp.c_proj = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = get_act_fn(act, "vision_config.hidden_act")

    def forward(self, x, cos, sin, groups) -> torch.Tensor:
        x = x + self.ls_1.gamma * self.self_attn(self.ln_1(x), cos, sin, groups)
        h = self.mlp.c_proj(self.act(self.mlp.c_fc(self.ln_2(x))))
        return x + self.ls_2.gamma * h


class Inkling2VisionTower(nn.Module):
    """`visual.backbone`: cells [N, S, S, C] of grids (1, rows, cols) -> patch states
    [N * m^2, D] (class tokens dropped), each cell's m^2 patches consecutive."""

    def __init__(self, v: Any) -> None:
        super().__init__()
        self.theta = axial_rope_theta(v, MODEL_TYPE)
        dim, heads = _int_field(v, "hidden_size"), _int_field(v, "num_attention_heads")
        if dim % heads or (dim // heads) % 4:
            raise ValueError(
                f"vision_config.num_attention_heads={heads} must split hidden_size={dim} into "
                "heads of a multiple of 4"
            )
        self.head_dim = dim // heads
        self.patch, self.merge = _int_field(v, "patch_size"), _int_field(v, "spatial_merge_size")
        self.grid, channels = _int_field(v, "posemb_grid_size"), _int_field(v, "num_channels")
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Linear(channels * self.patch**2, dim, bias=False)
        self.embeddings.position_embedding = nn.Parameter(torch.empty(self.grid**2, dim))
        self.embeddings.class_embedding = nn.Parameter(torch.zeros(dim))
        self.embeddings.cls_position_embedding = nn.Parameter(torch.zeros(dim))
        eps = float(v.layer_norm_eps)
        self.ln_pre = nn.LayerNorm(dim, eps)
        inter, act = _int_field(v, "intermediate_size"), v.hidden_act
        depth = _int_field(v, "num_hidden_layers")
        self.layers = nn.ModuleList(_Layer(dim, heads, inter, act, eps) for _ in range(depth))

    def _patch_positions(self, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, col) of each patch of a (rows, cols)-cell image, cells raster, m x m within."""
        m = self.merge
        r = torch.arange(rows)[:, None, None, None] * m + torch.arange(m)[None, None, :, None]
        c = torch.arange(cols)[None, :, None, None] * m + torch.arange(m)[None, None, None, :]
        r, c = torch.broadcast_tensors(r, c)
        return r.flatten(), c.flatten()

    def _position_rows(self, rows: int, cols: int, r, c) -> torch.Tensor:
        """The [G, G] table resampled bilinearly to the patch grid, at (r, c): [P, D]."""
        table = self.embeddings.position_embedding.float()
        table = table.view(self.grid, self.grid, -1).permute(2, 0, 1)[None]
        size = (rows * self.merge, cols * self.merge)
        grid = F.interpolate(table, size=size, mode="bilinear", align_corners=False)[0]
        return grid[:, r, c].t()

    def forward(self, cells: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        m, p = self.merge, self.patch
        c = cells.shape[-1]
        patches = cells.reshape(-1, m, p, m, p, c).transpose(2, 3).reshape(-1, c * p * p)
        embedded = self.embeddings.patch_embedding(patches)
        emb = self.embeddings
        cls = (emb.class_embedding + emb.cls_position_embedding).to(embedded.dtype)
        parts, angles_at, segments, start, offset = [], [], [], 0, 0
        inv_freq = 1.0 / self.theta ** (
            torch.arange(0, self.head_dim // 2, 2, dtype=torch.float) / (self.head_dim // 2)
        )
        for _, rows, cols in grids:
            n = rows * cols * m * m
            r, col = self._patch_positions(rows, cols)
            pos = self._position_rows(rows, cols, r, col).to(embedded)
            parts += [cls[None], embedded[offset : offset + n] + pos]
            # rope (row, col) + 1 of each patch, after the class token's (0, 0)
            angles_at.append(torch.cat([torch.zeros(1, 2), torch.stack([r, col], -1) + 1.0]))
            segments.append(torch.arange(start, start + n + 1))
            start, offset = start + n + 1, offset + n
        x = self.ln_pre(torch.cat(parts))
        hw = torch.cat(angles_at)  # [P + images, 2]: (row, col), 0 for class tokens
        freqs = hw[..., None] * inv_freq  # [P', 2, F]
        angles = torch.cat([freqs[:, 1], freqs[:, 0]], -1).repeat_interleave(2, -1)[:, None]
        cos, sin = angles.cos().to(x.device), angles.sin().to(x.device)
        groups = [g.to(x.device) for g in _group_by_length(segments)]
        for layer in self.layers:
            x = layer(x, cos, sin, groups)
        keep = torch.cat([s[1:] for s in segments]).to(x.device)
        return x[keep]


class Inkling2ImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding, one per cell."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        v = config.vision_config
        text = int(config.text_config.hidden_size)
        self.visual = nn.Module()
        self.visual.backbone = Inkling2VisionTower(v)
        self.blocks = int(v.spatial_merge_size) ** 2
        hidden, bias = _int_field(v, "projection_hidden_dim"), bool(v.projector_bias)
        self.visual.proj_in = nn.Linear(self.blocks * int(v.hidden_size), hidden, bias=bias)
        self.visual.proj_out = nn.Linear(hidden, text, bias=bias)
        self.act = get_act_fn(v.hidden_act, "vision_config.hidden_act")

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        param = next(self.parameters())
        cells = torch.cat([m.pixel_values for m in images]).to(param.device, param.dtype)
        grids = [tuple(int(x) for x in m.image_size) for m in images]  # type: ignore[union-attr]
        states = self.visual.backbone(cells, grids).reshape(cells.shape[0], -1)
        rows = self.visual.proj_out(self.act(self.visual.proj_in(states)))
        return list(rows.split([m.length for m in images]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str:
            name = name.removeprefix("model.")
            for theirs, ours in _IN_MEMORY:
                name = name.replace(theirs, ours)
            return name

        picked = (
            (n, w)
            for n, w in weights
            if n.removeprefix("model.").startswith(("visual.", "vision_tower."))
        )
        return load_named_weights(self, picked, rename=rename)


# transformers' in-memory names -> the release's (ours)
_IN_MEMORY = (
    ("vision_tower.merger.linear_1.", "visual.proj_in."),
    ("vision_tower.merger.linear_2.", "visual.proj_out."),
    ("vision_tower.pre_layernorm.", "visual.backbone.ln_pre."),
    ("vision_tower.", "visual.backbone."),
    ("embeddings.position_embedding.weight", "embeddings.position_embedding"),
    ("layernorm_before.", "ln_1."),
    ("layernorm_after.", "ln_2."),
    ("mlp.fc1.", "mlp.c_fc."),
    ("mlp.fc2.", "mlp.c_proj."),
    ("lambda_1", "ls_1.gamma"),
    ("lambda_2", "ls_2.gamma"),
)


class Inkling2Layout(Layout):
    """A run of one placeholder per cell (rows * cols), pixels [cells, S, S, 3]; 1-D positions."""

    takes_embeds = False

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        v = config.vision_config
        self.config, self.placeholder, self.fixed = config, placeholder, None
        self.side = _int_field(v, "patch_size") * _int_field(v, "spatial_merge_size")
        self.channels = _int_field(v, "num_channels")

    def length(self, size: Size) -> int:
        if size is None or len(size) != 3 or size[0] != 1 or min(size) <= 0:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not (1, h, w)")
        return int(size[1]) * int(size[2])

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        return (self.length(size), self.side, self.side, self.channels)

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])
        t, h, w = (int(x) for x in out["image_grid_thw"][0])
        pixels = out["pixel_values"].float()
        if tuple(pixels.shape) != self.pixel_shape((t, h, w)):
            raise _shape_error(pixels, self.pixel_shape((t, h, w)))
        return pixels, (t, h, w)
