"""Audio of the Qwen2.5-Omni and Qwen3-Omni thinkers: Whisper-style towers over windowed chunks.

    clip (16 kHz) -> WhisperFeatureExtractor: L valid frames of log-mels [mels, L]
    -> chunks of 2 * n_window frames (the last one shorter), each run through the convolutions
       with fresh sinusoid positions 0, 1, ...
    Qwen2.5-Omni: conv1, conv2 (stride 2: r(l) = (l - 1) // 2 + 1 rows a chunk) -> layers, each
        chunk attending to itself -> the clip's rows pooled in pairs (AvgPool1d(2)) -> ln_post
        -> proj: n = (r(L) - 2) // 2 + 1 rows
    Qwen3-Omni: three stride-2 Conv2d over (mels, frames) -> conv_out -> layers, windows of
        n_window_infer / (2 * n_window) chunks attending to themselves -> ln_post -> proj1
        -> act -> proj2: n = 13 rows a full chunk plus r(r(r(L % (2 * n_window))))
    prompt: <|audio_bos|> <|AUDIO|> (Qwen3-Omni: <|audio_pad|>) x n <|audio_eos|> (the chat
        template writes the one token, the processor expands it)

What differs from Whisper's encoder (multimodal/whisper_encoder.py: its layers are reused;
Qwen3-Omni's key projection has a bias), as transformers runs it:
- Qwen2.5-Omni's extractor pads each clip to its window (preprocessor_config chunk_length, 300 s
  on the Hub) and cuts a longer clip there; Qwen3-Omni's pads a prompt's clips to the longest
  of them and cuts nothing, so a clip's last frames (and, off a multiple of the hop, its frame
  count) depend on the longest clip beside it: `Qwen3OmniAudio.load_clips` extracts a prompt's
  clips in one call, as the processor does.
- Qwen2.5-Omni zeroes each chunk's padded frames after conv1, so a chunk's rows are those it
  gives alone. Qwen3-Omni does not mask between its convolutions: HF pads every chunk of a call
  to the longest chunk, and the last rows of a short chunk read that padding. Here a clip's
  chunks are padded as HF pads them when the clip is alone (to 2 * n_window when it has
  several); a clip under one chunk batched in HF beside a longer one gets other last rows.
- Audio placeholders take text positions in all three M-RoPE rows (get_rope_index with
  use_audio_in_video=False: position_id_per_seconds only scales video frames): the input
  processor leaves audio items out of the image / video M-RoPE table. Qwen3-Omni's deepstack
  rows go to image positions only: an audio row's deepstack additions are zeros.

Weights: `audio_tower.*` (thinker), `thinker.audio_tower.*` (the whole model), `model.` in front
in transformers 5's saves; Qwen2.5-Omni's `audio_bos_eos_token` (the talker's) is not read.

Refused by name: audio_config.output_dim other than the text hidden size; n_window < 1;
max_source_positions under a chunk's rows; an odd d_model (the sinusoids' sin | cos halves);
Qwen3-Omni's n_window whose full chunk is not 13 rows (transformers counts a full chunk as 13
rows whatever n_window is) and n_window_infer under one chunk (2 * n_window frames); a clip too
short for one row (multi_modal_data['audio'][i]).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.multimodal.audio import AudioProcessor, Loaded
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.qwen2_audio import output_rows
from paged_engine.multimodal.whisper_encoder import EncoderLayer, WhisperEncoder, load_into

_FULL_CHUNK_ROWS = 13  # what transformers' Qwen3-Omni length rule gives a full chunk


def halved(n: int) -> int:
    """Rows out of a kernel-3, stride-2, padding-1 convolution over `n` rows."""
    return (n - 1) // 2 + 1


def qwen3_rows(frames: int, n_window: int) -> int:
    """Qwen3-Omni's encoder rows for `frames` feature frames (full chunks, then the rest)."""
    full, rest = divmod(frames, 2 * n_window)
    return full * _FULL_CHUNK_ROWS + (halved(halved(halved(rest))) if rest else 0)


