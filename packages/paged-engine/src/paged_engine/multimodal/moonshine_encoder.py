"""Moonshine's audio encoder (`MoonshineEncoder` in transformers): raw waveform -> frames.

    wave [N] (16 kHz) -> tanh(conv1, k 127 / s 64, no bias) -> GroupNorm(1 group)
        -> gelu(conv2, k 7 / s 3) -> gelu(conv3, k 3 / s 2)  -> [L, D], L = `encoder_frames(N)`
    -> layers: pre-LN (no bias) bidirectional self-attention with rotary positions 0..L-1
       (interleaved pairs over the first rotary dims, as the decoder), pre-LN fc1 -> act -> fc2
    -> final LayerNorm (no bias)                              -> [L, D]

No fixed window: each clip is encoded alone at its own length (transformers pads a batch to its
longest clip and GroupNorm then sees the padding too: one clip a call is its batch-of-one
output). The tower runs whole on every tensor-parallel rank (plain torch modules, names as the
checkpoint's `model.encoder.*`), attending with torch's SDPA.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.rotary import RotaryEmbedding

MIN_SAMPLES = 895  # the shortest clip the three convolutions leave 1 frame of


def encoder_frames(samples: int) -> int:
    """Frames the convolutions leave of `samples` (transformers'
    `_get_feat_extract_output_lengths`)."""
    n = (samples - 127) // 64 + 1
    n = (n - 7) // 3 + 1
    return (n - 3) // 2 + 1


class EncoderAttention(nn.Module):
    def __init__(self, d: int, heads: int, bias: bool) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.q_proj = nn.Linear(d, d, bias=bias)
        self.k_proj = nn.Linear(d, d, bias=bias)
        self.v_proj = nn.Linear(d, d, bias=bias)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding):
        # x: [L, D]
        q, k = rope(positions, self.q_proj(x), self.k_proj(x))
        shape = (1, x.shape[0], self.heads, self.head_dim)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, self.v_proj(x)))
        o = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)  # [1, H, L, Dh]
        return self.o_proj(o.transpose(1, 2).reshape(x.shape))


class EncoderMLP(nn.Module):
    def __init__(self, d: int, ffn: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, ffn)
        self.fc2 = nn.Linear(ffn, d)
        self.act = get_act_fn(act, "encoder_hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        d = int(config.hidden_size)
        self.self_attn = EncoderAttention(
            d, int(config.encoder_num_attention_heads), bool(config.attention_bias)
        )
        self.mlp = EncoderMLP(d, int(config.intermediate_size), config.encoder_hidden_act)
        self.input_layernorm = nn.LayerNorm(d, bias=False)
        self.post_attention_layernorm = nn.LayerNorm(d, bias=False)

    def forward(self, x, positions, rope) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class MoonshineEncoder(nn.Module):
    def __init__(self, config: Any, rope: RotaryEmbedding) -> None:
        super().__init__()
        d = int(config.hidden_size)
        self.conv1 = nn.Conv1d(1, d, kernel_size=127, stride=64, bias=False)
        self.conv2 = nn.Conv1d(d, 2 * d, kernel_size=7, stride=3)
        self.conv3 = nn.Conv1d(2 * d, d, kernel_size=3, stride=2)
        self.groupnorm = nn.GroupNorm(num_groups=1, num_channels=d, eps=1e-5)
        self.layers = nn.ModuleList(
            EncoderLayer(config) for _ in range(int(config.encoder_num_hidden_layers))
        )
        self.layer_norm = nn.LayerNorm(d, bias=False)
        # not a submodule: the decoder's rope (the same table) is registered there
        self._rope = (rope,)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        """One clip's samples [N] (N >= MIN_SAMPLES) -> its frames [encoder_frames(N), D]."""
        x = torch.tanh(self.conv1(wave.view(1, 1, -1)))
        x = F.gelu(self.conv2(self.groupnorm(x)))
        x = F.gelu(self.conv3(x))[0].transpose(0, 1)  # [L, D]
        positions = torch.arange(x.shape[0], device=x.device)
        for layer in self.layers:
            x = layer(x, positions, self._rope[0])
        return self.layer_norm(x)
