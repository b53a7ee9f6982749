"""PaddleOCR-VL's image path (PaddleOCRVLForConditionalGeneration): a SigLIP ViT run at each
image's native patch grid with 2D rope, a projector merging 2 x 2 patches, Qwen2-VL's M-RoPE.

    image -> the checkpoint's image processor (PaddleOCRVLImageProcessor[Pil]: resized to
        multiples of patch * merge pixels between min / max pixels, normalized, cut into h x w
        patches in row-major order) -> pixel rows [h*w, C, p, p], kept as [h*w, C*p*p]
    -> visual (`[model.]visual.vision_model`), per image, as transformers runs it:
        embeddings: patch_embedding (a Conv2d with bias whose kernel is the patch: one matmul)
            + the learned side x side position table (side = image_size / patch_size) resized
            to h x w (F.interpolate, bilinear, align_corners=False: what transformers'
            gather of four taps a patch computes)
        encoder.layers: SigLIP's pre-norm layers (vision_transformer.py's VisionLayer) whose
            attention rotates q and k by the patch's (row, column): Qwen2-VL's vision rope
            (qwen2_vl_vision.py: head_dim / 4 frequencies per axis, rotate-half, float32),
            attending over the image's patches
        post_layernorm
    -> projector (`model.projector`, the Hub's `mlp_AR`): pre_norm (LayerNorm eps 1e-5) per
        patch -> each m x m block of patches one row (blocks row-major, a block's patches
        row-major) -> linear_1 -> GELU -> linear_2 -> [(h/m) * (w/m), text hidden]
    prompt: <|IMAGE_START|> <|IMAGE_PLACEHOLDER|> x (h*w / m^2) <|IMAGE_END|>  (the processor
        repeats the chat template's lone placeholder; QwenLayout's runs)

Positions: PaddleOCRVLModel's get_rope_index is Qwen2-VL's (multimodal/mrope.py) with a
temporal grid of 1. The decoder is models/paddleocr_vl.py's.

Refused by name: vision_config.model_type other than paddleocr_vl_vision, image_size not a
multiple of patch_size, a vision rope_type other than axial (or default), an image grid not
(1, h, w) with h, w multiples of spatial_merge_size; videos (the model takes none).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal import qwen2_vl_vision as qwen
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import Loaded, Run, _shape_error
from paged_engine.multimodal.layouts_qwen import OneFrameLayout, one_frame_grid
from paged_engine.multimodal.layouts_qwen import grid_merge_size as merge_size
from paged_engine.multimodal.vision_transformer import VisionLayer, pixel_shuffle

MODEL_TYPES = frozenset({"paddleocr_vl_vision"})
_PROJECTOR_EPS = 1e-5  # transformers hard-codes the projector's pre_norm eps
# checkpoint prefix -> ours: transformers 5's names, then the Hub's
_PREFIXES = (
    ("model.visual.vision_model.", "visual."),
    ("visual.vision_model.", "visual."),
    ("model.projector.", "projector."),
    ("mlp_AR.", "projector."),
)
# the Hub's tower tensors transformers ignores at load (SigLIP's pooling head, a packing table)
_UNUSED = ("visual.head.", "visual.embeddings.packing_position_embedding.")


def patch_dim(config: Any) -> int:
    """Width of a pixel row: channels x patch x patch (one temporal patch)."""
    v = config.vision_config
    return qwen._int_field(v, "num_channels", 3) * qwen._int_field(v, "patch_size") ** 2


def _attention(
    attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """SigLIP's attention (`attn`: VisionAttention's q / k / v / out_proj) over one image's
    patches x [P, D], q and k rotated by cos / sin [P, 1, head_dim]."""
    rows = x.shape[0]
    q, k, v = (
        p(x).view(rows, attn.num_heads, attn.head_dim)
        for p in (attn.q_proj, attn.k_proj, attn.v_proj)
    )
    q, k = qwen._rotate(q, cos, sin), qwen._rotate(k, cos, sin)
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)))  # [H, P, d]
    return attn.out_proj(out.transpose(0, 1).reshape(rows, -1))


class _Layer(VisionLayer):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + _attention(self.self_attn, self.layer_norm1(x), cos, sin)
        return x + self.mlp(self.layer_norm2(x))


class _Embeddings(nn.Module):
    def __init__(self, channels: int, dim: int, patch: int, side: int) -> None:
        super().__init__()
        self.side = side
        self.patch_embedding = nn.Conv2d(channels, dim, patch, stride=patch)
        self.position_embedding = nn.Embedding(side * side, dim)

    def forward(self, pixels: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """pixels [h*w, C*p*p] (row-major patches) -> [h*w, D]."""
        weight = self.patch_embedding.weight
        x = F.linear(pixels.to(weight.dtype), weight.flatten(1), self.patch_embedding.bias)
        table = self.position_embedding.weight
        grid = table.view(self.side, self.side, -1).permute(2, 0, 1)[None].float()
        grid = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=False)
        return x + grid[0].flatten(1).T.to(x.dtype)


class _Encoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            _Layer(config) for _ in range(qwen._int_field(config, "num_hidden_layers"))
        )


class PaddleOCRVisionTower(nn.Module):
    """`visual.vision_model` of HF's PaddleOCRVLForConditionalGeneration (HF's names)."""

    def __init__(self, v: Any) -> None:
        super().__init__()
        model_type = getattr(v, "model_type", None)
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"vision_config.model_type={model_type!r} is not supported; supported: "
                f"{sorted(MODEL_TYPES)}"
            )
        dim, self.patch = qwen._int_field(v, "hidden_size"), qwen._int_field(v, "patch_size")
        size = qwen._int_field(v, "image_size")
        if size % self.patch:
            raise ValueError(
                f"vision_config.image_size={size} is not a multiple of patch_size {self.patch}"
            )
        heads = qwen._int_field(v, "num_attention_heads")
        self.head_dim = dim // heads
        self.theta = qwen._rope_theta(v)
        channels = qwen._int_field(v, "num_channels", 3)
        self.embeddings = _Embeddings(channels, dim, self.patch, size // self.patch)
        self.encoder = _Encoder(v)  # VisionAttention refuses a width not split by the heads
        self.post_layernorm = nn.LayerNorm(dim, eps=float(v.layer_norm_eps))

    def forward(self, pixels: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """One image's pixel rows [h*w, C*p*p] -> its patches' states [h*w, D]."""
        x = self.embeddings(pixels, h, w)
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        positions = torch.stack((rows.flatten(), cols.flatten()), dim=-1)  # [P, 2] row-major
        cos, sin = qwen._rotary_tables(positions, self.head_dim, self.theta, x.device)
        for layer in self.encoder.layers:
            x = layer(x, cos, sin)
        return self.post_layernorm(x)


class _Projector(nn.Module):
    def __init__(self, dim: int, text_dim: int, merge: int) -> None:
        super().__init__()
        self.merge = merge
        wide = dim * merge * merge
        self.pre_norm = nn.LayerNorm(dim, eps=_PROJECTOR_EPS)
        self.linear_1 = nn.Linear(wide, wide)
        self.act = nn.GELU()
        self.linear_2 = nn.Linear(wide, text_dim)

    def forward(self, x: torch.Tensor, h: int) -> torch.Tensor:
        """x [h*w, D] (row-major patches) -> [(h/m) * (w/m), text_dim]."""
        blocks = pixel_shuffle(self.pre_norm(x)[None], self.merge, rows=h)[0]
        return self.linear_2(self.act(self.linear_1(blocks)))


class PaddleOCRImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding, one per placeholder."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.merge = merge_size(config)
        self.visual = PaddleOCRVisionTower(config.vision_config)
        dim = int(config.vision_config.hidden_size)
        self.projector = _Projector(dim, int(config.text_config.hidden_size), self.merge)

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        out = []
        for m in images:
            h, w = one_frame_grid(m.image_size, self.merge)
            weight = self.visual.embeddings.patch_embedding.weight
            pixels = m.pixel_values.to(weight.device)  # type: ignore[union-attr]
            out.append(self.projector(self.visual(pixels, h, w), h))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The tower's and projector's tensors (transformers 5's or the Hub's names; the text
        model's are passed over); ValueError naming a missing or unexpected one."""
        return load_named_weights(self, (x for x in map(_ours, weights) if x is not None))


