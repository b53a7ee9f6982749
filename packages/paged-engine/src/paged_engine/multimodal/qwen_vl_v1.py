"""Qwen-VL v1 (Qwen/Qwen-VL, Qwen/Qwen-VL-Chat; remote code; vLLM's
QwenVLForConditionalGeneration, qwen_vl.py): the image processor, prompt layout and encoder. The
config: models/qwen_vl_v1_config.py; the decoder: Qwen v1 (models/qwen_v1.py) under the same
`transformer.` names, flat (models/text_wrappers.py's row).

    image (PIL, made RGB) -> resized to image_size x image_size (PIL bicubic), x / 255,
        (x - mean) / std with CLIP's mean / std (the release's transform)
    prompt: each <img> ... </img> span (a path or URL written between them, the release
        tokenizer's pads, or nothing as in vLLM's "Picture n: <img></img>") -> <img>, n_queries
        image pads, </img>; the image comes from multi_modal_data, never fetched (vLLM's
        processor drops the text of "Picture n: <img>...</img>\n" spans by a regex and
        inserts the pads between; here any span's text is dropped)
    `transformer.visual`: conv1 (patches, no bias, no class token) + positional_embedding
        (a 16 x 16 table, bicubic-resized to the patch grid) -> ln_pre -> resblocks (pre-norm:
        ln_1, attn (in_proj packed per head as [q_h | k_h | v_h], out_proj), ln_2, mlp c_fc,
        exact GELU, c_proj) -> attn_pool: kv_proj (no bias) -> ln_kv; n_queries learned
        queries through ln_q plus pos_embed; keys plus pos_embed resized to the grid; one
        nn.MultiheadAttention of output_dim // 128 heads -> ln_post, @ proj -> n_queries rows
        of the text width. LayerNorm eps 1e-6 throughout.

Refused by name: any mm_processor_kwargs, image embeddings as input, a prompt whose <img> spans
do not pair up with </img> or number other than the images, image pads outside a span.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import Layout, Loaded, Run, Size, _shape_error, digest

MEAN = (0.48145466, 0.4578275, 0.40821073)  # CLIP's (the release's transforms.Normalize)
STD = (0.26862954, 0.26130258, 0.27577711)
PREFIX = "transformer.visual."


class QwenVLProcessor:
    """The release's image transform: pixel_values [one [3, S, S] tensor an image]."""

    def __init__(self, side: int) -> None:
        self.side = side

    def __call__(self, images: list[Any], return_tensors: str = "pt") -> dict[str, list]:
        from PIL import Image

        mean = torch.tensor(MEAN, dtype=torch.float32).view(3, 1, 1)
        std = torch.tensor(STD, dtype=torch.float32).view(3, 1, 1)
        out = []
        for image in images:
            if min(image.size) < 1:  # PIL would resize it to a black square
                raise ValueError(
                    f"multi_modal_data['image']: a {image.width} x {image.height} image has no "
                    "pixels"
                )
            image = image.convert("RGB").resize((self.side,) * 2, Image.Resampling.BICUBIC)
            x = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).permute(2, 0, 1)
            out.append((x - mean) / std)
        return {"pixel_values": out}


class SquareImageLayout(Layout):
    """A layout whose images all go through `QwenVLProcessor` to one [3, side, side] tensor
    (no settings): Qwen-VL's and GLM-4V's. Subclasses set `side` and `family` (for messages)."""

    takes_embeds = False
    family: str
    side: int

    def image_processor(self) -> QwenVLProcessor:
        return QwenVLProcessor(self.side)

    def check_kwargs(self, kwargs: dict[str, Any]) -> None:
        if kwargs:
            raise ValueError(
                f"mm_processor_kwargs {sorted(kwargs)} are not supported for {self.family} (its "
                "transform has no settings)"
            )

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        return (3, self.side, self.side)

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        pixels = run([image])["pixel_values"][0].float().contiguous()
        if tuple(pixels.shape) != self.pixel_shape(None):
            raise _shape_error(pixels, self.pixel_shape(None))
        return pixels, None


