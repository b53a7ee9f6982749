"""Ovis2's image path (Ovis2ForConditionalGeneration, transformers' models/ovis2): an AIMv2-style
tower over fixed-size tiles, a probabilistic visual vocabulary (the visual tokenizer's
distribution times a visual embedding table) into the Qwen2 decoder (served through
models/text_wrappers.py; 1-D positions).

    image -> Ovis2ImageProcessor(Pil) with crop_to_patches: a (rows, cols) grid of tiles of the
        tower's image_size (the grid covering 90% of the image with the fewest tiles, or the
        closest aspect ratio), and for more than one tile the whole image resized first (the
        thumbnail): pixels [tiles, 3, S, S] (multimodal/ovis2_layout.py)
    -> vision_tower.transformer (transformers' Ovis2VisionTransformer, its weight names):
        patch_embedding (a Conv2d) -> RMSNorm -> + the learned position table (never resized:
        every tile is S x S) -> layers: x += attention(rms_norm1(x)) (bidirectional, no rope,
        q / k / v / out_proj with qkv_bias), x += SwiGLU(rms_norm2(x)) (gate / up / down_proj
        with mlp_bias) -> rms_norm
    -> hidden_stride x hidden_stride neighbouring patches concatenated (row-major blocks) ->
       head_linear (no bias) -> head_norm (LayerNorm) -> tokenize_function over the
       vocab_size - num_visual_indicator_tokens visual tokens: softmax (in the logits' dtype,
       as transformers runs it) or st_argmax (the straight-through one-hot: hard - soft + soft)
    -> visual_embeddings_table [vocab_size, hidden]: probs @ its visual rows (transformers pads
       the indicators' columns with zeros first: the same sum)
    prompt (Ovis2Processor.replace_image_token): each "<image>" of the text becomes
        <IMG_START> atoms(thumbnail or only tile) <IMG_GRID>
        [for more than one tile: per row, per column: atoms(tile), <IMG_COL> between columns;
         <IMG_ROW> between rows] <IMG_END>
    with image_seq_length (= tile_tokens) <IMG_ATOM> per tile. transformers puts the visual rows
    on the IMG_ATOM positions in order and the table's indicator rows vocab_size - n + i on
    visual_indicator_token_ids[i] (START, GRID, COL, ROW, END); the whole segment is the image's
    span here and `encode` gives a row for each of its tokens.

vLLM serves the remote-code release (architecture "Ovis", its processor's max_partition being
max_patches here) with the same tower, visual tokenizer and indicators; this is transformers'
port of it, by its weight names and config fields (the remote-code checkpoints are not read).

Refused by name: tokenize_function gumbel_argmax (transformers samples Gumbel noise on every
call, so no output is reproducible), a patch grid (image_size / patch_size) that is not a
multiple of hidden_stride (transformers' padding of it fails), fewer than five indicator ids or
tokens, a non-square image_size, a visual table narrower or wider than the text model. A
prompt text holding these <IMG_*> tokens itself is refused where its images are spliced in
(transformers' model would overwrite them with the indicator rows too).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput

ARCH = "Ovis2ForConditionalGeneration"
# the tokens of an image's segment, in visual_indicator_token_ids' order; ATOM is the image token
INDICATORS = ("<IMG_START>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>", "<IMG_END>")
START, GRID, COL, ROW, END = range(5)
ATOM = -1
_TOKENIZE = ("softmax", "st_argmax")


def tile_side(config: Any) -> int:
    """The tower's tile side in pixels (vision_config.image_size; square)."""
    size = config.vision_config.image_size
    if isinstance(size, (list, tuple)):
        if len(size) != 2 or size[0] != size[1]:
            raise ValueError(f"vision_config.image_size={list(size)} is not square")
        size = size[0]
    return int(size)


def _patch(config: Any) -> int:
    p = config.vision_config.patch_size
    return int(p[0] if isinstance(p, (list, tuple)) else p)


