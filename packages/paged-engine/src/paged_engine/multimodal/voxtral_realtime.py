"""Voxtral Realtime (VoxtralRealtimeForConditionalGeneration), offline: the whole clip given
up front, its audio added to the text stream position by position.

    clip (16 kHz, already padded as mistral_common's OFFLINE streaming request pads it)
      -> log-mel [mels, T] (the checkpoint's VoxtralRealtimeFeatureExtractor, center=True)
      -> gelu(causal conv1, k3) -> gelu(causal conv2, k3, stride 2)  [T / 2, D]
         (causal: left-padded by kernel - stride zeros, no right context)
      -> layers: RMSNorm -> causal sliding-window attention (RoPE; q / v / o biased, k not)
                 RMSNorm -> SwiGLU MLP (down_proj biased) -> RMSNorm
      -> each 4 consecutive rows as one [4 * D] row -> linear_1 -> act -> linear_2
      -> n = T / 8 rows, row t ADDED to the token embedding of text position t

The text stream is as long as the audio: the prompt (mistral_common's [BOS] then
[STREAMING_PAD] x (left pad + delay tokens)) covers its first rows and each generated token
the next; HF `generate` stops at n positions (max_length = ceil(T / 8)). Here the clip is one
`ImageInput` at offset 0 and length n (past the prompt's end), so the worker adds row t to
whichever step runs position t (worker/image_embeds.py, `adds_to_tokens`); the prompt must be
no longer than n. Generation past position n runs on token embeddings alone (HF stops there):
ask for at most n - len(prompt) tokens. The decoder's delay conditioning is folded into its
weights (models/voxtral_realtime.py).

As transformers runs it (VoxtralRealtimeModel with input_features, no caches); vLLM's
VoxtralRealtimeGeneration runs the tower inside the decoder's forward step by step with its own
KV cache, the same causal math. A mel count that is not a multiple of 8 is cut on the left as
vLLM cuts it (HF's reshape refuses it). Refused by name: the streaming options (incremental
audio: mm_processor_kwargs 'is_streaming' / 'is_first_audio_chunk' / 'num_delay_tokens'),
more than one clip a prompt, a prompt longer than its clip's rows, a rope_type other than
'default', and the transcriptions API (its prompt needs mistral_common's streaming settings).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.norm import RMSNorm  # HF's float32 reduction, as Llama's
from paged_engine.multimodal.audio import AudioProcessor, Loaded
from paged_engine.multimodal.audio_io import MAX_SECONDS
from paged_engine.multimodal.audioflamingo3 import MlpProjector
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.whisper_encoder import load_audio_weights

ARCH = "VoxtralRealtimeForConditionalGeneration"
STREAMING = ("is_streaming", "is_first_audio_chunk", "num_delay_tokens")


def frames_to_rows(frames: int, merge: int) -> int:
    """Projector rows of a clip of `frames` mel frames: conv2 halves them, `merge` a row."""
    return frames // 2 // merge


class VoxtralRealtime(AudioProcessor):
    max_audio_len = MAX_SECONDS

    def placeholder_id(self) -> int:
        return -1  # no placeholder token: the clip spans the text stream from position 0

    def load(self, wave: np.ndarray, what: str) -> Loaded:
        features = self.extract(wave, what, center=True)["input_features"][0].float()
        merge = int(self.config.downsample_factor)
        n = frames_to_rows(features.shape[-1], merge)
        if n < 1:
            raise ValueError(f"{what}: the clip is too short for one audio row")
        return features, (features.shape[-1],), n

    def process(
        self, token_ids: list[int], data: Any, kwargs: Any = None
    ) -> tuple[list[int], tuple[ImageInput, ...], list[tuple[int, int]]]:
        for name in STREAMING:
            if kwargs and name in kwargs:
                raise ValueError(
                    f"mm_processor_kwargs[{name!r}]: Voxtral Realtime is served offline only "
                    "(the whole clip given up front); streaming input is not supported"
                )
        items = data if isinstance(data, list) else [data]
        if len(items) != 1:
            raise ValueError(
                f"multi_modal_data['audio'] has {len(items)} clips: Voxtral Realtime takes "
                "exactly one clip a prompt"
            )
        return super().process(token_ids, data, kwargs)

    def place_runs(
        self, token_ids: list[int], lengths: list[int]
    ) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        (n,) = lengths
        if len(token_ids) > n:
            raise ValueError(
                f"multi_modal_data['audio']: the clip gives {n} audio rows, fewer than the "
                f"prompt's {len(token_ids)} tokens (each text position takes one; pad the clip "
                "as mistral_common's offline request does)"
            )
        return token_ids, [0], []

    def transcription_prompt(self, language: str | None, task: str, prompt: str) -> dict:
        raise ValueError(
            "model: Voxtral Realtime's transcription prompt needs mistral_common's streaming "
            "settings (left / right padding, delay tokens), which paged does not read: give "
            "prompt_token_ids and the padded clip to generate() instead"
        )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate_half RoPE on [H, T, Dh] with cos / sin [T, Dh]."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal attention over [H, T, Dh] where query i sees keys j with 0 <= i - j < window (HF's
    sliding-window causal mask), a block of `window` queries at a time against the keys they can
    see: memory O(T * window), not O(T^2), for long clips."""
    t = q.shape[1]
    if window is None or t <= window:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = []
    for start in range(0, t, window):
        end, lo = min(start + window, t), max(0, start - window + 1)
        gap = torch.arange(start, end, device=q.device)[:, None] - torch.arange(
            lo, end, device=q.device
        )
        mask = (gap >= 0) & (gap < window)
        out.append(
            F.scaled_dot_product_attention(
                q[:, start:end], k[:, lo:end], v[:, lo:end], attn_mask=mask
            )
        )
    return torch.cat(out, dim=1)