class QwenVLLayout(SquareImageLayout):
    """Each <img> ... </img> span -> <img>, n_queries pads, </img> (the module doc); one
    `ImageInput` an image, its run the pads."""

    family = "Qwen-VL"

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        self.config = config
        visual = config.visual
        self.start, self.end = int(visual["image_start_id"]), int(visual["image_start_id"]) + 1
        self.placeholder = placeholder  # the pad: image_start_id + 2
        self.side = int(visual["image_size"])
        self.fixed = int(visual["n_queries"])

    def segment(self, loaded: Loaded) -> list[int]:
        return [self.start] + [self.placeholder] * self.fixed + [self.end]

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        pixels = loaded[0]
        return [ImageInput(pixels, at + 1, self.fixed, digest(pixels, None), None)]

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """Each <img> ... </img> span (whatever it holds) replaced by its image's segment;
        ValueError naming multi_modal_data unless the spans pair up, one an image."""
        out: list[int] = []
        starts: list[int] = []
        i = 0
        while i < len(ids):
            t = ids[i]
            if t in (self.end, self.placeholder):  # spans are skipped whole below
                raise ValueError(
                    f"multi_modal_data['image']: the prompt holds an image pad ({self.placeholder})"
                    f" or </img> ({self.end}) outside an <img> ... </img> span"
                )
            if t != self.start:
                out.append(t)
                i += 1
                continue
            try:
                close = ids.index(self.end, i + 1)
            except ValueError:
                raise ValueError(
                    "multi_modal_data['image']: an <img> of the prompt has no </img>"
                ) from None
            if self.start in ids[i + 1 : close]:
                raise ValueError("multi_modal_data['image']: an <img> span holds another <img>")
            if len(starts) < len(segments):
                starts.append(len(out))
                out += segments[len(starts) - 1]
            else:
                starts.append(-1)  # counted for the message below
            i = close + 1
        if len(starts) != len(segments):
            raise ValueError(
                f"multi_modal_data['image'] has {len(segments)} image(s) but the prompt has "
                f"{len(starts)} <img> ... </img> span(s): put one per image"
            )
        return out, starts


def resized_table(table: torch.Tensor, side: int) -> torch.Tensor:
    """[n * n, D] (a square grid, row-major) -> [side * side, D]: bicubic (align_corners off)
    in float32 as vLLM's get_abs_pos; the table itself where the sides agree."""
    n = math.isqrt(table.shape[0])
    if n == side:
        return table
    grid = table.float().reshape(1, n, n, -1).permute(0, 3, 1, 2)
    out = F.interpolate(grid, size=(side, side), mode="bicubic", align_corners=False)
    return out.permute(0, 2, 3, 1).flatten(0, 2).to(table.dtype)


class _Attention(nn.Module):
    """The tower's self-attention: in_proj rows grouped per head as [q_h | k_h | v_h]."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.in_proj = nn.Linear(width, 3 * width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, L, W] -> [N, L, W]."""
        qkv = self.in_proj(x).unflatten(-1, (self.heads, -1)).transpose(1, 2)  # [N, H, L, 3d]
        q, k, v = qkv.chunk(3, dim=-1)
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width, eps=1e-6), nn.LayerNorm(width, eps=1e-6)
        self.attn = _Attention(width, heads)
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(width, mlp), "c_proj": nn.Linear(mlp, width)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp["c_proj"](F.gelu(self.mlp["c_fc"](self.ln_2(x))))


