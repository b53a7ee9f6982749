"""Fun-ASR-Nano's audio side on the worker: the SenseVoice SAN-M encoder and the adaptor.

    features [L, num_mel_bins * num_stacked_frames] (multimodal/fun_asr_nano.py: LFR frames)
    -> x * sqrt(hidden) + sinusoids of positions 1..L (over the input width)
    -> num_hidden_layers SAN-M blocks, all of them (the timestamp blocks too, as HF runs them):
        LayerNorm -> bidirectional attention (q / k / v / o with biases, no rotary) plus the
        FSMN memory on the values (v + depthwise conv(v), kernel fsmn_kernel_size, centred)
        -> + residual (not in block 0, whose input width differs) -> LayerNorm -> fc1 / act /
        fc2 -> + residual -> final LayerNorm in the last transcription and the last block
    -> the projector: linear_1 -> act -> linear_2, then the adaptor's blocks (the same block,
        no FSMN) -> n = L rows into the text model

As transformers runs it (FunAsrNanoEncoder, FunAsrNanoMultiModalProjector): its encoder masks
a batch's padded keys and zeroes the FSMN's input past each clip, but its adaptor's attention
is unmasked (its config has no attention implementation set), so a shorter clip's rows there
depend on its batch; paged computes each clip as HF does for it alone, which the encoder cache
needs. Weight names are HF's under `[model.]audio_tower.` and `[model.]multi_modal_projector.`.
Refused by name: an odd input width (the sinusoids need an even one), a hidden_size that its
heads do not divide.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.whisper_encoder import load_audio_weights


def sinusoids(length: int, channels: int) -> torch.Tensor:
    """[length, channels] float32: sin then cos of position / 10000^(i / (channels / 2 - 1))."""
    step = math.log(10_000) / (channels // 2 - 1)
    inv = torch.exp(-step * torch.arange(channels // 2).float())
    t = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([t.sin(), t.cos()], dim=1)


class Attention(nn.Module):
    """Full attention over one clip; with `fsmn`, SAN-M's memory over the values added."""

    def __init__(self, c: Any, in_dim: int, fsmn: bool, what: str) -> None:
        super().__init__()
        d = c.hidden_size
        self.heads = c.num_attention_heads
        if d % self.heads:
            raise ValueError(
                f"config.{what}.hidden_size {d} is not a multiple of its num_attention_heads "
                f"{self.heads}"
            )
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(in_dim, d) for _ in range(3))
        self.o_proj = nn.Linear(d, d)
        self.fsmn: nn.Module | None = None
        if fsmn:
            k = c.fsmn_kernel_size
            self.fsmn = nn.Module()
            self.fsmn.conv = nn.Conv1d(d, d, k, groups=d, bias=False)
            self.pad = ((k - 1) // 2, k - 1 - (k - 1) // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in]
        t = x.shape[0]
        values = self.v_proj(x)  # [T, D], before the heads split
        q, k, v = (
            h.view(t, self.heads, -1).transpose(0, 1)
            for h in (self.q_proj(x), self.k_proj(x), values)
        )
        o = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(t, -1)
        out = self.o_proj(o)
        if self.fsmn is not None:  # the memory: values + their centred depthwise convolution
            memory = self.fsmn.conv(F.pad(values.T[None], self.pad))[0].T
            out = out + memory + values
        return out


class Block(nn.Module):
    def __init__(self, c: Any, in_dim: int, fsmn: bool, final_norm: bool, what: str) -> None:
        super().__init__()
        d, eps = c.hidden_size, c.layer_norm_eps
        self.residual = in_dim == d  # HF: block 0 (LFR width in) has none
        self.input_layernorm = nn.LayerNorm(in_dim, eps=eps)
        self.self_attn = Attention(c, in_dim, fsmn, what)
        self.post_attention_layernorm = nn.LayerNorm(d, eps=eps)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(d, c.intermediate_size)
        self.mlp.fc2 = nn.Linear(c.intermediate_size, d)
        self.act = get_act_fn(c.hidden_act, f"{what}.hidden_act")
        self.final_layernorm = nn.LayerNorm(d, eps=eps) if final_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x))
        x = x + h if self.residual else h
        x = x + self.mlp.fc2(self.act(self.mlp.fc1(self.post_attention_layernorm(x))))
        return self.final_layernorm(x)


class SanmEncoder(nn.Module):
    """FunAsrNanoEncoder: [L, input width] -> [L, hidden]."""

    def __init__(self, c: Any) -> None:
        super().__init__()
        width = c.num_mel_bins * c.num_stacked_frames
        if width % 2:
            raise ValueError(
                f"config.audio_config: num_mel_bins * num_stacked_frames {width} is odd (its "
                "sinusoidal positions need an even width)"
            )
        self.max_rows = c.max_position_embeddings - 1  # positions count from one
        self.register_buffer(
            "positions", sinusoids(c.max_position_embeddings, width), persistent=False
        )
        self.scale = c.hidden_size**0.5
        last = c.num_hidden_layers - 1
        norms = {last - c.num_timestamp_prediction_layers, last}
        self.layers = nn.ModuleList(
            Block(c, width if i == 0 else c.hidden_size, True, i in norms, "audio_config")
            for i in range(c.num_hidden_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.scale + self.positions[1 : x.shape[0] + 1].to(x.dtype)
        for layer in self.layers:
            x = layer(x)
        return x


class FunAsrNanoEncoder(nn.Module):
    """The encoder and the projector: `encode(clips)` -> each clip's [L, text hidden]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        a = config.adaptor_config
        self.audio_tower = SanmEncoder(config.audio_config)
        p = self.multi_modal_projector = nn.Module()
        p.linear_1 = nn.Linear(config.audio_config.hidden_size, a.projector_hidden_size)
        p.linear_2 = nn.Linear(a.projector_hidden_size, a.hidden_size)
        p.layers = nn.ModuleList(
            Block(a, a.hidden_size, False, False, "adaptor_config")
            for _ in range(a.num_hidden_layers)
        )
        self.act = get_act_fn(a.projector_hidden_act, "adaptor_config.projector_hidden_act")

    def encode(self, clips: Sequence[ImageInput]) -> list[torch.Tensor]:
        p = self.multi_modal_projector
        w = p.linear_1.weight
        out = []
        for m in clips:  # one clip at a time: its rows are those of the clip alone
            assert m.pixel_values is not None
            h = self.audio_tower(m.pixel_values.to(device=w.device, dtype=w.dtype))
            h = p.linear_2(self.act(p.linear_1(h)))
            for layer in p.layers:
                h = layer(h)
            out.append(h)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_audio_weights(self, weights, "Fun-ASR-Nano's audio encoder")
