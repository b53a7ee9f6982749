"""Ovis 2.5's image path (Ovis2_5ForConditionalGeneration): a SigLIP2-NaViT tower over packed
patches with Qwen2.5-VL's 2-D rotary and windows, then a probabilistic visual vocabulary
(softmax over visual tokens times an embedding table) into the Qwen3 decoder (served through
models/text_wrappers.py; 1-D positions, as transformers runs it with position_ids None).

    image -> Ovis2_5ImageProcessorPil: Qwen2-VL's smart resize to multiples of patch * merge
        pixels (an image under the factor widened first), patch rows [h * w, 3 * p * p] in
        merge-block order, grid (1, h, w)
    -> vision_tower (transformers' Ovis2_5VisionModel, its weight names):
        patch_embedding (a Conv2d with bias, one matmul on the flat patch)
        + the learned side x side position table resized to h x w (bicubic, align_corners=False,
          as F.interpolate; in merge-block order)
        -> layers: SigLIP's (layer_norm1, q/k/v/out_proj, layer_norm2, fc1 -> act -> fc2) with
           Qwen2.5-VL's 2-D rope on q and k (head_dim / 4 row and column frequencies, float32),
           each layer over the whole image (layer_types "full_attention") or within windows of
           window_size pixels ("window_attention")
        -> the last layer's output as transformers' get_image_features reads it
           (hidden_states[-1]): before post_layernorm, and with each image's merged tokens in
           window order (windows row-major, tokens row-major in each), the order its
           placeholders take them in
    -> visual_tokenizer (transformers' multi_modal_projector.visual_tokenizer): merge x merge
       patches concatenated -> linear (no bias) -> LayerNorm -> softmax in float32 over the
       vocab_size - 4 visual tokens
    -> vte, the visual embedding table [vocab_size, text hidden]: probs @ its visual rows
    prompt (Ovis2_5Processor): each image token becomes
        image_start_token  image_token x (h * w / merge^2)  image_end_token
    the start and end tokens' embeddings are vte's indicator rows vocab_size - 4 and
    vocab_size - 3 (not the text table's): the whole segment is the image's span.

Weights: the Hub's names (visual_tokenizer.vit.vision_model.*, visual_tokenizer.head.{0,1},
vte; what transformers saves too) or transformers' (vision_tower.*, multi_modal_projector.*,
its visual_embeddings_table.weight the transpose of vte.weight).

The Qwen2.5-VL pieces (rotary tables, windows, segment attention) are qwen2_vl_vision.py's; the
SigLIP layer is vision_transformer.py's with a rotary attention. transformers permutes the
sequence into window order before the layers; each window and each image holds the same
patches either way, so the layers run in the input's order here (see qwen2_vl_vision.py) and
only the features read out are put in window order, where transformers' hidden_states[-1]
leaves them (its permutation back applies to last_hidden_state alone).

Refused by name: vision_config.temporal_patch_size other than 1, layer_types other than
full_attention / window_attention, an image_size that is not a multiple of patch_size,
num_visual_indicator_tokens under 2, rope_parameters.rope_type other than axial. Videos are
refused by the engine (not one of its video models).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.qwen2_vl_vision import (
    QwenVisionEncoder,
    _check_grids,
    _frame_segments,
    _head_dim,
    _rope_theta,
    _rotary_tables,
    _rotate,
    _segment_attention,
)
from paged_engine.multimodal.vision_transformer import VisionAttention, VisionLayer

ARCH = "Ovis2_5ForConditionalGeneration"
_LAYER_TYPES = ("full_attention", "window_attention")


def check_config(config: Any) -> None:
    """ValueError naming the field where the checkpoint's images would not run as
    transformers runs them."""
    v = config.vision_config
    if int(getattr(v, "temporal_patch_size", 1)) != 1:
        raise ValueError(f"vision_config.temporal_patch_size={v.temporal_patch_size}: 1")
    bad = [t for t in v.layer_types if t not in _LAYER_TYPES]
    if bad or len(v.layer_types) != int(v.num_hidden_layers):
        raise ValueError(
            f"vision_config.layer_types={v.layer_types!r}: one of {_LAYER_TYPES} per layer"
        )
    if int(v.num_visual_indicator_tokens) < 2:
        raise ValueError(
            f"vision_config.num_visual_indicator_tokens={v.num_visual_indicator_tokens}: the "
            "image start and end indicators need 2"
        )


def merge_size(config: Any) -> int:
    return int(config.vision_config.spatial_merge_size)


def patch_dim(config: Any) -> int:
    v = config.vision_config
    return int(v.num_channels) * int(v.patch_size) ** 2


def tokens(config: Any, grid: tuple[int, ...]) -> int:
    """Image tokens of a patch grid (t, h, w), without the start and end tokens."""
    t, h, w = grid
    return t * h * w // merge_size(config) ** 2


class _RotaryAttention(VisionAttention):
    """SigLIP's attention over packed patches [P, D], rope on q and k, within segments."""

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:
        rows = x.shape[0]
        q, k, v = (
            p(x).view(rows, self.num_heads, self.head_dim)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = _segment_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, groups)
        return self.out_proj(out.reshape(rows, -1))