class _Resampler(nn.Module):
    """`attn_pool`: tower rows [N, L, W] -> [N, Q, D] (torch's nn.MultiheadAttention weights)."""

    def __init__(self, queries: int, dim: int, kv_dim: int) -> None:
        super().__init__()
        self.heads = dim // 128
        self.query = nn.Parameter(torch.empty(queries, dim))
        self.pos_embed = nn.Parameter(torch.empty(queries, dim))  # loaded (the release saves it)
        self.kv_proj = nn.Linear(kv_dim, dim, bias=False) if kv_dim != dim else None
        self.ln_q, self.ln_kv = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn = nn.Module()
        self.attn.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.attn.in_proj_bias = nn.Parameter(torch.empty(3 * dim))
        self.attn.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kv = self.ln_kv(self.kv_proj(x) if self.kv_proj is not None else x)
        keys = kv + resized_table(self.pos_embed, math.isqrt(x.shape[1])).to(kv.dtype)
        q = (self.ln_q(self.query) + self.pos_embed).expand(x.shape[0], -1, -1)
        wq, wk, wv = self.attn.in_proj_weight.chunk(3)
        bq, bk, bv = self.attn.in_proj_bias.chunk(3)

        def heads(t: torch.Tensor) -> torch.Tensor:  # [N, L, D] -> [N, H, L, D / H]
            return t.unflatten(-1, (self.heads, -1)).transpose(1, 2)

        q, k, v = (
            heads(F.linear(q, wq, bq)),
            heads(F.linear(keys, wk, bk)),
            heads(F.linear(kv, wv, bv)),
        )
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return self.attn.out_proj(out)


class SquareImageEncoder(nn.Module):
    """An encoder of `SquareImageLayout`'s images (one size, run as one batch) whose weights
    are the checkpoint's `prefix`* tensors: Qwen-VL's and GLM-4V's. Subclasses set `family`
    (for messages) and `prefix`, and map pixels [N, 3, S, S] to rows in forward."""

    family: str
    prefix: str

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each image's rows; all images share one size and run as one batch."""
        if any(m.pixel_values is None for m in images):
            raise ValueError(f"multi_modal_data['image']: {self.family} takes images, not embeds")
        w = next(self.parameters())  # (one device and dtype: built under building_in)
        pixels = torch.stack([m.pixel_values for m in images])  # type: ignore[misc]
        return list(self(pixels.to(w.device, w.dtype)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `prefix`* tensors (others passed over); ValueError naming a missing
        or unexpected one."""
        n = len(self.prefix)
        picked = ((name[n:], t) for name, t in weights if name.startswith(self.prefix))
        return {self.prefix + name for name in load_named_weights(self, picked)}


class QwenVLImageEncoder(SquareImageEncoder):
    """Images [3, S, S] -> n_queries rows each of the text model's input embedding."""

    family, prefix = "Qwen-VL", PREFIX

    def __init__(self, config: Any) -> None:
        super().__init__()
        v = config.visual
        width, patch, dim = int(v["width"]), int(v["patch_size"]), int(v["output_dim"])
        self.grid = int(v["image_size"]) // patch
        self.conv1 = nn.Conv2d(3, width, patch, patch, bias=False)
        self.positional_embedding = nn.Parameter(torch.empty(256, width))  # vLLM's 16 x 16
        self.ln_pre = nn.LayerNorm(width, eps=1e-6)
        mlp = int(width * float(v["mlp_ratio"]))
        blocks = [_Block(width, int(v["heads"]), mlp) for _ in range(int(v["layers"]))]
        self.transformer = nn.Module()
        self.transformer.resblocks = nn.ModuleList(blocks)
        self.attn_pool = _Resampler(int(v["n_queries"]), dim, width)
        self.ln_post = nn.LayerNorm(dim, eps=1e-6)
        self.proj = nn.Parameter(torch.empty(dim, dim))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, 3, S, S] -> [N, n_queries, output_dim]."""
        x = self.conv1(pixels).flatten(2).transpose(1, 2)  # [N, grid^2, W]
        x = self.ln_pre(x + resized_table(self.positional_embedding, self.grid))
        for block in self.transformer.resblocks:
            x = block(x)
        return self.ln_post(self.attn_pool(x)) @ self.proj
