"""GLM-ASR (GlmAsrForConditionalGeneration): a Whisper-style tower with rotary positions, four
frames merged into each projector row, into a Llama decoder.

    clip (16 kHz) -> windows of chunk_length s, each padded to the window (as Audio Flamingo 3:
        multimodal/audioflamingo3.py's host side, at most max_audio_len = 655 s)
      -> gelu(conv1) -> gelu(conv2, stride 2)  [windows, F / 2, D] (Whisper's convolutions)
      -> layers: x + o_proj(attn(rope(q), rope(k), v)) over input_layernorm(x), then
         x + fc2(act(fc1(post_attention_layernorm(x)))) -> norm
      -> 4 consecutive rows as one [4 * D] row -> linear_1 -> act -> linear_2
      -> each window's first ((L_w - 1) // 2 + 1 - 4) // 4 + 1 rows (L_w valid frames)

As transformers runs it (GlmAsrEncoder, GlmAsrModel): the tower has no learned positions and no
padding mask: every row of a window, padding included, is a key for every other, so each window
runs whole. Rope is NeoX-style (halves rotated) on the first partial_rotary_factor of each head,
position = row index in the window; q and v have biases, k none; grouped k / v heads where
num_key_value_heads says. Weights: `audio_tower.{conv1,conv2,layers.i.*,norm}.*`,
`multi_modal_projector.linear_{1,2}.*`.

`transcription_prompt` is GlmAsrProcessor's `apply_transcription_request`: a user turn of the
clip then the prompt text (default "Please transcribe this audio into text").

Refused by name: a rope other than the default (audio_config.rope_parameters), a merge other
than 4 rows (audio_config.intermediate_size must be 4 * hidden_size), a window whose conv rows
are not a multiple of 4 (the feature extractor's chunk_length), plus Audio Flamingo 3's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.multimodal.audioflamingo3 import (
    AudioFlamingo3,
    MlpProjector,
    clip_rows,
    load_audio_weights,
)
from paged_engine.multimodal.inputs import ImageInput

MERGE = 4  # conv rows per projector row (GlmAsrProcessor's merge_factor)


def output_rows(frames: int) -> int:
    """Projector rows of one window of `frames` valid feature frames."""
    return max(0, ((frames - 1) // 2 + 1 - MERGE) // MERGE + 1)


class GlmAsr(AudioFlamingo3):
    max_audio_len = 655.0
    default_transcription_prompt = "Please transcribe this audio into text"
    audio_first = True

    def check_window(self, frames: int, mels: int) -> None:
        audio = self.config.audio_config
        if mels != int(audio.num_mel_bins):
            raise ValueError(
                f"{self.path}: the feature extractor gives {mels} mels; the audio tower takes "
                f"{audio.num_mel_bins} (audio_config.num_mel_bins)"
            )
        if (frames // 2) % MERGE:
            raise ValueError(
                f"{self.path}: the feature extractor's chunk_length={self.extractor.chunk_length} "
                f"s gives {frames // 2} rows a window after conv2, not a multiple of {MERGE}"
            )

    def rows(self, frames: int) -> int:
        return output_rows(frames)


class Layer(nn.Module):
    def __init__(self, config: Any, head_dim: int) -> None:
        super().__init__()
        d, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.heads, self.kv, self.head_dim = heads, kv, head_dim
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(d, heads * head_dim)
        self.self_attn.k_proj = nn.Linear(d, kv * head_dim, bias=False)
        self.self_attn.v_proj = nn.Linear(d, kv * head_dim)
        self.self_attn.o_proj = nn.Linear(heads * head_dim, d)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(d, config.intermediate_size)
        self.mlp.fc2 = nn.Linear(config.intermediate_size, d)
        self.act = get_act_fn(config.hidden_act)
        self.input_layernorm = nn.LayerNorm(d)
        self.post_attention_layernorm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # x: [B, T, D]; cos / sin: [T, rotary dim]
        a = self.self_attn
        h = self.input_layernorm(x)
        q = a.q_proj(h).view(b, t, self.heads, -1).transpose(1, 2)
        k = a.k_proj(h).view(b, t, self.kv, -1).transpose(1, 2)
        v = a.v_proj(h).view(b, t, self.kv, -1).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, enable_gqa=self.kv != self.heads)
        x = x + a.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.post_attention_layernorm(x))))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of the first cos.shape[-1] dims of each head; the rest pass."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    x1, x2 = rot.chunk(2, dim=-1)
    rot = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rot, rest), dim=-1)


class GlmAsrTower(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        d = config.hidden_size
        rope = dict(config.rope_parameters or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(
                f"audio_config.rope_parameters: rope_type {rope['rope_type']!r} in GLM-ASR's "
                "audio tower is not supported (the default rope is)"
            )
        head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
        dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.layers = nn.ModuleList(
            Layer(config, head_dim) for _ in range(config.num_hidden_layers)
        )
        self.norm = nn.LayerNorm(d)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [W, mels, frames] (whole windows) -> [W, frames / 2, D]."""
        w = self.conv1.weight
        x = F.gelu(self.conv1(features.to(w.dtype)))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        pos = torch.arange(x.shape[1], device=x.device, dtype=torch.float)
        freqs = pos[:, None] * self.inv_freq.to(x.device)[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class GlmAsrEncoder(nn.Module):
    """The tower, the 4-row merge and the projector: `encode(clips)` -> [n, text hidden] each."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        audio = config.audio_config
        if audio.intermediate_size != MERGE * audio.hidden_size:
            raise ValueError(
                f"audio_config.intermediate_size={audio.intermediate_size}: GLM-ASR's projector "
                f"reads {MERGE} tower rows at once, so it must be {MERGE} * hidden_size "
                f"({MERGE * audio.hidden_size})"
            )
        hidden = config.text_config.hidden_size
        self.audio_tower = GlmAsrTower(audio)
        self.multi_modal_projector = MlpProjector(
            audio.intermediate_size, 2 * hidden, hidden, config.projector_hidden_act, True
        )

    def encode(self, clips: Sequence[ImageInput]) -> list[torch.Tensor]:
        assert all(m.pixel_values is not None and m.image_size for m in clips)
        w = self.multi_modal_projector.linear_1.weight
        features = torch.cat([m.pixel_values for m in clips]).to(w.device)  # type: ignore[misc]
        frames = [v for m in clips for v in m.image_size]  # type: ignore[union-attr]
        x = self.audio_tower(features)
        x = self.multi_modal_projector(x.reshape(x.shape[0], -1, MERGE * x.shape[-1]))
        rows = [r[: output_rows(v)] for r, v in zip(x, frames, strict=True)]
        return clip_rows(clips, rows)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_audio_weights(self, weights, "GLM-ASR's audio tower")