class _Layer(VisionLayer):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.self_attn = _RotaryAttention(config.hidden_size, config.num_attention_heads)

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), cos, sin, groups)
        return x + self.mlp(self.layer_norm2(x))


class _Embeddings(nn.Module):
    def __init__(self, v: Any) -> None:
        super().__init__()
        d, p = int(v.hidden_size), int(v.patch_size)
        self.side = int(v.image_size) // p
        if self.side * p != int(v.image_size):
            raise ValueError(
                f"vision_config.image_size={v.image_size} is not a multiple of patch_size={p}"
            )
        self.patch_embedding = nn.Conv2d(int(v.num_channels), d, p, stride=p)
        self.position_embedding = nn.Embedding(self.side**2, d)

    def positions(self, h: int, w: int, merge: int) -> torch.Tensor:
        """[h * w, D]: the table resized to h x w (bicubic), in merge-block order."""
        table = self.position_embedding.weight.view(self.side, self.side, -1)
        grid = F.interpolate(
            table.permute(2, 0, 1)[None].float(), (h, w), mode="bicubic", align_corners=False
        )[0]  # [D, h, w]
        blocks = grid.view(-1, h // merge, merge, w // merge, merge).permute(1, 3, 2, 4, 0)
        return blocks.reshape(h * w, -1).to(table.dtype)

    def forward(
        self, pixels: torch.Tensor, grids: list[tuple[int, int, int]], merge: int
    ) -> torch.Tensor:  # [P, C * p * p] -> [P, D]
        weight = self.patch_embedding.weight  # [D, C, p, p]: the flat patch is (C, p, p)
        x = F.linear(pixels.to(weight.dtype), weight.flatten(1), self.patch_embedding.bias)
        pos = [self.positions(h, w, merge).repeat(t, 1) for t, h, w in grids]
        return x + torch.cat(pos)


class Ovis2_5VisionTower(nn.Module):
    """transformers' Ovis2_5VisionModel: patch rows [P, 3 * p * p] (images concatenated) ->
    the features get_image_features reads [P, D] (see `forward`)."""

    # Qwen2.5-VL's index rules (they read self.merge and self.window)
    _positions = QwenVisionEncoder._positions
    _windows = QwenVisionEncoder._windows

    def __init__(self, v: Any) -> None:
        super().__init__()
        d, heads = int(v.hidden_size), int(v.num_attention_heads)
        self.head_dim = _head_dim(v, d, heads)
        self.rope_theta = _rope_theta(v)
        self.merge, self.patch = int(v.spatial_merge_size), int(v.patch_size)
        self.window = int(v.window_size) // self.merge // self.patch
        if self.window < 1:
            raise ValueError(
                f"vision_config.window_size={v.window_size} is under one merged token "
                f"({self.merge * self.patch} pixels)"
            )
        self.full = [t == "full_attention" for t in v.layer_types]
        self.row_width = int(v.num_channels) * self.patch**2
        self.embeddings = _Embeddings(v)
        self.layers = nn.ModuleList(_Layer(v) for _ in range(int(v.num_hidden_layers)))
        # loaded, never run: transformers' image features are read before it
        self.post_layernorm = nn.LayerNorm(d, eps=v.layer_norm_eps)

    def forward(self, pixels: torch.Tensor, grid_thw: Sequence[tuple[int, ...]]) -> torch.Tensor:
        grids = _check_grids(pixels, grid_thw, self.merge, self.row_width)
        x = self.embeddings(pixels, grids, self.merge)
        device = x.device
        cos, sin = _rotary_tables(self._positions(grids), self.head_dim, self.rope_theta, device)
        frames = [g.to(device) for g in _frame_segments(grids)]
        windows = [g.to(device) for g in self._windows(grids)] if not all(self.full) else []
        for full, layer in zip(self.full, self.layers, strict=True):
            x = layer(x, cos, sin, frames if full else windows)
        # transformers' features: the last layer's output (hidden_states[-1]: before
        # post_layernorm), its merged tokens in window order
        m2 = self.merge**2
        return x.view(-1, m2, x.shape[-1])[self._window_order(grids).to(device)].view(x.shape)

    def _window_order(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Merged-token indices in transformers' window order: per image and frame, windows
        row-major, tokens row-major within each (get_vision_window_index's window_index)."""
        size, out, start = self.window, [], 0
        for t, h, w in grids:
            bh, bw = h // self.merge, w // self.merge
            nh, nw = -(-bh // size), -(-bw // size)
            token = torch.arange(t * bh * bw)
            frame, row, col = token // (bh * bw), token // bw % bh, token % bw
            key = (frame * nh + row // size) * nw + col // size
            out.append(torch.argsort(key, stable=True) + start)
            start += t * bh * bw
        return torch.cat(out)


class _VisualTokenizer(nn.Module):
    def __init__(self, v: Any) -> None:
        super().__init__()
        self.merged = int(v.hidden_size) * int(v.spatial_merge_size) ** 2
        self.visual_vocab = int(v.vocab_size) - int(v.num_visual_indicator_tokens)
        self.linear = nn.Linear(self.merged, self.visual_vocab, bias=False)
        self.norm = nn.LayerNorm(self.visual_vocab)  # eps 1e-5, as transformers builds it

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [P, D] -> [P / m^2, V - 4]
        logits = self.norm(self.linear(x.reshape(-1, self.merged)))
        return torch.softmax(logits, dim=-1, dtype=torch.float32).to(logits.dtype)


# checkpoint names (the Hub's, which transformers also saves; or transformers' own, without
# `model.`) -> ours
_RENAMES = (
    ("visual_tokenizer.vit.vision_model.encoder.layers.", "vision_tower.layers."),
    ("visual_tokenizer.vit.vision_model.", "vision_tower."),
    ("visual_tokenizer.head.0.", "visual_tokenizer.linear."),
    ("visual_tokenizer.head.1.", "visual_tokenizer.norm."),
    ("multi_modal_projector.visual_tokenizer.", "visual_tokenizer."),
    ("multi_modal_projector.visual_embeddings_table.", "vte."),  # [H, V]: transposed
    ("vision_tower.", "vision_tower."),
    ("vte.", "vte."),
)


def _ours(name: str) -> tuple[str, bool] | None:
    """(our name, whether the tensor is transformers' transposed table), or None for a name
    that is not the encoder's."""
    name = name.removeprefix("model.")
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old) :], old.startswith("multi_modal_projector.visual_e")
    return None


class Ovis2_5ImageEncoder(nn.Module):
    """Images -> [start indicator, visual rows, end indicator] per image, one row per token of
    its prompt segment. `vte` is the Hub's visual embedding table [vocab_size, text hidden]
    (transformers' visual_embeddings_table.weight transposed): a row per visual token, the
    last num_visual_indicator_tokens the indicators."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        check_config(config)
        v = config.vision_config
        self.vision_tower = Ovis2_5VisionTower(v)
        self.visual_tokenizer = _VisualTokenizer(v)
        self.vte = nn.Embedding(int(v.vocab_size), int(config.text_config.hidden_size))

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        table = self.vte.weight
        pixels = torch.cat([m.pixel_values for m in images])  # type: ignore[misc]
        grids = [tuple(int(x) for x in m.image_size) for m in images]  # type: ignore[union-attr]
        probs = self.visual_tokenizer(self.vision_tower(pixels.to(table.device), grids))
        # the indicators' probabilities are 0: the visual rows of the table alone
        rows = probs @ table[: self.visual_tokenizer.visual_vocab]
        first = self.visual_tokenizer.visual_vocab  # <img>, </img>: the first two indicators
        parts = rows.split([m.length - 2 for m in images])
        return [
            torch.cat([table[first : first + 1], p, table[first + 1 : first + 2]]) for p in parts
        ]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's tower, visual tokenizer and table tensors, by the Hub's names or
        transformers' (any other name is passed over); ValueError naming a missing or
        unexpected one."""

        def picked() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                found = _ours(name)
                if found is not None:
                    yield found[0], tensor.t() if found[1] else tensor

        return load_named_weights(self, picked())