def check_audio_config(config: Any, qwen3: bool, positions: str = "max_source_positions") -> None:
    """ValueError naming the audio_config field the tower could not run as HF runs it
    (`positions`: the field sizing its sinusoids)."""
    audio = config.audio_config
    if int(audio.output_dim) != int(config.text_config.hidden_size):
        raise ValueError(
            f"audio_config.output_dim={audio.output_dim} must be the text hidden size "
            f"({config.text_config.hidden_size}): the tower's rows replace token embeddings"
        )
    n = int(audio.n_window)
    if n < 1:
        raise ValueError(f"audio_config.n_window={n} must be at least 1")
    chunk_rows = halved(halved(halved(2 * n))) if qwen3 else halved(2 * n)
    if qwen3 and chunk_rows != _FULL_CHUNK_ROWS:
        raise ValueError(
            f"audio_config.n_window={n}: a full chunk of {2 * n} frames gives {chunk_rows} "
            f"rows, but transformers counts {_FULL_CHUNK_ROWS} (n_window 49 to 52 agree)"
        )
    if int(getattr(audio, positions)) < chunk_rows:
        raise ValueError(
            f"audio_config.{positions}={getattr(audio, positions)} is under the {chunk_rows} "
            "rows of a chunk"
        )
    if qwen3 and int(audio.n_window_infer) < 2 * n:
        raise ValueError(
            f"audio_config.n_window_infer={audio.n_window_infer} must be at least one chunk "
            f"(2 * n_window = {2 * n} frames)"
        )


class Qwen2_5OmniAudio(AudioProcessor):
    """Each clip padded to the extractor's window (and cut there), as the processor does."""

    def placeholder_id(self) -> int:
        return int(self.config.audio_token_id)

    def load(self, wave: np.ndarray, what: str) -> Loaded:
        out = self.extract(wave, what, padding="max_length", return_attention_mask=True)
        valid = int(out["attention_mask"][0].sum())
        if valid < 3:  # (under two rows after conv2: nothing to pool)
            raise ValueError(f"{what}: the clip is too short ({wave.size} samples)")
        features = out["input_features"][0, :, :valid].float().contiguous()
        return features, (valid,), output_rows(valid)


class Qwen3OmniAudio(AudioProcessor):
    """A prompt's clips extracted together, padded to the longest and never cut."""

    def placeholder_id(self) -> int:
        return int(self.config.audio_token_id)

    def load(self, wave: np.ndarray, what: str) -> Loaded:
        return self.load_clips([wave], [what])[0]

    def load_clips(self, waves: list[np.ndarray], whats: list[str]) -> list[Loaded]:
        what = whats[0] if len(whats) == 1 else "multi_modal_data['audio']"
        out = self.extract(
            waves, what, padding="longest", truncation=False, return_attention_mask=True
        )
        n_window = int(self.config.audio_config.n_window)
        loaded = []
        for i, (wave, name) in enumerate(zip(waves, whats, strict=True)):
            valid = int(out["attention_mask"][i].sum())
            if valid < 1:
                raise ValueError(f"{name}: the clip is too short ({wave.size} samples)")
            features = out["input_features"][i, :, :valid].float().contiguous()
            loaded.append((features, (valid,), qwen3_rows(valid, n_window)))
        return loaded