def _ours(item: tuple[str, torch.Tensor]) -> tuple[str, torch.Tensor] | None:
    """A checkpoint tensor under our name, or None for the text model's and unused ones."""
    name, tensor = item
    for theirs, ours in _PREFIXES:
        if name.startswith(theirs):
            name = ours + name.removeprefix(theirs)
            return None if name.startswith(_UNUSED) else (name, tensor)
    return None


class PaddleOCRLayout(OneFrameLayout):
    """Pixel rows [h*w, C*p*p] (the processor's [h*w, C, p, p] flattened), size the grid
    (1, h, w); a run of h*w / m^2 placeholders and Qwen2-VL's M-RoPE table."""

    def row_width(self) -> int:
        return patch_dim(self.config)

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])
        t, h, w = (int(v) for v in out["image_grid_thw"][0])
        pixels = out["pixel_values"].float()
        want = self.pixel_shape((t, h, w))
        if pixels.dim() != 4 or pixels.shape[0] != want[0] or pixels[0].numel() != want[1]:
            raise _shape_error(pixels, (want[0], *self._patch()))
        return pixels.reshape(want), (t, h, w)

    def _patch(self) -> tuple[int, int, int]:
        v = self.config.vision_config
        return (int(getattr(v, "num_channels", 3)), int(v.patch_size), int(v.patch_size))
