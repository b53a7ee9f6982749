"""Donut's image encoder: transformers' DonutSwinModel (config.encoder, model_type "donut-swin"),
under its names (`encoder.*` in a VisionEncoderDecoderModel checkpoint).

    pixels [3, H, W] -> zero-pad right / bottom to whole patches -> conv patch embed (kernel =
        stride = patch_size) -> LayerNorm -> [h * w, C]
    per stage s (C = embed_dim * 2^s): blocks j = 0, 1, ...: x + windowed attention(LN(x)),
        then x + fc2(act(fc1(LN(x)))); between stages patch merging: zero-pad the map to even
        sides, the 2 x 2 neighbours' channels side by side [(0,0), (1,0), (0,1), (1,1)] ->
        LayerNorm(4C) -> Linear(4C, 2C, no bias); sides (h + 1) // 2
    -> the last stage's rows [h_s * w_s, C_last], row-major over the map (no final norm)

Windowed attention (a block): the normed map zero-padded right / bottom to whole windows,
rolled by -shift on both axes when shift > 0 (odd blocks: window_size // 2), cut into
window x window tiles; each tile's heads attend within it, scores q.k / sqrt(Dh) + a learned
bias per (head, relative offset) + the shift mask (-100 between positions of different
regions of the rolled map, as transformers: not -inf); tiles put back, rolled by +shift,
cropped. A stage whose map's shorter side is <= window_size uses that side as its window and
no shift (transformers' `set_shift_and_window_size`); transformers can only run it where that
side equals window_size (its bias table is the window's), so `swin_grid` refuses a smaller
one by name, on the host, before any tower runs.

Refused by name at load (`check_swin`): use_absolute_embeddings (transformers' table has one
row more than the patches and cannot be added without interpolation), a non-square window.
The relative position index is recomputed (the checkpoint's buffer is not read).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn

SHIFT_MASK = -100.0  # transformers' additive mask between regions of the rolled map


def _pair(v: Any) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (list, tuple)) else (int(v), int(v))


def check_swin(enc: Any) -> None:
    """Refuse (ValueError naming the field) what transformers' DonutSwin cannot run."""
    if getattr(enc, "use_absolute_embeddings", False):
        raise ValueError(
            "encoder.use_absolute_embeddings=True is not supported for Donut: transformers' "
            "table has a row more than the patches (no released Donut sets it)"
        )
    if isinstance(enc.window_size, (list, tuple)):
        raise ValueError(f"encoder.window_size={enc.window_size}: only a square window is served")


def swin_grid(height: int, width: int, enc: Any) -> tuple[int, int]:
    """The last stage's map (h, w) for pixels of height x width; ValueError where a stage's
    shorter side is under window_size (transformers' tower cannot run such a map)."""
    ph, pw = _pair(enc.patch_size)
    h, w = -(-height // ph), -(-width // pw)
    window = int(enc.window_size)
    for s in range(len(enc.depths)):
        if s:
            h, w = (h + 1) // 2, (w + 1) // 2
        if min(h, w) < window:
            raise ValueError(
                f"multi_modal_data['image']: its {height}x{width} pixels make a {h}x{w} map at "
                f"Swin stage {s}, under encoder.window_size={window} (transformers' tower "
                "cannot run it): use the checkpoint's image processor size"
            )
    return h, w


def _relative_index(n: int) -> torch.Tensor:
    """[n*n, n*n]: the bias table row of each (query, key) pair of an n x n window."""
    ys, xs = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    ys, xs = ys.flatten(), xs.flatten()
    dy = ys[:, None] - ys[None, :] + n - 1
    dx = xs[:, None] - xs[None, :] + n - 1
    return dy * (2 * n - 1) + dx


def _tiles(x: torch.Tensor, n: int) -> torch.Tensor:  # [B, H, W, C] -> [B, H/n * W/n, n*n, C]
    b, h, w, c = x.shape
    x = x.view(b, h // n, n, w // n, n, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // n) * (w // n), n * n, c)


def _untile(t: torch.Tensor, n: int, h: int, w: int) -> torch.Tensor:  # the inverse of _tiles
    b, c = t.shape[0], t.shape[-1]
    t = t.view(b, h // n, w // n, n, n, c).permute(0, 1, 3, 2, 4, 5)
    return t.reshape(b, h, w, c)


def _shift_mask(h: int, w: int, n: int, shift: int, device: torch.device) -> torch.Tensor:
    """[tiles, n*n, n*n]: 0 between positions of one region of the rolled (h, w) map, else
    SHIFT_MASK. Regions per axis: [0, L - n), [L - n, L - shift), [L - shift, L)."""

    def region(length: int) -> torch.Tensor:
        i = torch.arange(length, device=device)
        return (i >= length - n).long() + (i >= length - shift).long()

    ids = (region(h)[:, None] * 3 + region(w)[None, :]).float()  # [h, w]
    ids = _tiles(ids[None, :, :, None], n)[0, :, :, 0]  # [tiles, n*n]
    differ = ids[:, :, None] != ids[:, None, :]
    return torch.zeros(differ.shape, device=device).masked_fill(differ, SHIFT_MASK)


class WindowAttention(nn.Module):
    """transformers' DonutSwinAttention (query / key / value / the bias table, then `proj`,
    its attention.output.dense)."""

    def __init__(self, enc: Any, dim: int, heads: int) -> None:
        super().__init__()
        n = int(enc.window_size)
        self.heads = heads
        bias = bool(getattr(enc, "qkv_bias", True))
        self.query = nn.Linear(dim, dim, bias=bias)
        self.key = nn.Linear(dim, dim, bias=bias)
        self.value = nn.Linear(dim, dim, bias=bias)
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * n - 1) ** 2, heads))
        self.register_buffer("relative_index", _relative_index(n), persistent=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """t: [B, tiles, N, C] (N = n*n, the table's window); mask: [tiles, N, N] or None."""
        b, tiles, n, c = t.shape

        def split(y: torch.Tensor) -> torch.Tensor:  # -> [B * tiles, H, N, Dh]
            return y.view(b * tiles, n, self.heads, -1).transpose(1, 2)

        bias = self.relative_position_bias_table[self.relative_index].permute(2, 0, 1)  # [H,N,N]
        add = bias[None] if mask is None else (bias[None] + mask[:, None]).repeat(b, 1, 1, 1)
        q, k, v = split(self.query(t)), split(self.key(t)), split(self.value(t))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=add.to(t.dtype))  # [B*tiles,H,N,Dh]
        return self.proj(o.transpose(1, 2).reshape(b, tiles, n, c))


