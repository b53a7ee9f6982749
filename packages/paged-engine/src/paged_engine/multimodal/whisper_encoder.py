"""Whisper's audio encoder, the tower of the audio LLMs built on it (Qwen2-Audio, ...).

    features [B, mels, F]  -> gelu(conv1, k3)  -> gelu(conv2, k3, stride 2)  [B, F / 2, D]
      + embed_positions[: F / 2]  -> pre-LN layers (self-attention, fc1 -> act -> fc2)
      -> (the caller's pooling) -> layer_norm

As transformers runs it: q is scaled before the product (q * d^-0.5, k_proj without bias); a
frame past a clip's valid length (`valid`: frames after conv2) is no key for anyone (the
processors pad each clip to the window; HF masks the padding as keys). Valid rows never read a
padded one except through conv2's last kernel tap, so `forward` drops the padded rows after the
convolutions: the valid rows come out as HF's.

Weight names are HF's (`conv1.*`, `embed_positions.weight`, `layers.i.self_attn.q_proj.*`,
`layers.i.fc1.*`, `layer_norm.*`); `pool` (Qwen2-Audio's AvgPool1d(2)) runs before the final
norm where the family has one. `load_into` copies a checkpoint's tensors into a tower,
`load_audio_weights` a wrapper's `[model.]audio_tower.*` / `multi_modal_projector.*` ones (the
audio LLMs').
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn


class EncoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int, act: str) -> None:
        super().__init__()
        self.heads = heads
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(d, d)
        self.self_attn.k_proj = nn.Linear(d, d, bias=False)
        self.self_attn.v_proj = nn.Linear(d, d)
        self.self_attn.out_proj = nn.Linear(d, d)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ffn)
        self.fc2 = nn.Linear(ffn, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = get_act_fn(act)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, d = x.shape
        a = self.self_attn
        h = self.self_attn_layer_norm(x)
        q = (a.q_proj(h) * (d // self.heads) ** -0.5).view(b, t, self.heads, -1).transpose(1, 2)
        k = a.k_proj(h).view(b, t, self.heads, -1).transpose(1, 2)
        v = a.v_proj(h).view(b, t, self.heads, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        x = x + a.out_proj(o.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    """Whisper's encoder over padded clips; `pool`: a pooling of the frames before the norm."""

    def __init__(self, config: Any, pool: nn.Module | None = None) -> None:
        super().__init__()
        d = config.d_model
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, d)
        self.layers = nn.ModuleList(
            EncoderLayer(
                d,
                config.encoder_attention_heads,
                config.encoder_ffn_dim,
                config.activation_function,
            )
            for _ in range(config.encoder_layers)
        )
        self.layer_norm = nn.LayerNorm(d)
        self.pool = pool
        # (scale_embedding is not read: HF's encoders define the scale but never apply it)
        self.frames = config.max_source_positions * 2  # the feature window the convs take

    def forward(self, features: torch.Tensor, valid: list[int]) -> torch.Tensor:
        """features [B, mels, frames] (each clip padded to the window) -> [B, T, D] over the
        longest clip's valid rows, each clip's rows past its own `valid` count masked as keys
        (their outputs are padding)."""
        if features.shape[-1] != self.frames:
            raise ValueError(
                f"audio features of {features.shape[-1]} frames; the encoder takes "
                f"{self.frames} (max_source_positions * 2)"
            )
        w = self.conv1.weight
        x = F.gelu(self.conv1(features.to(w.dtype)))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        t = max(valid)
        x = x[:, :t] + self.embed_positions.weight[:t]
        mask = None
        if min(valid) < t:
            keys = (
                torch.arange(t, device=x.device)[None, :]
                < torch.tensor(valid, device=x.device)[:, None]
            )
            mask = keys[:, None, None, :]  # [B, 1, 1, T]: True where a key is read
        for layer in self.layers:
            x = layer(x, mask)
        if self.pool is not None:
            x = self.pool(x.transpose(1, 2)).transpose(1, 2)
        return self.layer_norm(x)


def load_into(
    module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], what: str
) -> set[str]:
    """Copy `weights` (names as `module`'s parameters; others passed over) into `module`;
    ValueError naming the first parameter the checkpoint lacks."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if name in params:
            params[name].data.copy_(tensor.to(params[name].dtype))
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"the checkpoint lacks {what}'s {missing[0]}")
    return loaded


def load_audio_weights(
    module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], what: str
) -> set[str]:
    """The checkpoint's `[model.]audio_tower.*` and `[model.]multi_modal_projector.*` into
    `module` (which holds both under those names)."""

    def mine() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith(("audio_tower.", "multi_modal_projector.")):
                yield name, tensor

    return load_into(module, mine(), what)
