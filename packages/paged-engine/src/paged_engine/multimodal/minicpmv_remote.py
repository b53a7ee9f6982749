"""MiniCPM-V 2.5 / 2.6 / 4.0 / 4.5 as the Hub ships them (`MiniCPMV`, remote code; vLLM's
registry name, its minicpmv.py): the image processor, prompt and encoder. The config: models/
minicpmv_remote_config.py; the decoder: Llama 3 (2.5) / Qwen2 (2.6) / Llama (4.0: MiniCPM4-3B
as vLLM runs it) / Qwen3 (4.5) under `llm.` (models/text_wrappers.py's row). 4.0's images are
2.6's: the same prompt and resampler.

    image (PIL RGB, W x H) -> grid = sliced_grid: n = min(ceil(W H / res^2), max_slice_nums)
        slices; None where n <= 1; else among n - 1, n, n + 1 (not 1, at most max_slice_nums)
        the cols x rows closest to log(W / H) (the first found on a tie: fewer slices, then
        fewer cols)
    thumbnail: best_resize to ~res^2 at the image's aspect ratio, sides in multiples of patch
        (upscaled only when unsliced); slices: the image resized to cols x rows cells of
        best_resize(cell) (always upscaled), cut row-major (multimodal/minicpm_ocr.py's sizes
        with merge 1); PIL bicubic; x / 255, (x - mean) / std
    prompt: the k-th "(<image>./</image>)" of the text (0-based) -> <image_id>k</image_id>
        (use_image_id) <image> query_num x <unk> </image>, then rows of <slice> query_num x
        <unk> </slice> joined by "\\n" (multimodal/minicpmv.py's image_segment); the text
        between tokenized apart (special tokens split it in the remote processor as well)
        2.5 (vLLM's MiniCPMV2_5, the release's get_grid_placeholder): no <image_id>; the
        thumbnail as above, then one <slice> ... </slice> around the rows of <image>
        query_num x <unk> </image> joined by "\\n" (legacy_segment)
    each view (h x w patches) -> `vpm`: SigLIP-400M as Idefics2's tower at the view's grid
        (bucketed position ids of a 70 x 70 table, post_layernorm; multimodal/idefics2.py);
        2.5 passes the tower no target sizes: the view goes in as one row of h w patches
        (row-major, the release's reshape_by_patch), its ids bucketed along that row
    -> `resampler` (Resampler2_5, 2.5 to 4.0; 4.5's Resampler4_5): kv_proj (no bias; none when the
        widths match) -> ln_kv; query_num learned queries through ln_q; one multi-head
        attention of hidden // 128 heads, a 2-D sin-cos table [h, w, hidden] (the first half
        of the features the column's, the second the row's) added to its keys (2.6, 4.0) or to its
        values (4.5); ln_post, @ proj -> query_num rows of the text width

A view is one `ImageInput` (image_size (h, w), pixels [3, h p, w p]). Refused by name: any
mm_processor_kwargs, an image processor setting the releases do not use (slice_mode false, a
patch_size other than the tower's), a tokenizer whose "<unk>" is not config.image_token_id,
image embeddings as input. Videos are not run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.idefics2 import Tower
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import (
    Layout,
    Loaded,
    Run,
    Size,
    _shape_error,
    digest,
    run_starts,
    token_ids,
)
from paged_engine.multimodal.minicpm_ocr import best_resize

PATTERN = "(<image>./</image>)"  # vLLM's image placeholder text (get_placeholder_str)
UNK = "<unk>"
LEGACY = "2.5"  # the version with 2.0's prompt schema and its tower fed rows of patches
MARKERS = {  # multimodal/minicpmv.py's marker names -> the release tokenizer's tokens
    "image_start_token": "<image>",
    "image_end_token": "</image>",
    "slice_start_token": "<slice>",
    "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>",
    "image_id_end_token": "</image_id>",
}
_DEFAULTS: dict[str, Any] = {  # the release's preprocessor_config.json
    "max_slice_nums": 9,
    "scale_resolution": 448,
    "patch_size": 14,
    "slice_mode": True,
    "use_image_id": True,
    "norm_mean": [0.5, 0.5, 0.5],
    "norm_std": [0.5, 0.5, 0.5],
}


def sliced_grid(width: int, height: int, max_slices: int, res: int) -> tuple[int, int] | None:
    """(cols, rows) of slices, or None where the image fits in one view (2.6's rule)."""
    n = min(math.ceil(width * height / (res * res)), max_slices)
    if n <= 1:
        return None
    log_ratio = math.log(width / height)
    best, error = (1, 1), float("inf")
    for count in (n - 1, n, n + 1):
        if count == 1 or count > max_slices:
            continue
        for cols in range(1, count + 1):
            if count % cols:
                continue
            e = abs(log_ratio - math.log(cols / (count // cols)))
            if e < error:  # strictly: the first candidate keeps a tie
                best, error = (cols, count // cols), e
    return best


def legacy_segment(
    runs: Sequence[int],
    rows: int,
    cols: int,
    placeholder: int,
    ids: dict[str, int],
    newline: list[int],
) -> list[int]:
    """2.5's tokens of an image: each view's run in <image> ... </image>, the slices' rows
    (runs[1:], rows x cols) joined by "\\n" inside one <slice> ... </slice>."""

    def view(n: int) -> list[int]:
        return [ids["image_start_token"], *[placeholder] * n, ids["image_end_token"]]

    out = view(runs[0])
    if rows * cols == 0:
        return out
    out.append(ids["slice_start_token"])
    for r in range(rows):
        out += newline if r else []
        for n in runs[1 + r * cols : 1 + (r + 1) * cols]:
            out += view(n)
    return [*out, ids["slice_end_token"]]


def patch_row(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """[N, 3, h p, w p] -> [N, 3, p, h w p]: the view's patches side by side, row-major (the
    2.5 release's reshape_by_patch), so a tower sees a 1 x h w grid."""
    n, c, height, width = pixels.shape
    h, w = height // patch, width // patch
    x = pixels.view(n, c, h, patch, w, patch).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(n, c, patch, h * w * patch)


def _ensure_divide(length: float, unit: int) -> int:
    return max(round(length / unit) * unit, unit)


class MiniCPMVRemoteProcessor:
    """The remote MiniCPMVImageProcessor's image steps (the module doc) in PIL and torch:
    pixel_values [one flat tensor of the views] and image_sizes [(rows, cols, h0, w0, ...)]."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.s = settings

    def views(self, image: Any) -> tuple[tuple[int, int], list[Any]]:
        from PIL import Image

        s, bicubic = self.s, Image.Resampling.BICUBIC
        p, res = int(s["patch_size"]), int(s["scale_resolution"])
        w, h = image.size
        grid = sliced_grid(w, h, int(s["max_slice_nums"]), res)
        th, tw = best_resize((h, w), res, p, 1, grid is None)
        out = [image.resize((tw, th), bicubic)]
        if grid is None:
            return (0, 0), out
        cols, rows = grid
        cell = (_ensure_divide(h, rows) / rows, _ensure_divide(w, cols) / cols)
        ch, cw = best_resize(cell, res, p, 1, True)
        whole = image.resize((cw * cols, ch * rows), bicubic)
        for r in range(rows):
            for c in range(cols):
                out.append(whole.crop((c * cw, r * ch, (c + 1) * cw, (r + 1) * ch)))
        return (rows, cols), out

    def __call__(self, images: list[Any], return_tensors: str = "pt") -> dict[str, list]:
        p = int(self.s["patch_size"])
        mean = torch.tensor(self.s["norm_mean"], dtype=torch.float32).view(3, 1, 1)
        std = torch.tensor(self.s["norm_std"], dtype=torch.float32).view(3, 1, 1)
        pixels, sizes = [], []
        for image in images:
            (rows, cols), views = self.views(image)
            flat, size = [], [rows, cols]
            for view in views:
                x = torch.from_numpy(np.asarray(view, dtype=np.float32) / 255).permute(2, 0, 1)
                flat.append(((x - mean) / std).flatten())
                size += [view.size[1] // p, view.size[0] // p]
            pixels.append(torch.cat(flat))
            sizes.append(tuple(size))
        return {"pixel_values": pixels, "image_sizes": sizes}


class MiniCPMVRemoteLayout(Layout):
    """Each "(<image>./</image>)" of the text -> its image's segment (the module doc); a view
    one `ImageInput` of query_num placeholders. Loaded: the flat views and (rows, cols, h0,
    w0, h1, w1, ...)."""

    takes_embeds = False

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        self.config = config
        self.placeholder = placeholder  # "<unk>": config.image_token_id
        self.tokenizer = tokenizer
        self.fixed = None
        self.patch = int(config.vision_config.patch_size)
        self.queries = int(config.query_num)
        self.settings = {**_DEFAULTS, **config.slice_config, "use_image_id": config.use_image_id}
        self.legacy = config.version == LEGACY
        if tokenizer is None:
            return
        if token_ids(tokenizer, UNK)[0] != placeholder:
            raise ValueError(
                f"MiniCPMV: the tokenizer's {UNK} is id {token_ids(tokenizer, UNK)[0]}, not "
                f"config image_token_id {placeholder} (set image_token_id in config.json)"
            )
        names = list(MARKERS)[:4] if self.legacy else list(MARKERS)  # 2.5: no <image_id>
        self.ids = dict(zip(names, token_ids(tokenizer, *(MARKERS[n] for n in names)), strict=True))
        self.newline = tokenizer.encode("\n", add_special_tokens=False)

    def read_saved(self, path: Path) -> None:
        """preprocessor_config.json's slicing and normalization settings, checked."""
        file = Path(path) / "preprocessor_config.json"
        saved = json.loads(file.read_text()) if file.is_file() else {}
        self.settings.update({k: saved[k] for k in _DEFAULTS if saved.get(k) is not None})
        self.settings["use_image_id"] &= not self.legacy  # 2.5's processor writes no ids
        if not self.settings["slice_mode"]:
            raise ValueError("MiniCPMV: preprocessor_config.json slice_mode false is not served")
        if int(self.settings["patch_size"]) != self.patch:
            raise ValueError(
                f"MiniCPMV: preprocessor_config.json patch_size={self.settings['patch_size']} "
                f"differs from the tower's {self.patch}"
            )

    def image_processor(self) -> MiniCPMVRemoteProcessor:
        return MiniCPMVRemoteProcessor(self.settings)

    def check_kwargs(self, kwargs: dict[str, Any]) -> None:
        if kwargs:
            raise ValueError(
                f"mm_processor_kwargs {sorted(kwargs)} are not supported for MiniCPMV (the "
                "release's preprocessor_config.json settings are used)"
            )

    def length(self, size: Size) -> int:
        if size is None or len(size) != 2 or min(int(v) for v in size) <= 0:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not (h, w)")
        return self.queries

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        assert size is not None
        return (3, int(size[0]) * self.patch, int(size[1]) * self.patch)

    def _views(self, size: Size) -> list[tuple[int, int]]:
        assert size is not None
        return [(int(size[i]), int(size[i + 1])) for i in range(2, len(size), 2)]

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])
        pixels, size = out["pixel_values"][0].float().contiguous(), tuple(out["image_sizes"][0])
        views = self._views(size)
        want = sum(3 * h * w * self.patch**2 for h, w in views)
        if len(views) != 1 + size[0] * size[1] or tuple(pixels.shape) != (want,):
            raise _shape_error(pixels, f"({want},) ({1 + size[0] * size[1]} views)")
        return pixels, size

    def segment(self, loaded: Loaded) -> list[int]:
        from paged_engine.multimodal.minicpmv import image_segment

        rows, cols = loaded[1][:2]  # type: ignore[index]
        runs = [self.length(v) for v in self._views(loaded[1])]
        build = legacy_segment if self.legacy else image_segment
        return build(runs, rows, cols, self.placeholder, self.ids, self.newline)

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        out, start = [], 0
        views = self._views(loaded[1])
        for (h, w), run in zip(views, run_starts(segment, self.placeholder), strict=True):
            n = 3 * h * w * self.patch**2
            view = loaded[0][start : start + n].view(self.pixel_shape((h, w))).contiguous()
            start += n
            out.append(ImageInput(view, at + run, self.queries, digest(view, (h, w)), (h, w)))
        return out

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """The text split at each PATTERN, the pieces tokenized apart, the k-th image's
        <image_id>k</image_id> (use_image_id) and segment between them; ValueError naming
        multi_modal_data unless there is one PATTERN per image and no "<unk>" of the text's."""
        tok = self.tokenizer
        if tok is None:
            raise ValueError("the tokenizer is needed to place MiniCPMV's images")
        if self.placeholder in ids:
            raise ValueError(f"multi_modal_data['image']: the prompt holds {UNK} tokens of its own")
        bos = getattr(tok, "bos_token_id", None)
        head = ids[:1] if ids and bos is not None and ids[0] == bos else []
        text = tok.decode(ids[len(head) :], skip_special_tokens=False)
        pieces = text.split(PATTERN)
        if len(pieces) != len(segments) + 1:
            raise ValueError(
                f"multi_modal_data['image'] has {len(segments)} image(s) but the prompt has "
                f"{len(pieces) - 1} image placeholder(s) ({PATTERN}): put one per image"
            )
        out = head + tok.encode(pieces[0], add_special_tokens=False)
        starts = []
        for k, (segment, piece) in enumerate(zip(segments, pieces[1:], strict=True)):
            if self.settings["use_image_id"]:
                out += [self.ids["image_id_start_token"]]
                out += tok.encode(str(k), add_special_tokens=False)
                out += [self.ids["image_id_end_token"]]
            starts.append(len(out))
            out += segment + tok.encode(piece, add_special_tokens=False)
        return out, starts


def sincos_2d(h: int, w: int, dim: int) -> torch.Tensor:
    """[h * w, dim] (row-major): [sin(j f), cos(j f), sin(i f), cos(i f)] of row i, column j,
    f = 10000^(-k / (dim / 4)): MiniCPM-V's table (vLLM's get_2d_sincos_pos_embed, 2.5's
    layout) sliced [:h, :w]."""
    freq = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim // 4))
    rows = torch.arange(h, dtype=torch.float64)[:, None].expand(h, w).flatten()
    cols = torch.arange(w, dtype=torch.float64)[None, :].expand(h, w).flatten()
    a, b = cols[:, None] * freq, rows[:, None] * freq
    return torch.cat([a.sin(), a.cos(), b.sin(), b.cos()], dim=1).float()


class _MultiheadAttention(nn.Module):
    """torch's nn.MultiheadAttention weights (in_proj packed q, k, v; out_proj), batch first."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * dim))
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, Q, D], k / v [N, L, D] -> [N, Q, D]."""
        wq, wk, wv = self.in_proj_weight.chunk(3)
        bq, bk, bv = self.in_proj_bias.chunk(3)

        def heads(x: torch.Tensor) -> torch.Tensor:  # [N, L, D] -> [N, H, L, D / H]
            return x.unflatten(-1, (self.heads, -1)).transpose(1, 2)

        q, k, v = heads(F.linear(q, wq, bq)), heads(F.linear(k, wk, bk)), heads(F.linear(v, wv, bv))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return self.out_proj(out)


class Resampler(nn.Module):
    """`resampler` (Resampler2_5 / 4_5): a view's tower rows -> query_num rows of the text width."""

    def __init__(self, queries: int, dim: int, kv_dim: int, on_values: bool) -> None:
        super().__init__()
        self.on_values = on_values  # 4.5: the positions on the values, not the keys
        self.query = nn.Parameter(torch.empty(queries, dim))
        self.kv_proj = nn.Linear(kv_dim, dim, bias=False) if kv_dim != dim else None
        self.attn = _MultiheadAttention(dim, dim // 128)
        self.ln_q, self.ln_kv, self.ln_post = (nn.LayerNorm(dim, eps=1e-6) for _ in range(3))
        self.proj = nn.Parameter(torch.empty(dim, dim))

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """[N, h * w, kv_dim] -> [N, query_num, dim]."""
        kv = self.ln_kv(self.kv_proj(x) if self.kv_proj is not None else x)
        pos = sincos_2d(h, w, kv.shape[-1]).to(kv.device, kv.dtype)
        q = self.ln_q(self.query).expand(kv.shape[0], -1, -1)
        keys, values = (kv, kv + pos) if self.on_values else (kv + pos, kv)
        out = self.attn(q, keys, values)
        return self.ln_post(out) @ self.proj


class MiniCPMVRemoteImageEncoder(nn.Module):
    """Views -> query_num rows each of the text model's input embedding."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.vpm = Tower(config.vision_config)
        hidden = int(config.text_config.hidden_size)
        kv = int(config.vision_config.hidden_size)
        on_values = config.version == "4.5"
        self.resampler = Resampler(int(config.query_num), hidden, kv, on_values)
        self.as_row = config.version == LEGACY  # 2.5: each view as one row of patches
        self.patch = int(config.vision_config.patch_size)

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each view's rows; views of one patch grid run as one batch (each view alone: the
        remote code's padding is masked out)."""
        weight = self.resampler.proj
        out: list[torch.Tensor | None] = [None] * len(images)
        by_grid: dict[tuple[int, ...], list[int]] = {}
        for i, m in enumerate(images):
            if m.pixel_values is None or m.image_size is None:
                raise ValueError("multi_modal_data['image']: MiniCPMV takes images, not embeds")
            by_grid.setdefault(tuple(m.image_size), []).append(i)
        for (h, w), group in by_grid.items():
            pixels = torch.stack([images[i].pixel_values for i in group])  # type: ignore[misc]
            pixels = patch_row(pixels, self.patch) if self.as_row else pixels
            x = self.vpm.last(pixels.to(weight.device, weight.dtype))
            for i, r in zip(group, self.resampler(x, h, w), strict=True):
                out[i] = r
        return out  # type: ignore[return-value]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `vpm.*` and `resampler.*` tensors (others passed over; the
        resampler's sin-cos table, if saved, is recomputed); ValueError naming a missing or
        unexpected one."""
        picked = (
            (n, t)
            for n, t in weights
            if n.startswith(("vpm.", "resampler.")) and n != "resampler.pos_embed"
        )
        return load_named_weights(self, picked)