def check_config(config: Any) -> None:
    """ValueError naming the field where the checkpoint's images would not run as transformers
    runs them."""
    v = config.vision_config
    if v.tokenize_function not in _TOKENIZE:
        raise ValueError(
            f"vision_config.tokenize_function={v.tokenize_function!r}: one of {_TOKENIZE} "
            "(gumbel_argmax samples noise on every image: no output is reproducible)"
        )
    grid, stride = tile_side(config) // _patch(config), int(v.hidden_stride)
    if stride < 1 or grid % stride:
        raise ValueError(
            f"vision_config.hidden_stride={v.hidden_stride} does not divide the {grid} x {grid} "
            "patch grid (image_size / patch_size): transformers' padding of it fails"
        )
    ids = list(config.visual_indicator_token_ids)
    if len(ids) != len(INDICATORS) or int(v.num_visual_indicator_tokens) < len(INDICATORS):
        raise ValueError(
            f"visual_indicator_token_ids={ids} / vision_config.num_visual_indicator_tokens="
            f"{v.num_visual_indicator_tokens}: Ovis2 images need the five {INDICATORS}"
        )
    text = int(config.text_config.hidden_size)
    if int(config.hidden_size) != text:
        raise ValueError(
            f"hidden_size={config.hidden_size} (the visual embedding table's width) is not "
            f"text_config.hidden_size={text}"
        )