class SwinBlock(nn.Module):
    def __init__(self, enc: Any, dim: int, heads: int, shifted: bool) -> None:
        super().__init__()
        eps = float(getattr(enc, "layer_norm_eps", 1e-5))
        self.window = int(enc.window_size)
        self.shift = self.window // 2 if shifted else 0
        self.layernorm_before = nn.LayerNorm(dim, eps=eps)
        self.attention = WindowAttention(enc, dim, heads)
        self.layernorm_after = nn.LayerNorm(dim, eps=eps)
        hidden = int(float(enc.mlp_ratio) * dim)
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = get_act_fn(enc.hidden_act, "encoder.hidden_act")

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:  # x: [B, h*w, C]
        b, _, c = x.shape
        n, shift = self.window, self.shift
        if min(h, w) <= n:  # the whole short side is one window: no shift (swin_grid: == n)
            n, shift = min(h, w), 0
        y = self.layernorm_before(x).view(b, h, w, c)
        y = F.pad(y, (0, 0, 0, (n - w % n) % n, 0, (n - h % n) % n))
        hp, wp = y.shape[1], y.shape[2]
        mask = None
        if shift:
            y = torch.roll(y, (-shift, -shift), dims=(1, 2))
            mask = _shift_mask(hp, wp, n, shift, x.device)
        y = _untile(self.attention(_tiles(y, n), mask), n, hp, wp)
        if shift:
            y = torch.roll(y, (shift, shift), dims=(1, 2))
        x = x + y[:, :h, :w].reshape(b, h * w, c)
        return x + self.fc2(self.act(self.fc1(self.layernorm_after(x))))


class PatchMerging(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:  # [B, h*w, C]
        b, _, c = x.shape
        y = F.pad(x.view(b, h, w, c), (0, 0, 0, w % 2, 0, h % 2))
        y = torch.cat([y[:, 0::2, 0::2], y[:, 1::2, 0::2], y[:, 0::2, 1::2], y[:, 1::2, 1::2]], -1)
        return self.reduction(self.norm(y.reshape(b, -1, 4 * c)))


class SwinStage(nn.Module):
    def __init__(self, enc: Any, s: int, last: bool) -> None:
        super().__init__()
        dim, heads = int(enc.embed_dim) * 2**s, int(enc.num_heads[s])
        self.blocks = nn.ModuleList(
            SwinBlock(enc, dim, heads, shifted=j % 2 == 1) for j in range(int(enc.depths[s]))
        )
        self.downsample = None if last else PatchMerging(dim)


class PatchEmbeddings(nn.Module):
    def __init__(self, enc: Any) -> None:
        super().__init__()
        self.patch = _pair(enc.patch_size)
        dim = int(enc.embed_dim)
        self.projection = nn.Conv2d(int(enc.num_channels), dim, self.patch, self.patch)


class SwinEmbeddings(nn.Module):
    def __init__(self, enc: Any) -> None:
        super().__init__()
        self.patch_embeddings = PatchEmbeddings(enc)
        self.norm = nn.LayerNorm(int(enc.embed_dim))

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        ph, pw = self.patch_embeddings.patch
        pixels = F.pad(pixels, (0, -pixels.shape[-1] % pw, 0, -pixels.shape[-2] % ph))
        x = self.patch_embeddings.projection(pixels)  # [B, C, h, w]
        h, w = x.shape[-2:]
        return self.norm(x.flatten(2).transpose(1, 2)), h, w


class SwinLayers(nn.Module):
    def __init__(self, enc: Any) -> None:
        super().__init__()
        stages = len(enc.depths)
        self.layers = nn.ModuleList(SwinStage(enc, s, s == stages - 1) for s in range(stages))


class DonutSwin(nn.Module):
    """pixels [B, 3, H, W] -> the last stage's rows [B, h * w, embed_dim * 2^(stages-1)]."""

    def __init__(self, enc: Any) -> None:
        super().__init__()
        check_swin(enc)
        self.embeddings = SwinEmbeddings(enc)
        self.encoder = SwinLayers(enc)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x, h, w = self.embeddings(pixels)
        for stage in self.encoder.layers:
            for block in stage.blocks:
                x = block(x, h, w)
            if stage.downsample is not None:
                x = stage.downsample(x, h, w)
                h, w = (h + 1) // 2, (w + 1) // 2
        return x


# the checkpoint's names -> ours, applied in order (attention.output.dense before output.dense)
SWIN_RENAMES = (
    (".attention.self.", ".attention."),
    (".attention.output.dense.", ".attention.proj."),
    (".intermediate.dense.", ".fc1."),
    (".output.dense.", ".fc2."),
)
