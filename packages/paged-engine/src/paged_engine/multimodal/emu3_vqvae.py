"""Emu3's image tokenizer: the encoder half of its VQ-VAE (HF's Emu3VQVAE.encode, `vq_config`
model_type "emu3_vqgan", `model.vqmodel.*`), pixels -> codebook indices. multimodal/emu3.py
turns the indices into token-embedding rows.

    pixels [N, 3, H, W] (H, W multiples of f = 2^(levels - 1))
      -> conv_in (3x3) -> per level i of channel_multiplier: num_res_blocks ResnetBlocks (each
         followed by a GroupNorm and a multi-head attention over the h x w positions where i is
         in attn_resolutions: level indices, not Chameleon's pixel sizes), then a stride-2
         DownSample except after the last
      -> middle: ResnetBlock, GroupNorm + attention (always), ResnetBlock
      -> GroupNorm, swish, conv_out (3x3): [N, latent, h, w] (h = H / f, w = W / f)
      -> the frame repeated T = temporal_downsample_factor times (HF repeats the image before
         its 2-D encoder; the frames are equal, so this runs the 2-D part once) [N, latent, T,
         h, w] -> log2(T) temporal downsamples (3-D conv, kernel (4, 3, 3), stride (2, 1, 1),
         each followed by swish) -> num_res_blocks temporal ResnetBlocks (BatchNorm3d in eval
         form, 3x3x3 convs) -> quant_conv (3-D, kernel (3, 1, 1)): [N, embed_dim, 1, h, w]
      -> nearest codebook row (chameleon_vqvae.nearest_codes: HF's expression) -> [N, h, w]

Every 3-D conv pads time causally (2 frames before, none after) and space by (k - 1) / 2 on
each side, as HF's Emu3VQVAEConv3d does. The attention blocks are SigLIP's (q / k / v /
out_proj Linears with bias, vq_config.num_attention_heads heads over vq_config.hidden_size
channels: the width of every level that has one, and of the middle). ResnetBlock, DownSample,
GroupNorm and swish are Chameleon's (chameleon_vqvae.py): the same modules under the same names.
Dropout and the decoder half (`decoder`, `post_quant_conv`) are not needed to read images and are
not built.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.multimodal.chameleon_vqvae import (
    DownSample,
    ResnetBlock,
    group_norm,
    nearest_codes,
    swish,
)


def spatial_factor(vq: Any) -> int:
    """Pixels per code along each side: 2^(levels - 1) (HF's vision_spatial_factor)."""
    return 2 ** (len(vq.channel_multiplier) - 1)


class Attention(nn.Module):
    """SigLIP's attention over a feature map's positions (HF's Emu3VQVAEAttentionBlock)."""

    def __init__(self, channels: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            nn.Linear(channels, channels) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, C, h, w] -> [N, C, h, w]
        n, c, hgt, wid = x.shape
        seq = x.flatten(2).transpose(1, 2)  # [N, hw, C]

        def split(t: torch.Tensor) -> torch.Tensor:  # [N, hw, C] -> [N, heads, hw, C / heads]
            return t.view(n, hgt * wid, self.heads, -1).transpose(1, 2)

        q, k, v = split(self.q_proj(seq)), split(self.k_proj(seq)), split(self.v_proj(seq))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, hgt * wid, c)
        return self.out_proj(out).transpose(1, 2).reshape(n, c, hgt, wid)