class _Layer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        d, h, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.heads, self.head_dim = h, dh
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(d, h * dh, bias=True)
        self.self_attn.k_proj = nn.Linear(d, h * dh, bias=False)
        self.self_attn.v_proj = nn.Linear(d, h * dh, bias=True)
        self.self_attn.o_proj = nn.Linear(h * dh, d, bias=True)
        self.self_attn_layer_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.final_layer_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, d, bias=True)
        self.act = get_act_fn(cfg.hidden_act)

    def forward(self, x: torch.Tensor, rope: tuple, window: int | None) -> torch.Tensor:
        t, a = x.shape[0], self.self_attn
        y = self.self_attn_layer_norm(x)  # x: [T, D]
        q, k, v = (
            p(y).view(t, self.heads, -1).transpose(0, 1) for p in (a.q_proj, a.k_proj, a.v_proj)
        )
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        o = _attend(q, k, v, window)  # [H, T, Dh]
        x = x + a.o_proj(o.transpose(0, 1).reshape(t, -1))
        y = self.final_layer_norm(x)
        return x + self.mlp.down_proj(self.act(self.mlp.gate_proj(y)) * self.mlp.up_proj(y))


class _Tower(nn.Module):
    """`audio_tower`: the causal convolutions, the layers and the final norm."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(
                f"audio_config.rope_parameters: rope_type {rope['rope_type']!r} is not supported"
                " (Voxtral Realtime's tower takes the default RoPE)"
            )
        self.theta = float(rope.get("rope_theta", 10000.0))
        self.window = int(cfg.sliding_window) if cfg.sliding_window is not None else None
        d = cfg.hidden_size
        self.embedder = nn.Module()
        self.embedder.conv1 = nn.Conv1d(cfg.num_mel_bins, d, 3)
        self.embedder.conv2 = nn.Conv1d(d, d, 3, stride=2)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head_dim = cfg.head_dim

    def forward(self, mel: torch.Tensor) -> torch.Tensor:  # [mels, T] -> [T / 2, D]
        c1, c2 = self.embedder.conv1, self.embedder.conv2
        x = F.gelu(c1(F.pad(mel[None], (2, 0))))  # left pad: kernel 3 - stride 1
        x = F.gelu(c2(F.pad(x, (1, 0))))[0].T  # kernel 3 - stride 2
        t = x.shape[0]
        pos = torch.arange(t, device=x.device, dtype=torch.float32)
        inv = self.theta ** (-torch.arange(0, self.head_dim, 2, device=x.device) / self.head_dim)
        ang = torch.outer(pos, inv.float()).repeat(1, 2)
        rope = (ang.cos().to(x.dtype), ang.sin().to(x.dtype))
        for layer in self.layers:
            x = layer(x, rope, self.window)
        return self.norm(x)


class VoxtralRealtimeEncoder(nn.Module):
    """The tower, the row merge and the projector; `adds_to_tokens`: its rows are added to the
    token embeddings of the positions they cover, not put in their place."""

    adds_to_tokens = True

    def __init__(self, config: Any) -> None:
        super().__init__()
        audio = config.audio_config
        self.merge = int(config.downsample_factor)
        self.audio_tower = _Tower(audio)
        hidden = config.text_config.hidden_size
        self.multi_modal_projector = MlpProjector(
            audio.hidden_size * self.merge, hidden, hidden, config.projector_hidden_act, False
        )

    def encode(self, clips: Sequence[ImageInput]) -> list[torch.Tensor]:
        w = self.multi_modal_projector.linear_1.weight
        out = []
        for m in clips:
            mel = m.pixel_values.to(w.device, w.dtype)  # type: ignore[union-attr]
            mel = mel[:, mel.shape[-1] % (2 * self.merge) :]  # vLLM's cut on the left
            x = self.audio_tower(mel)
            out.append(self.multi_modal_projector(x.reshape(-1, self.merge * x.shape[-1])))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_audio_weights(self, weights, "Voxtral Realtime's audio tower")