def sinusoids(length: int, channels: int) -> torch.Tensor:
    """Fixed positions [length, channels]: sin | cos of p / 10000^(i / (channels / 2 - 1))."""
    if channels % 2 or channels < 4:
        raise ValueError(f"audio_config.d_model={channels} must be even and at least 4")
    step = math.log(10_000) / (channels // 2 - 1)
    inv = torch.exp(-step * torch.arange(channels // 2, dtype=torch.float32))
    t = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1)


def _key_mask(lengths: list[int], width: int, device: torch.device) -> torch.Tensor | None:
    """[B, 1, 1, width]: True where a row is one of its sequence's first `lengths[b]`."""
    if min(lengths) == width:
        return None
    rows = torch.arange(width, device=device)
    return (rows[None, :] < torch.tensor(lengths, device=device)[:, None])[:, None, None, :]


def _run_layers(layers: nn.ModuleList, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """The layers over `pieces` ([rows, D] each attending only to itself), as one batch."""
    lengths = [p.shape[0] for p in pieces]
    x = nn.utils.rnn.pad_sequence(pieces, batch_first=True)
    mask = _key_mask(lengths, x.shape[1], x.device)
    for layer in layers:
        x = layer(x, mask)
    return [x[i, :n] for i, n in enumerate(lengths)]


class Qwen2_5OmniAudioTower(WhisperEncoder):
    """Whisper's convolutions and layers; sinusoid positions per chunk, pooled, ln_post, proj."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        del self.embed_positions, self.layer_norm  # (fixed sinusoids, ln_post in their place)
        d = config.d_model
        self.ln_post = nn.LayerNorm(d)
        self.proj = nn.Linear(d, config.output_dim)
        self.window = 2 * int(config.n_window)  # feature frames a chunk
        positions = sinusoids(config.max_source_positions, d)
        self.register_buffer("positions", positions, persistent=False)

    def forward(self, clips: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each clip's features [mels, L] -> its rows [(r(L) - 2) // 2 + 1, output_dim]."""
        w = self.conv1.weight
        chunks = [c for f in clips for c in f.split(self.window, dim=-1)]
        frames = [c.shape[-1] for c in chunks]
        x = torch.stack([F.pad(c, (0, self.window - c.shape[-1])) for c in chunks]).to(w)
        # a chunk's padded frames are zeros after conv1: its rows are those it gives alone
        keep = _key_mask(frames, self.window, w.device)
        x = F.gelu(self.conv1(x))
        if keep is not None:
            x = x * keep[:, 0]
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [chunks, n_window, D]
        x = x + self.positions[: x.shape[1]].to(x.dtype)
        rows = [halved(n) for n in frames]
        out = _run_layers(self.layers, [x[i, :r] for i, r in enumerate(rows)])
        flat = torch.cat(out)  # every clip's rows, clip after clip
        pooled = []
        for h in flat.split([halved(f.shape[-1]) for f in clips]):
            pairs = h.shape[0] // 2  # (an odd last row is dropped, as AvgPool1d drops it)
            pooled.append(h[: 2 * pairs].view(pairs, 2, -1).mean(dim=1))
        return list(self.proj(self.ln_post(torch.cat(pooled))).split([len(p) for p in pooled]))


class _BiasedKeyLayer(EncoderLayer):
    """Whisper's layer with a key bias (Qwen3-Omni's k_proj has one)."""

    def __init__(self, d: int, heads: int, ffn: int, act: str) -> None:
        super().__init__(d, heads, ffn, act)
        self.self_attn.k_proj = nn.Linear(d, d)


class Qwen3AudioTower(nn.Module):
    """Three Conv2d over (mels, frames) per chunk, conv_out, layers over attention windows,
    ln_post (Qwen3-Omni's tower and Qwen3-ASR's, without their heads)."""

    positions_field = "max_source_positions"  # the audio_config field sizing the sinusoids

    def __init__(self, config: Any) -> None:
        super().__init__()
        d, c = config.d_model, config.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, c, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(c, c, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(c, c, 3, 2, padding=1)
        mels = halved(halved(halved(config.num_mel_bins)))
        self.conv_out = nn.Linear(c * mels, d, bias=False)
        act = config.activation_function
        self.layers = nn.ModuleList(
            _BiasedKeyLayer(d, config.encoder_attention_heads, config.encoder_ffn_dim, act)
            for _ in range(config.encoder_layers)
        )
        self.ln_post = nn.LayerNorm(d)
        self.window = 2 * int(config.n_window)
        # attention windows: whole chunks' rows (n_window_infer frames' worth)
        self.window_rows = _FULL_CHUNK_ROWS * (int(config.n_window_infer) // self.window)
        positions = sinusoids(getattr(config, self.positions_field), d)
        self.register_buffer("positions", positions, persistent=False)

    def chunks(self, features: torch.Tensor, valid: int) -> tuple[torch.Tensor, list[int]]:
        """One clip's features [mels, L] -> (its chunks [c, mels, width], each one's valid
        frames). HF pads a call's chunks to its longest one; here a clip's are padded as when
        it runs alone: to 2 * n_window when it has several (a short last chunk's last rows
        read the padding)."""
        parts = features[:, :valid].split(self.window, dim=-1)
        width = self.window if len(parts) > 1 else valid
        x = torch.stack([F.pad(c, (0, width - c.shape[-1])) for c in parts])
        return x, [c.shape[-1] for c in parts]

    def _conv_rows(self, features: torch.Tensor, valid: int) -> torch.Tensor:
        """One clip's features -> its rows [rows, D] before the layers."""
        w = self.conv2d1.weight
        x, frames = self.chunks(features, valid)
        x = x[:, None].to(w)  # [chunks, 1, mels, width]
        for conv in (self.conv2d1, self.conv2d2, self.conv2d3):
            x = F.gelu(conv(x))
        b, c, f, t = x.shape
        x = self.conv_out(x.permute(0, 3, 1, 2).reshape(b, t, c * f))
        x = x + self.positions[:t].to(x.dtype)
        rows = [halved(halved(halved(n))) for n in frames]
        return torch.cat([x[i, :r] for i, r in enumerate(rows)])

    def hidden(self, clips: Sequence[torch.Tensor], valid: Sequence[int]) -> list[torch.Tensor]:
        """Each clip's features and valid frames L -> its rows [qwen3_rows(L), D]."""
        rows = [self._conv_rows(f, n) for f, n in zip(clips, valid, strict=True)]
        windows = [win for r in rows for win in r.split(self.window_rows)]
        flat = self.ln_post(torch.cat(_run_layers(self.layers, windows)))
        return list(flat.split([r.shape[0] for r in rows]))


class Qwen3OmniAudioTower(Qwen3AudioTower):
    """Qwen3-Omni's tower: its rows through proj1 -> act -> proj2 into the text width."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        d = config.d_model
        self.proj1 = nn.Linear(d, d)
        self.act = get_act_fn(config.activation_function, "audio_config.activation_function")
        self.proj2 = nn.Linear(d, config.output_dim)

    def forward(self, clips: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each clip's features [mels, L] -> its rows [qwen3_rows(L), output_dim]."""
        rows = self.hidden(clips, [f.shape[-1] for f in clips])
        out = self.proj2(self.act(self.proj1(torch.cat(rows))))
        return list(out.split([r.shape[0] for r in rows]))


def _audio_tower(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tower's tensors named from `audio_tower.` (thinker / whole-model prefixes off)."""
    for name, tensor in weights:
        inner = name.removeprefix("thinker.").removeprefix("model.")
        if inner.startswith("audio_tower."):
            yield inner, tensor


class Qwen2_5OmniAudioEncoder(nn.Module):
    """`encode(clips)` -> each clip's [n, text hidden] (the tower ends in the text width)."""

    qwen3 = False
    what = "Qwen2.5-Omni's audio tower"

    def __init__(self, config: Any) -> None:
        super().__init__()
        check_audio_config(config, self.qwen3)
        tower = Qwen3OmniAudioTower if self.qwen3 else Qwen2_5OmniAudioTower
        self.audio_tower = tower(config.audio_config)

    def encode(self, clips: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each clip's rows; an item with image_size (frames, lo, hi) (a run of a video's
        clip, omni_av.py) takes rows [lo, hi) of its whole clip's, each clip run once."""
        device = next(self.audio_tower.parameters()).device
        whole: dict[str, int] = {}  # a clip's features (by identity and size) -> its index
        features: list[torch.Tensor] = []
        for m in clips:
            f = m.pixel_values
            assert f is not None and m.image_size is not None
            key = f"{id(f)}:{m.image_size[0]}"
            if key not in whole:
                whole[key] = len(features)
                features.append(f.to(device))
        rows = self.audio_tower(features)
        out = []
        for m in clips:
            r = rows[whole[f"{id(m.pixel_values)}:{m.image_size[0]}"]]  # type: ignore[index]
            out.append(r[m.image_size[1] : m.image_size[2]] if len(m.image_size) == 3 else r)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_into(self, _audio_tower(weights), self.what)


class Qwen3OmniAudioEncoder(Qwen2_5OmniAudioEncoder):
    """Qwen3-Omni's tower; rows [n, 1 + k, D] with k zero deepstack rows where the thinker's
    image tower has k deepstack layers (an image and a clip share a step's additions)."""

    qwen3 = True
    what = "Qwen3-Omni's audio tower"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.num_deepstack = len(getattr(config.vision_config, "deepstack_visual_indexes", ()))

    def encode(self, clips: Sequence[ImageInput]) -> list[torch.Tensor]:
        rows = super().encode(clips)
        if not self.num_deepstack:
            return rows
        return [
            torch.cat([r[:, None], r.new_zeros(r.shape[0], self.num_deepstack, r.shape[1])], 1)
            for r in rows
        ]
