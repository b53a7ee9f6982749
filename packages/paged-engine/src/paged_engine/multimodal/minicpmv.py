"""MiniCPM-V 4.6 / 4.7's image path (MiniCPMV4_6ForConditionalGeneration,
MiniCPMV4_7ForConditionalGeneration): a SigLIP-style tower run at each view's own patch grid, a
window-attention merger inside it, and an MLP merger; built on Idefics2's path (a tower at the
view's size, bucketed position ids), with these differences.

    image -> MiniCPMV4_6ImageProcessor (PIL or torchvision): a thumbnail resized to a grid that
        the merges divide, and with slice_mode a rows x cols grid of slices of the image
        (get_sliced_grid); pixels NaViT-packed [3, p, views' patches * p], patches row-major
    each view (h x w patches) -> the tower, as transformers runs it:
        patch conv + position_embedding(ids): row i / h and column j / w bucketized into the
            side x side table (side = image_size / patch_size; no clamp, unlike Idefics2's)
        SigLIP layers 0 .. insert_layer_id over the view's patches (bidirectional)
        vit_merger (downsample_mode "16x"): x += attn(layer_norm1(x)) within each 2 x 2
            window (no position terms); each window's 4 rows (row-major) concatenated -> pre_norm
            -> linear_1 -> gelu(tanh) -> linear_2, plus the mean of the 4 rows: (h/2) x (w/2)
        the remaining layers over the merged rows, then post_layernorm
    -> merger.mlp[0]: 2 x 2 blocks concatenated -> LayerNorm (eps 1e-6) -> linear_1 -> exact
       gelu -> linear_2 into the text width: h * w / 16 rows ("4x": no vit_merger, h * w / 4)
    prompt (MiniCPMV4_6Processor, 4.7's alike for images): the k-th image token of a prompt
        (0-based) becomes <image_id>k</image_id><image> run </image>, then each row of slices
        as <slice> run </slice> ... joined by "\n" (`use_image_id` off: no <image_id> part)
    decoder: Qwen3.5's text model (models/text_wrappers.py's wrapper as it is)
        4.6: at plain 1-D positions (the wrapper passes none: every M-RoPE row the index)
        4.7: canvas M-RoPE (t, h, w) from the prompt's ids (`canvas_positions`): text 1-D; a
            frame (thumbnail + its slices) on a canvas of rows * slice h x cols * slice w
            merged rows from the next text position o: slices at their offsets, the thumbnail
            stretched over the canvas (float32 linspace, rounded), <image> at (o, o-1, o-1),
            </image> at the far corner, <slice> / </slice> at a slice's corners, a row's "\n"
            past its right edge, every other token of the frame (the markers after it
            included) at o; text after it from o + max(canvas) + 1; generated tokens p + delta

A view is one `ImageInput` (image_size = its patch grid (h, w), a 4.7 thumbnail's (h, w, tail);
pixels [3, p, h * w * p]), so the runs of one image are apart, as Idefics3's tiles are.
transformers runs all views of a prompt as one packed sequence with per-view attention
(cu_seqlens): each view alone here.

Refused by name: vision_config.window_kernel_size and merge_kernel_size other than (2, 2)
(transformers' merges hard-code a 4-row concatenation), merger_times other than 1 (the
processor's runs assume one merge), downsample_mode other than "16x" / "4x", insert_layer_id
outside the tower's layers, and for 4.7 an unset slice_start_id / slice_end_id /
image_start_id / image_end_id / newline_id. Videos are not run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.vision_transformer import VisionAttention, VisionLayer

ARCHS = ("MiniCPMV4_6ForConditionalGeneration", "MiniCPMV4_7ForConditionalGeneration")
# the processor's tokenizer attributes and the tokens they default to
MARKERS = {
    "image_start_token": "<image>",
    "image_end_token": "</image>",
    "slice_start_token": "<slice>",
    "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>",
    "image_id_end_token": "</image_id>",
}


def _pair(value: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),) * 2


def check_config(config: Any) -> None:
    """ValueError naming the first field this path does not run."""
    vision = config.vision_config
    for name, value in (
        ("vision_config.window_kernel_size", vision.window_kernel_size),
        ("merge_kernel_size", config.merge_kernel_size),
    ):
        if _pair(value) != (2, 2):
            raise ValueError(f"{name}={value} is not supported (transformers merges 2 x 2)")
    if int(config.merger_times) != 1:
        raise ValueError(f"merger_times={config.merger_times} is not supported (only 1)")
    if config.downsample_mode not in ("16x", "4x"):
        raise ValueError(f"downsample_mode={config.downsample_mode!r} is not '16x' or '4x'")
    layers = int(vision.num_hidden_layers)
    if config.downsample_mode == "16x" and not 0 <= int(vision.insert_layer_id) < layers:
        raise ValueError(
            f"insert_layer_id={vision.insert_layer_id} is not a layer of the {layers}-layer tower"
        )


def merge_factor(config: Any) -> int:
    """Patches a side per text row: 4 ("16x": the vit_merger's 2 x 2, then the merger's)."""
    return 4 if config.downsample_mode == "16x" else 2


def view_tokens(config: Any, h: int, w: int) -> int:
    """Placeholders of an h x w patch view; ValueError unless the merges divide its grid."""
    f = merge_factor(config)
    if h <= 0 or w <= 0 or h % f or w % f:
        raise ValueError(f"multi_modal_data['image']: a {h} x {w} patch view is not in {f}s")
    return h * w // (f * f)


def image_segment(
    runs: Sequence[int],
    rows: int,
    cols: int,
    placeholder: int,
    ids: dict[str, int],
    newline: list[int],
) -> list[int]:
    """The tokens after the <image_id> part: the thumbnail's run (runs[0]) in <image> ...
    </image>, then rows x cols slice runs in <slice> ... </slice>, rows joined by "\\n"."""
    out = [ids["image_start_token"], *[placeholder] * runs[0], ids["image_end_token"]]
    for r in range(rows):
        if r:
            out += newline
        for n in runs[1 + r * cols : 1 + (r + 1) * cols]:
            out += [ids["slice_start_token"], *[placeholder] * n, ids["slice_end_token"]]
    return out


def _canvas_grid(
    origin: int, grid: Sequence[int], merge: int, canvas: tuple[int, int], offset: tuple[int, int]
) -> np.ndarray:
    """[3, rows] (t, h, w) of a crop's rows on its canvas: transformers' float32 linspace over
    the canvas (its own grid where `canvas` is (0, 0)), rounded half to even."""
    gh, gw = grid[0] // merge, grid[1] // merge
    ch, cw = canvas[0] or gh, canvas[1] or gw
    hs = torch.linspace(0, ch - 1, gh).round().long().numpy() + offset[0]
    ws = torch.linspace(0, cw - 1, gw).round().long().numpy() + offset[1]
    hh, ww = np.meshgrid(hs, ws, indexing="ij")
    return np.stack([np.zeros_like(hh), hh, ww]).reshape(3, -1) + origin


def canvas_positions(
    ids: Sequence[int],
    placeholder: int,
    grids: Sequence[Sequence[int]],
    markers: Sequence[int],
    merge: int,
) -> np.ndarray:
    """MiniCPM-V 4.7's canvas M-RoPE table [3, len(ids)] (t, h, w) of one prompt whose crops
    (runs of `placeholder`, their patch grids `grids` in order) sit between `markers` = (slice
    start, slice end, image start, image end, newline): MiniCPMV4_7Model.get_rope_index for
    one unpadded image sequence, step by step. A frame is a thumbnail and the slices after it
    (a crop behind <slice>); frames with only markers between share a group; a frame's end runs
    on over the markers after it."""
    n, marks, slice_start = len(ids), set(markers), markers[0]
    crops, at = [], 0
    while at < n:
        if ids[at] != placeholder:
            at += 1
            continue
        end = at
        while end < n and ids[end] == placeholder:
            end += 1
        crops.append((at, end))
        at = end
    groups: list[tuple[int, list[tuple[int, int, list[tuple[int, int]]]]]] = []
    slices: list[tuple[int, int]] | None = None
    last = 0
    for a, b in crops:
        if slices is not None and ids[a - 1] == slice_start:
            slices.append((a, b))
        else:
            slices = []
            if groups and all(t in marks for t in ids[last : a - 1]):
                groups[-1][1].append((a, b, slices))
            else:
                groups.append((a - 1, [(a, b, slices)]))
        last = b

    def frame_end(e: int) -> int:
        while e < n and ids[e] in marks:
            e += 1
        return e

    table = np.zeros((3, n), dtype=np.int64)
    grid_iter = iter(grids)
    pos = idx = 0
    for group_start, frames in groups:
        spans = [(a, b, frame_end(sl[-1][1] if sl else b), sl) for a, b, sl in frames]
        group_end = spans[-1][2]
        if group_start > idx:
            table[:, idx:group_start] = np.arange(group_start - idx) + pos
            pos += group_start - idx
        cursor = group_start
        for a, b, end, sl in spans:
            thumb, start = next(grid_iter), a - 1
            if start > cursor:  # text between two frames of a group; one step more after it
                table[:, cursor:start] = np.arange(start - cursor) + pos
                pos += start - cursor + 1
            end = min(end, group_end)
            origin = pos
            sh = sw = rows = cols = 0
            canvas = (thumb[0] // merge, thumb[1] // merge)
            if sl:  # slices row-major; a gap over 2 tokens (a newline) ends a row
                cols = len(sl)
                for k in range(len(sl) - 1):
                    if sl[k + 1][0] - sl[k][1] > 2:
                        cols = k + 1
                        break
                rows = len(sl) // cols if cols > 0 else 1
                if rows * cols != len(sl):
                    rows, cols = 1, len(sl)
                first = next(grid_iter)
                sh, sw = first[0] // merge, first[1] // merge
                canvas = (rows * sh, cols * sw)
            table[:, start:end] = origin
            table[1:, start] = max(origin - 1, 0)  # <image>: just outside the canvas
            if b < end:  # </image>: the far corner
                table[1, b], table[2, b] = origin + canvas[0], origin + canvas[1]
            table[:, a:b] = _canvas_grid(origin, thumb, merge, canvas, (0, 0))
            for k, (c, d) in enumerate(sl):
                off = ((k // cols) * sh, (k % cols) * sw)
                grid = first if k == 0 else next(grid_iter)
                gh, gw = grid[0] // merge, grid[1] // merge
                if c - 1 >= start:
                    table[1, c - 1], table[2, c - 1] = origin + off[0], origin + off[1]
                if d < end:
                    table[1, d] = origin + off[0] + gh - 1
                    table[2, d] = origin + off[1] + gw - 1
                table[:, c:d] = _canvas_grid(origin, grid, merge, (0, 0), off)
            for k in range(len(sl) - 1):  # a row's newline: just past its right edge
                if sl[k + 1][0] - sl[k][1] > 2:
                    table[1, sl[k][1] + 1 : sl[k + 1][0] - 1] = origin + (k // cols + 1) * sh - 1
                    table[2, sl[k][1] + 1 : sl[k + 1][0] - 1] = origin + cols * sw
            pos = origin + max(canvas) + 1
            cursor = end
        if cursor < group_end:
            table[:, cursor:group_end] = np.arange(group_end - cursor) + pos
            pos += group_end - cursor
        idx = group_end
    if idx < n:
        table[:, idx:] = np.arange(n - idx) + pos
    return table


def find_segments(ids: list[int], segments: list[list[int]], placeholder: int) -> list[int] | None:
    """Where each segment starts in `ids`, in order, when the prompt holds them all already and
    no other placeholder (an HF processor's ids); else None."""
    if sum(s.count(placeholder) for s in segments) != ids.count(placeholder):
        return None
    starts, at = [], 0
    for segment in segments:
        while ids[at : at + len(segment)] != segment:
            at += 1
            if at + len(segment) > len(ids):
                return None
        starts.append(at)
        at += len(segment)
    return starts


def position_ids(h: int, w: int, side: int) -> torch.Tensor:
    """transformers' get_vision_nearest_position_ids for one h x w view (float32 i / h,
    bucketized by an arange of boundaries, no clamp)."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    bucket_h = torch.bucketize(torch.arange(h) / h, boundaries, right=True)
    bucket_w = torch.bucketize(torch.arange(w) / w, boundaries, right=True)
    return (bucket_h[:, None] * side + bucket_w[None, :]).flatten()


def blocks(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[N, h * w, D] (row-major) -> [N, h/2 * w/2, 4, D]: each 2 x 2 block's rows row-major,
    blocks row-major."""
    n, _, d = x.shape
    x = x.view(n, h // 2, 2, w // 2, 2, d).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(n, (h // 2) * (w // 2), 4, d)


class _Embeddings(nn.Module):
    def __init__(self, vision: Any) -> None:
        super().__init__()
        d, self.patch = int(vision.hidden_size), int(vision.patch_size)
        self.side = int(vision.image_size) // self.patch
        self.patch_embedding = nn.Conv2d(int(vision.num_channels), d, self.patch, self.patch)
        self.position_embedding = nn.Embedding(self.side**2, d)

    def forward(self, pixels: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """[N, 3, p, h * w * p] (NaViT-packed views) -> [N, h * w, D]."""
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        ids = position_ids(h, w, self.side).to(x.device)
        return x.flatten(2).transpose(1, 2) + self.position_embedding(ids)


class _Encoder(nn.Module):
    def __init__(self, vision: Any) -> None:
        super().__init__()
        layers = int(vision.num_hidden_layers)
        self.layers = nn.ModuleList(VisionLayer(vision) for _ in range(layers))


class WindowMerger(nn.Module):
    """`vit_merger`: attention within each 2 x 2 window, then the window's 4 rows into one."""

    def __init__(self, vision: Any) -> None:
        super().__init__()
        d, inner = int(vision.hidden_size), int(vision.intermediate_size)
        eps = vision.layer_norm_eps
        self.self_attn = VisionAttention(d, int(vision.num_attention_heads))
        self.layer_norm1 = nn.LayerNorm(d, eps=eps)
        self.pre_norm = nn.LayerNorm(4 * d, eps=eps)
        self.linear_1 = nn.Linear(4 * d, 4 * inner)
        self.linear_2 = nn.Linear(4 * inner, d)

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """[N, h * w, D] -> [N, h/2 * w/2, D]."""
        n, _, d = x.shape
        windows = blocks(x, h, w).reshape(-1, 4, d)  # [N * windows, 4, D]
        normed = blocks(self.layer_norm1(x), h, w).reshape(-1, 4, d)
        windows = windows + self.self_attn(normed)  # a window sees only its own 4 rows
        hidden = F.gelu(self.linear_1(self.pre_norm(windows.flatten(1))), approximate="tanh")
        out = self.linear_2(hidden)
        return (out + windows.mean(1)).view(n, -1, d)


class Tower(nn.Module):
    """`vision_tower` (transformers' weight names), run over views of one patch grid."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision = config.vision_config
        self.embeddings = _Embeddings(vision)
        self.encoder = _Encoder(vision)
        self.vit_merger = WindowMerger(vision)
        self.post_layernorm = nn.LayerNorm(int(vision.hidden_size), eps=vision.layer_norm_eps)
        # the layer after which the vit_merger runs; -1: never ("4x")
        self.insert = int(vision.insert_layer_id) if config.downsample_mode == "16x" else -1

    def forward(self, pixels: torch.Tensor, h: int, w: int) -> tuple[torch.Tensor, int, int]:
        """[N, 3, p, h * w * p] -> ([N, rows, D], the grid of the rows)."""
        x = self.embeddings(pixels, h, w)
        for i, layer in enumerate(self.encoder.layers):
            x = layer(x)  # each view alone: transformers' cu_seqlens split
            if i == self.insert:
                x, h, w = self.vit_merger(x, h, w), h // 2, w // 2
        return self.post_layernorm(x), h, w


class DownsampleMLP(nn.Module):
    def __init__(self, width: int, out: int) -> None:
        super().__init__()
        self.pre_norm = nn.LayerNorm(4 * width, eps=1e-6)
        self.linear_1 = nn.Linear(4 * width, 4 * width)
        self.linear_2 = nn.Linear(4 * width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(self.pre_norm(x))))


class Merger(nn.Module):
    """`merger` (merger_times 1): 2 x 2 blocks of the tower's rows into the text width."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        width, out = int(config.vision_config.hidden_size), int(config.text_config.hidden_size)
        self.mlp = nn.ModuleList([DownsampleMLP(width, out)])

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """[N, h * w, D] -> [N, h/2 * w/2, text hidden]."""
        return self.mlp[0](blocks(x, h, w).flatten(2))


class MiniCPMVImageEncoder(nn.Module):
    """Views -> rows of the text model's input embedding, one per placeholder."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        check_config(config)
        self.vision_tower = Tower(config)
        self.merger = Merger(config)

    def forward(self, pixels: torch.Tensor, h: int, w: int) -> torch.Tensor:
        return self.merger(*self.vision_tower(pixels, h, w))

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each view's rows; views of one patch grid run as one batch."""
        weight = self.merger.mlp[0].linear_2.weight
        out: list[torch.Tensor | None] = [None] * len(images)
        by_grid: dict[tuple[int, ...], list[int]] = {}
        for i, m in enumerate(images):
            assert m.pixel_values is not None and m.image_size is not None
            by_grid.setdefault(tuple(m.image_size[:2]), []).append(i)
        for (h, w), group in by_grid.items():
            pixels = torch.stack([images[i].pixel_values for i in group])  # type: ignore[misc]
            rows = self(pixels.to(weight.device, weight.dtype), h, w)
            for i, r in zip(group, rows, strict=True):
                out[i] = r
        return out  # type: ignore[return-value]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `[model.]vision_tower.*` and `[model.]merger.*` tensors (any
        other name is passed over); ValueError naming a missing or unexpected one."""

        def ours(name: str) -> str | None:
            name = name.removeprefix("model.")
            return name if name.startswith(("vision_tower.", "merger.")) else None

        picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)