def _attend(norm: nn.Module, attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x + attn(norm(x)): HF keeps the norm (attn_norm(s)) apart from the attention."""
    return x + attn(norm(x))


class _Level(nn.Module):  # HF's `down_block.down[i]`: block, attn, attn_norms, downsample
    def __init__(self, blocks: list[nn.Module], attns: list[Attention], down: bool) -> None:
        super().__init__()
        width = blocks[-1].conv2.out_channels
        self.block = nn.ModuleList(blocks)
        self.attn = nn.ModuleList(attns)
        self.attn_norms = nn.ModuleList(group_norm(width) for _ in attns)
        self.downsample = DownSample(width) if down else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.block):
            x = block(x)
            if len(self.attn):
                x = _attend(self.attn_norms[i], self.attn[i], x)
        return x if self.downsample is None else self.downsample(x)


class _DownBlock(nn.Module):  # HF's `down_block` (its ModuleList `down`)
    def __init__(self, levels: list[_Level]) -> None:
        super().__init__()
        self.down = nn.ModuleList(levels)


class _Middle(nn.Module):  # HF's `middle_block`
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.block_1 = ResnetBlock(width, width)
        self.attn_norm = group_norm(width)
        self.attn_1 = Attention(width, heads)
        self.block_2 = ResnetBlock(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _attend(self.attn_norm, self.attn_1, self.block_1(x))
        return self.block_2(x)


class CausalConv3d(nn.Module):
    """HF's Emu3VQVAEConv3d: pad time by 2 frames before, space by (k - 1) / 2 (the odd pixel
    first), then a valid 3-D conv (its module at `.conv`)."""

    def __init__(self, cin: int, cout: int, kernel: tuple[int, int, int], stride: tuple) -> None:
        super().__init__()
        pads: tuple[int, ...] = ()
        for k, s in reversed(list(zip(kernel[1:], stride[1:], strict=True))):
            size = k - s
            pads += (size // 2 + size % 2, size // 2)
        self.padding = (*pads, 2, 0)
        self.conv = nn.Conv3d(cin, cout, kernel, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, C, T, h, w]
        return self.conv(F.pad(x, self.padding))


class _TemporalDown(nn.Module):  # HF's Emu3VQVAETemporalDownsample (`time_conv[i]`)
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = CausalConv3d(channels, channels, (4, 3, 3), (2, 1, 1))


class FrozenBatchNorm3d(nn.Module):
    """BatchNorm3d as HF's frozen VQ-VAE runs it (eval: the running statistics); the four
    tensors are parameters so the loader fills them (`num_batches_tracked` is passed over)."""

    def __init__(self, channels: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(channels), requires_grad=False)
        self.running_mean = nn.Parameter(torch.zeros(channels), requires_grad=False)
        self.running_var = nn.Parameter(torch.ones(channels), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
        )


class _TemporalResnet(nn.Module):  # HF's Emu3VQVAETemporalResnetBlock (equal widths)
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm1 = FrozenBatchNorm3d(channels)
        self.conv1 = CausalConv3d(channels, channels, (3, 3, 3), (1, 1, 1))
        self.norm2 = FrozenBatchNorm3d(channels)
        self.conv2 = CausalConv3d(channels, channels, (3, 3, 3), (1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, C, T, h, w]
        h = self.conv1(swish(self.norm1(x)))
        return x + self.conv2(swish(self.norm2(h)))


class Emu3VQEncoder(nn.Module):
    """HF's Emu3VQVAEEncoder (`vqmodel.encoder.*`) on images: [N, 3, H, W] -> [N, latent, T',
    h, w] after its temporal stack (T' = 1 for T = 1, 2, 4, ...)."""

    def __init__(self, vq: Any) -> None:
        super().__init__()
        base, mult = int(vq.base_channels), [int(m) for m in vq.channel_multiplier]
        heads, hidden = int(vq.num_attention_heads), int(vq.hidden_size)
        attn_at = {int(i) for i in vq.attn_resolutions or ()}
        widths = [base * mult[i] for i in sorted(attn_at) if i < len(mult)] + [base * mult[-1]]
        if any(w != hidden for w in widths) or hidden % heads:
            raise ValueError(
                f"vq_config.hidden_size={hidden} must be the width of every level with attention "
                f"and of the last ({widths}), and divide by num_attention_heads={heads}"
            )
        if vq.double_latent:
            raise ValueError(
                "vq_config.double_latent is not supported (HF's quant_conv reads latent_channels)"
            )
        factor = int(vq.temporal_downsample_factor)
        if factor < 1 or factor & (factor - 1):
            raise ValueError(
                f"vq_config.temporal_downsample_factor={factor} must be a power of two"
            )
        self.frames = factor
        self.conv_in = nn.Conv2d(int(vq.in_channels), base, 3, padding=1)
        levels, width = [], base
        for i, m in enumerate(mult):
            blocks, attns = [], []
            for _ in range(int(vq.num_res_blocks)):
                blocks.append(ResnetBlock(width, base * m))
                width = base * m
                if i in attn_at:
                    attns.append(Attention(width, heads))
            levels.append(_Level(blocks, attns, down=i != len(mult) - 1))
        self.down_block = _DownBlock(levels)
        self.middle_block = _Middle(width, heads)
        self.norm_out = group_norm(width)
        latent = int(vq.latent_channels)
        self.conv_out = nn.Conv2d(width, latent, 3, padding=1)
        self.time_conv = nn.ModuleList(_TemporalDown(latent) for _ in range(int(math.log2(factor))))
        self.time_res_stack = nn.ModuleList(
            _TemporalResnet(latent) for _ in range(int(vq.num_res_blocks))
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(pixels)
        for level in self.down_block.down:
            x = level(x)
        x = self.conv_out(swish(self.norm_out(self.middle_block(x))))  # [N, latent, h, w]
        x = x.unsqueeze(2).expand(-1, -1, self.frames, -1, -1)  # the equal frames [.., T, ..]
        for down in self.time_conv:
            x = swish(down.conv(x))
        for block in self.time_res_stack:
            x = block(x)
        return x


class _Quantizer(nn.Module):  # HF's `quantize` (its codebook)
    def __init__(self, count: int, dim: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(count, dim)


class Emu3VQVAE(nn.Module):
    """Images -> codebook indices [N, h, w] (`vqmodel.encoder`, `quant_conv`, `quantize`)."""

    def __init__(self, vq: Any) -> None:
        super().__init__()
        self.encoder = Emu3VQEncoder(vq)
        latent, embed = int(vq.latent_channels), int(vq.embed_dim)
        self.quant_conv = CausalConv3d(latent, embed, (3, 1, 1), (1, 1, 1))
        self.quantize = _Quantizer(int(vq.codebook_size), embed)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, H, W] -> [N, h, w]
        z = self.quant_conv(self.encoder(pixels))  # [N, E, 1, h, w]: T' = 1 (a power of two)
        assert z.shape[2] == 1, z.shape
        z = z[:, :, 0]
        n, e, hgt, wid = z.shape
        flat = z.permute(0, 2, 3, 1).reshape(-1, e)  # [N * h * w, E], row-major positions
        return nearest_codes(flat, self.quantize.embedding.weight).view(n, hgt, wid)