def tile_tokens(config: Any) -> int:
    """Image tokens (<IMG_ATOM>) per tile: the patch grid in hidden_stride blocks."""
    grid = tile_side(config) // _patch(config)
    return (grid // int(config.vision_config.hidden_stride)) ** 2


def segment_kinds(rows: int, cols: int, per_tile: int) -> list[int]:
    """An image's segment as Ovis2Processor writes it: ATOM for an image token, else the index
    of its indicator (START, GRID, COL, ROW, END); the first tile is the thumbnail where the
    grid holds more than one."""
    out = [START, *[ATOM] * per_tile, GRID]
    if rows * cols > 1:
        for r in range(rows):
            for c in range(cols):
                out += [ATOM] * per_tile
                if c < cols - 1:
                    out.append(COL)
            if r < rows - 1:
                out.append(ROW)
    return [*out, END]


def tiles_of(rows: int, cols: int) -> int:
    return rows * cols + 1 if rows * cols > 1 else 1


def segment_length(rows: int, cols: int, per_tile: int) -> int:
    """len(segment_kinds(rows, cols, per_tile)), without listing it (a client's grid may be
    huge: it is checked against the pixels before any list is made)."""
    if rows * cols == 1:
        return per_tile + 3
    return per_tile + 3 + rows * cols * per_tile + rows * (cols - 1) + rows - 1


class _RMSNorm(nn.Module):
    """transformers' Ovis2RMSNorm: normalized in float32, scaled in the input's dtype."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = x.float()
        return self.weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)).to(
            x.dtype
        )


class _Attention(nn.Module):
    def __init__(self, v: Any) -> None:
        super().__init__()
        d, heads, bias = int(v.hidden_size), int(v.num_attention_heads), bool(v.qkv_bias)
        if d % heads:
            raise ValueError(
                f"vision_config.hidden_size={d} is not a multiple of num_attention_heads={heads}"
            )
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            nn.Linear(d, d, bias=bias) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, L, D]: every patch sees its tile
        n, length, d = x.shape
        q, k, v = (
            p(x).view(n, length, self.heads, -1).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(n, length, d))


class _SwiGLU(nn.Module):
    def __init__(self, v: Any) -> None:
        super().__init__()
        d, inner, bias = int(v.hidden_size), int(v.intermediate_size), bool(v.mlp_bias)
        self.gate_proj = nn.Linear(d, inner, bias=bias)
        self.up_proj = nn.Linear(d, inner, bias=bias)
        self.down_proj = nn.Linear(inner, d, bias=bias)
        self.act = get_act_fn(v.hidden_act, "vision_config.hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, v: Any) -> None:
        super().__init__()
        d, eps = int(v.hidden_size), float(v.rms_norm_eps)
        self.attention = _Attention(v)
        self.ffn = _SwiGLU(v)
        self.rms_norm1 = _RMSNorm(d, eps)
        self.rms_norm2 = _RMSNorm(d, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.rms_norm1(x))
        return x + self.ffn(self.rms_norm2(x))


class _Embeddings(nn.Module):
    def __init__(self, v: Any, side: int, patch: int) -> None:
        super().__init__()
        d = int(v.hidden_size)
        self.patch_embedding = nn.Conv2d(int(v.num_channels), d, patch, stride=patch)
        self.rms_norm = _RMSNorm(d, float(v.rms_norm_eps))
        self.position_embedding = nn.Embedding((side // patch) ** 2, d)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:  # [N, C, S, S] -> [N, L, D]
        x = self.patch_embedding(tiles.to(self.patch_embedding.weight.dtype))
        return self.rms_norm(x.flatten(2).transpose(1, 2)) + self.position_embedding.weight


class _Encoder(nn.Module):
    def __init__(self, v: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(v) for _ in range(int(v.num_hidden_layers)))


class _Transformer(nn.Module):
    def __init__(self, v: Any, side: int, patch: int) -> None:
        super().__init__()
        self.embeddings = _Embeddings(v, side, patch)
        self.encoder = _Encoder(v)
        self.rms_norm = _RMSNorm(int(v.hidden_size), float(v.rms_norm_eps))

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(tiles)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.rms_norm(x)


class Ovis2VisionTower(nn.Module):
    """transformers' Ovis2VisionModel: tiles [N, 3, S, S] -> the visual tokenizer's
    distribution [N, tile_tokens, vocab_size - num_visual_indicator_tokens]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        v = config.vision_config
        self.side, patch = tile_side(config), _patch(config)
        self.grid, self.stride = self.side // patch, int(v.hidden_stride)
        self.function = v.tokenize_function
        self.transformer = _Transformer(v, self.side, patch)
        visual = int(v.vocab_size) - int(v.num_visual_indicator_tokens)
        self.head_linear = nn.Linear(int(v.hidden_size) * self.stride**2, visual, bias=False)
        self.head_norm = nn.LayerNorm(visual)  # eps 1e-5, as transformers builds it

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        x = self.transformer(tiles)  # [N, g * g, D], patches row-major
        n, d, g, s = x.shape[0], x.shape[-1], self.grid, self.stride
        # s x s blocks of neighbouring patches, blocks row-major, each block's patches row-major
        x = x.view(n, g // s, s, g // s, s, d).permute(0, 1, 3, 2, 4, 5)
        logits = self.head_norm(self.head_linear(x.reshape(n, (g // s) ** 2, s * s * d)))
        soft = torch.softmax(logits, dim=-1)
        if self.function == "softmax":
            return soft
        hard = torch.zeros_like(soft).scatter_(-1, soft.argmax(-1, keepdim=True), 1.0)
        return hard - soft + soft  # st_argmax: transformers' straight-through value


class Ovis2ImageEncoder(nn.Module):
    """Images -> one row per token of each image's segment (`segment_kinds` order): the visual
    rows on its atoms, the table's indicator rows on its indicators. An ImageInput holds the
    image's tiles [tiles, 3, S, S] and its grid (rows, cols) as image_size."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        check_config(config)
        v = config.vision_config
        self.vision_tower = Ovis2VisionTower(config)
        self.visual_embeddings_table = nn.Embedding(int(v.vocab_size), int(config.hidden_size))
        self.visual = int(v.vocab_size) - int(v.num_visual_indicator_tokens)
        self.per_tile = tile_tokens(config)

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        table = self.visual_embeddings_table.weight
        tiles = torch.cat([m.pixel_values for m in images])  # type: ignore[misc]
        probs = self.vision_tower(tiles.to(table.device))  # [N, T, visual]
        rows = (probs @ table[: self.visual]).flatten(0, 1)  # [N * T, hidden]
        marks = table[self.visual : self.visual + len(INDICATORS)]
        counts = [m.pixel_values.shape[0] * self.per_tile for m in images]  # type: ignore[union-attr]
        out = []
        for m, part in zip(images, rows.split(counts), strict=True):
            assert m.image_size is not None and len(m.image_size) == 2, m.image_size
            listed = segment_kinds(*m.image_size, self.per_tile)
            assert listed.count(ATOM) == part.shape[0], (m.image_size, part.shape)  # its tiles
            kinds = torch.tensor(listed, device=table.device)
            atoms = kinds == ATOM
            seg = marks[kinds.clamp(min=0)]  # indicator rows; the atoms' filled in order
            seg[atoms] = part.to(seg.dtype)
            out.append(seg)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's vision_tower.* and visual_embeddings_table tensors (transformers'
        names, with or without `model.`); any other name is passed over; ValueError naming a
        missing or unexpected one."""
        own = ("vision_tower.", "visual_embeddings_table.")

        def picked() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.removeprefix("model.")
                if name.startswith(own):
                    yield name, tensor

        return load_named_weights(self, picked())
