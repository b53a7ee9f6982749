"""Gemma 3n's audio tower (Gemma3nAudioEncoder): subsampling, the USM conformer, `embed_audio`.

    features [F, mels] (multimodal/gemma3n_audio.py's Gemma3nAudio), the first V frames valid
    subsampling: two Conv2d blocks, each padded by one mel bin a side and kernel - 1 frames after
        (each row reads its own and later frames), a cumulative group norm over (mel, channel)
        and ReLU; each row's (mel, channel) grid flattened and projected -> T rows
    conformer layers: half-step FFN, local self-attention, light conv (causal), half-step FFN,
        RMSNorm; then every conf_reduction_factor-th row, the valid ones kept
    embed_audio: soft rows -> RMSNorm, projection, weightless RMSNorm; the run filled up to
        audio_soft_tokens_per_image rows with the last audio vocabulary id's embedding

As transformers runs it: a key k of query q is read when q - (context_left - 1) <= k <= q +
context_right and k is valid; logits are q * d^-0.5 / softplus(0) * softplus(per_dim_scale)
against k plus q against a projection of the sinusoid of the distance q - k, soft-capped by tanh
at conf_attention_logit_cap (transformers does this in blocks of conf_attention_chunk_size with a
relative shift; here one dense [T, T] product). In the text model (models/gemma3n.py) the audio
rows are causal, their per-layer token inputs read row 0 (the audio ids lie past
vocab_size_per_layer_input), and <end_of_audio> (the first audio id) embeds through
`embed_audio`'s token path, as the text model embeds every id past an embedder's offset.

Each clip is subsampled alone (see gemma3n_audio.py). Weight names are HF's under
`[model.]audio_tower.` and `[model.]embed_audio.`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.norm import UnitRMSNorm
from paged_engine.models.olmo2 import Olmo2RMSNorm
from paged_engine.multimodal.gemma3n_audio import check_config, strides
from paged_engine.multimodal.gemma4_audio import CausalConv1d, load_audio_weights, sinusoids
from paged_engine.multimodal.inputs import ImageInput

_HF_EPS = 1e-6  # transformers' default eps of the conformer's FFN, attention and output norms


class CumulativeGroupNorm(nn.Module):
    """x [B, T, F, C]: each row normalized by the mean and variance of the rows up to it (over
    (F, C), in float32; the variance sums each row's squares about its own running mean), then
    scaled per channel."""

    def __init__(self, channels: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        count = torch.cumsum(torch.full_like(h[:, :, :1, :1], h.shape[2] * h.shape[3]), dim=1)
        mean = torch.cumsum(h.sum(dim=(2, 3), keepdim=True), dim=1) / count
        var = torch.cumsum((h - mean).square().sum(dim=(2, 3), keepdim=True), dim=1) / count
        return ((h - mean) * torch.rsqrt(var + self.eps) * self.weight.float()).to(x.dtype)


class ConvBlock(nn.Module):
    def __init__(self, audio: Any, i: int, mels_in: int) -> None:
        super().__init__()
        c_in = 1 if i == 0 else int(audio.sscp_conv_channel_size[i - 1])
        c_out = int(audio.sscp_conv_channel_size[i])
        kernel = tuple(int(k) for k in audio.sscp_conv_kernel_size[i])
        stride = strides(audio)[i]
        self.conv = nn.Conv2d(c_in, c_out, kernel, stride=stride, bias=False)
        self.norm = CumulativeGroupNorm(c_out, float(audio.sscp_conv_group_norm_eps))
        self.pad = (1, 1, 0, kernel[0] - 1)  # (mel before, after, frames before, after)
        self.mels_out = (mels_in + 2 - kernel[1]) // stride[1] + 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [1, C, T, mels] -> [1, C', T', m']
        x = self.conv(F.pad(x, self.pad).to(self.conv.weight.dtype))
        return F.relu(self.norm(x.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)


class SubsampleProjection(nn.Module):
    def __init__(self, audio: Any) -> None:
        super().__init__()
        self.conv_0 = ConvBlock(audio, 0, int(audio.input_feat_size))
        self.conv_1 = ConvBlock(audio, 1, self.conv_0.mels_out)
        width = int(audio.sscp_conv_channel_size[1]) * self.conv_1.mels_out
        self.input_proj_linear = nn.Linear(width, int(audio.hidden_size), bias=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [F, mels] -> [T, D]
        x = self.conv_1(self.conv_0(features[None, None]))
        return self.input_proj_linear(x[0].permute(1, 2, 0).flatten(1))


class FeedForward(nn.Module):
    def __init__(self, audio: Any) -> None:
        super().__init__()
        d = int(audio.hidden_size)
        self.pre_layer_norm = Olmo2RMSNorm(d, _HF_EPS)
        self.ffw_layer_1 = nn.Linear(d, 4 * d, bias=False)
        self.ffw_layer_2 = nn.Linear(4 * d, d, bias=False)
        self.post_layer_norm = Olmo2RMSNorm(d, _HF_EPS)
        self.clip = float(audio.gradient_clipping)
        self.scale = float(audio.conf_residual_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre_layer_norm(x.clamp(-self.clip, self.clip))
        h = self.ffw_layer_2(F.silu(self.ffw_layer_1(h)))
        return x + self.post_layer_norm(h.clamp(-self.clip, self.clip)) * self.scale


class RelativePosition(nn.Module):  # the checkpoint's `attn.relative_position_embedding`
    def __init__(self, d: int) -> None:
        super().__init__()
        self.pos_proj = nn.Linear(d, d, bias=False)


class LocalAttention(nn.Module):
    """Local self-attention with a relative-position term (see the module doc)."""

    def __init__(self, audio: Any) -> None:
        super().__init__()
        d = int(audio.hidden_size)
        self.heads = int(audio.conf_num_attention_heads)
        self.head_dim = d // self.heads
        self.per_dim_scale = nn.Parameter(torch.zeros(self.head_dim))
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.relative_position_embedding = RelativePosition(d)
        self.back = max(0, int(audio.conf_attention_context_left) - 1)
        self.ahead = int(audio.conf_attention_context_right)
        self.cap = float(audio.conf_attention_logit_cap)
        self.q_scale = self.head_dim**-0.5 / float(F.softplus(torch.tensor(0.0)))

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape  # valid: [B, T]
        shape = (b, t, self.heads, self.head_dim)
        scale = self.q_scale * F.softplus(self.per_dim_scale)
        q = (self.q_proj(x).view(shape) * scale).transpose(1, 2)  # [B, H, T, hd]
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        distances = torch.arange(self.back, -self.ahead - 1, -1, device=x.device)  # q - k
        rel = self.relative_position_embedding.pos_proj(sinusoids(distances, d).to(x.dtype))
        rel = rel.view(-1, self.heads, self.head_dim).permute(1, 2, 0)  # [H, hd, back+ahead+1]
        pos = torch.arange(t, device=x.device)
        behind = pos[:, None] - pos[None, :]  # [T, T]: q - k
        index = (self.back - behind).clamp(0, self.back + self.ahead)
        bias = torch.gather(q @ rel, -1, index.expand(b, self.heads, t, t))
        logits = q @ k.transpose(-1, -2) + bias
        logits = torch.tanh(logits / self.cap) * self.cap
        near = (behind <= self.back) & (-behind <= self.ahead)
        keep = near[None, None] & valid[:, None, None, :]
        logits = logits.masked_fill(~keep, torch.finfo(logits.dtype).min)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(v.dtype)
        return (weights @ v).transpose(1, 2).reshape(b, t, d)


class ConformerAttention(nn.Module):
    def __init__(self, audio: Any) -> None:
        super().__init__()
        d = int(audio.hidden_size)
        self.pre_attn_norm = Olmo2RMSNorm(d, _HF_EPS)
        self.attn = LocalAttention(audio)
        self.post = nn.Linear(d, d, bias=False)
        self.post_norm = Olmo2RMSNorm(d, _HF_EPS)
        self.clip = float(audio.gradient_clipping)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        h = self.attn(self.pre_attn_norm(x.clamp(-self.clip, self.clip)), valid)
        return x + self.post_norm(self.post(h).clamp(-self.clip, self.clip))


class LightConv(nn.Module):
    def __init__(self, audio: Any) -> None:
        super().__init__()
        d, eps = int(audio.hidden_size), float(audio.rms_norm_eps)
        self.pre_layer_norm = Olmo2RMSNorm(d, eps)
        self.linear_start = nn.Linear(d, 2 * d, bias=False)
        kernel = int(audio.conf_conv_kernel_size)
        self.depthwise_conv1d = CausalConv1d(d, d, kernel, groups=d, bias=False)
        self.conv_norm = Olmo2RMSNorm(d, eps)
        self.linear_end = nn.Linear(d, d, bias=False)
        self.clip = float(audio.gradient_clipping)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1)
        h = self.depthwise_conv1d(h.transpose(1, 2)).transpose(1, 2)
        h = F.silu(self.conv_norm(h.clamp(-self.clip, self.clip)))
        return x + self.linear_end(h)


class ConformerBlock(nn.Module):
    def __init__(self, audio: Any) -> None:
        super().__init__()
        self.ffw_layer_start = FeedForward(audio)
        self.attention = ConformerAttention(audio)
        self.lconv1d = LightConv(audio)
        self.ffw_layer_end = FeedForward(audio)
        self.norm = Olmo2RMSNorm(int(audio.hidden_size), _HF_EPS)
        self.clip = float(audio.gradient_clipping)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        x = self.attention(self.ffw_layer_start(x), valid)
        # (HF zeroes the invalid rows before the light conv: they follow the valid ones and
        # the conv is causal, so no valid row reads them either way)
        x = self.lconv1d(x)
        return self.norm(self.ffw_layer_end(x).clamp(-self.clip, self.clip))


class AudioTower(nn.Module):
    def __init__(self, audio: Any) -> None:
        super().__init__()
        self.subsample_conv_projection = SubsampleProjection(audio)
        self.conformer = nn.ModuleList(
            ConformerBlock(audio) for _ in range(audio.conf_num_hidden_layers)
        )
        self.stride = int(np.prod([s for s, _ in strides(audio)]))
        self.reduction = int(audio.conf_reduction_factor)

    def forward(self, clips: Sequence[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
        """Each clip's (frames [F, mels], valid frames V) -> its valid reduced rows [n, D]."""
        rows = [self.subsample_conv_projection(f) for f, _ in clips]  # each alone: see module
        longest = max(r.shape[0] for r in rows)
        x = torch.stack([F.pad(r, (0, 0, 0, longest - r.shape[0])) for r in rows])
        t = torch.arange(longest, device=x.device)
        valid = torch.stack(
            [
                (t < r.shape[0]) & ((t * self.stride).clamp(max=f.shape[0] - 1) < v)
                for r, (f, v) in zip(rows, clips, strict=True)
            ]
        )
        for block in self.conformer:
            x = block(x, valid)
        x, valid = x[:, :: self.reduction], valid[:, :: self.reduction]
        return [h[m] for h, m in zip(x, valid, strict=True)]  # (valid rows are a prefix)


class AudioEmbedder(nn.Module):
    """`embed_audio`: soft rows through soft_embedding_norm, hard ids through the table and
    hard_embedding_norm; both projected and unit-normed."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        audio = config.audio_config
        d, eps = int(audio.hidden_size), float(audio.rms_norm_eps)
        self.offset = int(audio.vocab_offset)
        self.embedding = nn.Embedding(int(audio.vocab_size), d)
        self.hard_embedding_norm = Olmo2RMSNorm(d, eps)
        self.soft_embedding_norm = Olmo2RMSNorm(d, eps)
        self.embedding_projection = nn.Linear(d, int(config.text_config.hidden_size), bias=False)
        self.post_norm = UnitRMSNorm(eps)

    def soft(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.embedding_projection(self.soft_embedding_norm(x)))

    def hard(self, token: int) -> torch.Tensor:  # [D]
        row = self.embedding.weight[token - self.offset]
        return self.post_norm(self.embedding_projection(self.hard_embedding_norm(row)))


class Gemma3nAudioEncoder(nn.Module):
    """Clips -> audio_soft_tokens_per_image rows each of the text model's input embedding."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        check_config(config)
        self.audio_tower = AudioTower(config.audio_config)
        self.embed_audio = AudioEmbedder(config)
        self.pad_token = int(config.text_config.vocab_size) - 1  # HF's filler: the last id

    def encode(self, clips: Sequence[ImageInput]) -> list[torch.Tensor]:
        device = self.embed_audio.embedding_projection.weight.device
        inputs = []
        for m in clips:
            assert m.pixel_values is not None and m.image_size is not None
            inputs.append((m.pixel_values.to(device), int(m.image_size[0])))
        filler = self.embed_audio.hard(self.pad_token)
        out = []
        for rows, m in zip(self.audio_tower(inputs), clips, strict=True):
            rows = self.embed_audio.soft(rows)
            out.append(torch.cat([rows, filler.expand(m.length - rows.shape[0], -1)]))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_audio_weights(self, weights)  # (Gemma 4's names: the same prefixes)
