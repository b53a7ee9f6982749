"""Step3-VL's vision tower, downsamplers and projector (`Step3VLForConditionalGeneration`,
remote code: stepfun-ai/step3; config models/step3_vl_config.py), as vLLM's step3_vl.py runs
them. One view (the 728-pixel global image or a 504-pixel patch, multimodal/step3_vl.py) at a
time, S pixels a side, p the patch size, g = S / p:

    embeddings   patch_embedding Conv2d(C, D, p, stride p, bias) -> [g*g, D] row-major; the
                 class_embedding row first; + position_embedding, a table of (728 / p)^2 + 1
                 rows whose grid part is resized to g x g (float32 bicubic, antialias, corners
                 unaligned) when g differs, the class row kept; then 3 more copies of row 0
                 in front (vLLM's pad_tp_size 4): [4 + g*g, D]
    layers       x = x + layer_norm1(attn(x)); x = x + layer_norm2(mlp(x)) (the norms AFTER
                 each sublayer, inside the residual: no CLIP / SigLIP layer computes this);
                 attn: fused qkv_proj (bias) chunked q | k | v, every row attends to every
                 row (the 4 leading copies too), head_dim^-0.5, out_proj (bias); mlp:
                 fc2(act(fc1(x))), act vision_config.hidden_act (quick_gelu)
    features     the first 4 rows dropped -> [D, g, g] -> vit_downsampler Conv2d(D, O, 2,
                 stride understand_projector_stride) -> vit_downsampler2 Conv2d(O, 2 O, 3,
                 stride 2, pad 1) -> rows row-major [n, 2 O] -> vit_large_projector Linear(2 O,
                 text hidden, bias projector_bias)

Weights: `vision_model.embeddings.*`, `vision_model.transformer.layers.N.*`, `vit_downsampler.*`,
`vit_downsampler2.*`, `vit_large_projector.*` (the decoder's `model.*` / `lm_head.*` passed
over); class_embedding as [D] or [1, D].
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.models.step3_vl_config import TOWER_TYPE
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput

_LEADING = 4  # rows before the patches: the class row and vLLM's 3 padding copies of it
_OWN = ("vision_model.", "vit_downsampler.", "vit_downsampler2.", "vit_large_projector.")


def _activation(name: str):
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    return {"gelu": F.gelu, "silu": F.silu}[name]


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv_proj = nn.Linear(dim, 3 * dim)  # rows: q | k | v, each head-major
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, L, D]
        b, n, _ = x.shape
        q, k, v = (
            t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv_proj(x).chunk(3, -1)
        )
        out = F.scaled_dot_product_attention(q, k, v)  # full attention, head_dim^-0.5
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = _activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, vision: Any) -> None:
        super().__init__()
        dim, eps = int(vision.hidden_size), float(vision.layer_norm_eps)
        self.self_attn = _Attention(dim, int(vision.num_attention_heads))
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.mlp = _Mlp(dim, int(vision.intermediate_size), vision.hidden_act)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.layer_norm1(self.self_attn(x))  # post-sublayer norms (module doc)
        return x + self.layer_norm2(self.mlp(x))


class _Embeddings(nn.Module):
    def __init__(self, vision: Any) -> None:
        super().__init__()
        dim, self.patch = int(vision.hidden_size), int(vision.patch_size)
        self.grid = int(vision.image_size) // self.patch  # the position table's grid
        self.class_embedding = nn.Parameter(torch.empty(1, dim))
        channels = int(vision.num_channels)
        self.patch_embedding = nn.Conv2d(channels, dim, self.patch, stride=self.patch)
        self.position_embedding = nn.Embedding(self.grid**2 + 1, dim)

    def positions(self, grid: int) -> torch.Tensor:
        """The position rows [1 + grid^2, D] for a grid x grid view (vLLM's get_abs_pos)."""
        table = self.position_embedding.weight
        if grid == self.grid:
            return table
        side = table[1:].view(1, self.grid, self.grid, -1).permute(0, 3, 1, 2).float()
        resized = F.interpolate(
            side, size=(grid, grid), mode="bicubic", antialias=True, align_corners=False
        )
        rows = resized.to(table.dtype).permute(0, 2, 3, 1).reshape(grid * grid, -1)
        return torch.cat([table[:1], rows])

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [B, C, S, S] -> [B, 4 + g*g, D]
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [B, g*g, D]
        grid = pixels.shape[-1] // self.patch
        cls = self.class_embedding.expand(pixels.shape[0], 1, -1)
        x = torch.cat([cls, patches], dim=1) + self.positions(grid)
        return torch.cat([x[:, :1].expand(-1, _LEADING - 1, -1), x], dim=1)


class Step3VisionTower(nn.Module):
    """vLLM's Step3VisionTransformer under the release's names (`vision_model.*`)."""

    def __init__(self, vision: Any) -> None:
        super().__init__()
        if getattr(vision, "model_type", None) != TOWER_TYPE:
            raise ValueError(f"vision_config.model_type={vision.model_type!r} is not served")
        self.embeddings = _Embeddings(vision)
        self.transformer = nn.Module()
        layers = int(vision.num_hidden_layers)
        self.transformer.layers = nn.ModuleList(_Layer(vision) for _ in range(layers))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [B, C, S, S] -> [B, g*g, D]
        x = self.embeddings(pixels)
        for layer in self.transformer.layers:
            x = layer(x)
        return x[:, _LEADING:]


class Step3VLImageEncoder(nn.Module):
    """Views -> rows of the decoder's input embedding (169 a global view, 81 a patch)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision = config.vision_config
        width, out = int(vision.hidden_size), int(vision.output_hidden_size)
        self.vision_model = Step3VisionTower(vision)
        stride = int(config.understand_projector_stride)
        self.vit_downsampler = nn.Conv2d(width, out, kernel_size=2, stride=stride)
        self.vit_downsampler2 = nn.Conv2d(out, 2 * out, kernel_size=3, stride=2, padding=1)
        hidden = int(config.text_config.hidden_size)
        self.vit_large_projector = nn.Linear(2 * out, hidden, bias=bool(config.projector_bias))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [B, C, S, S] -> [B, n, hidden]
        weight = self.vit_downsampler.weight
        x = self.vision_model(pixels.to(weight.device, weight.dtype))  # [B, g*g, D]
        b, rows, dim = x.shape
        grid = round(rows**0.5)
        x = x.transpose(1, 2).reshape(b, dim, grid, grid)
        x = self.vit_downsampler2(self.vit_downsampler(x))
        return self.vit_large_projector(x.flatten(2).transpose(1, 2))

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each view's rows [n, hidden]; views of one size run as one batch."""
        out: list[torch.Tensor | None] = [None] * len(images)
        sides: dict[tuple[int, ...], list[int]] = {}
        for i, m in enumerate(images):
            assert m.pixel_values is not None
            sides.setdefault(tuple(m.pixel_values.shape), []).append(i)
        for idx in sides.values():
            rows = self(torch.stack([images[i].pixel_values for i in idx]))  # type: ignore[misc]
            for i, r in zip(idx, rows, strict=True):
                out[i] = r
        return out  # type: ignore[return-value]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The tower's, downsamplers' and projector's tensors (the decoder's passed over);
        ValueError naming a missing or unexpected one."""
        cls = "vision_model.embeddings.class_embedding"

        def own() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(_OWN):
                    yield name, tensor.reshape(1, -1) if name == cls else tensor

        return load_named_weights(self, own())
