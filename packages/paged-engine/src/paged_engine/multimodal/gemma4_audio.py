"""Gemma 4's audio path (Gemma4ForConditionalGeneration with an audio_config: E2B / E4B).

    clip (16 kHz) -> Gemma4AudioFeatureExtractor (numpy: 20 ms Hann frames every 10 ms, |rfft|,
        HTK mel bank, log(mel + floor)): [F, mels], F frames of which the first L hold audio
        (a frame is valid when its whole window is real samples); kept here as [L, mels]
    subsampling: two Conv2d(3 x 3, stride 2, no bias) over (time, mel), each on its input with
        the invalid frames zeroed, then a LayerNorm (no bias) and ReLU; the (mel, channel) grid
        of each frame flattened and projected -> n = ceil(ceil(L / 2) / 2) rows
    conformer layers (USM): half-step FFN, chunked local self-attention, light conv, half-step
        FFN, RMSNorm (each FFN: clamp, RMSNorm, swish MLP, clamp, RMSNorm, x residual_weight)
    output_proj (with bias) -> embed_audio: a weightless RMSNorm, projection to the text width
    prompt: each <|audio|> becomes <|audio> + <|audio|> x n + <audio|> (HF's processor replaces
        it in the text; the three are special tokens, so the same on the ids)

As transformers runs it: the attention is local, keys k of query q with 0 <= q - k <=
attention_context_left - 2 or 0 < k - q < attention_context_right, among the clip's valid rows.
transformers computes it in blocks of attention_chunk_size queries over a context of
C = chunk + context_left - 1 + context_right keys, with a relative-position term from
sinusoids of distances C/2 .. 0 shifted in ("rel_shift"); here it is one dense [T, T] product:
the pair (q, k) reads sinusoid index p = k - q + context_left - 1 (distance C/2 - p), and none
where p > C/2 (the shift's zero padding). Logits are q * d^-0.5 / ln 2 * softplus(per_dim_scale)
against k * ln(1 + e) / ln 2, soft-capped by tanh at attention_logit_cap, masked pairs set to
attention_invalid_logits_value, all in float32. The light conv is a depthwise causal conv, so a
valid row never reads a later (padding) row: clips of different lengths batch with their padding
masked and give each one's rows alone. Clips are cut to the extractor's max_length (30 s).

In the text model (models/gemma4.py) the audio rows are causal (use_bidirectional_attention
"vision" makes images' and videos' runs two-way, not audio's), and with per-layer inputs an
audio row reads the pad token's per-layer embedding, as an image's does.

Weight names are HF's under `[model.]audio_tower.` and `[model.]embed_audio.`. Refused by
name: a checkpoint without audio_config (26B-A4B, 31B: no audio tower), subsampling_conv_channels
other than two sizes, a mel count that does not pool to subsampling_conv_channels[0] // 4,
pipeline parallelism with per-layer inputs (later stages would not know the audio rows).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.distributed.parallel_state import get_parallel_state
from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.norm import UnitRMSNorm
from paged_engine.models.olmo2 import Olmo2RMSNorm
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.audio import AudioProcessor, Loaded
from paged_engine.multimodal.gemma4 import ClippableLinear
from paged_engine.multimodal.inputs import ImageInput

_HF_EPS = 1e-6  # transformers' default eps of the FFN and layer norms (config.rms_norm_eps unread)


def audio_rows(frames: int) -> int:
    """Encoder rows of `frames` valid feature frames: two stride-2 convolutions."""
    return (((frames + 1) // 2) + 1) // 2


def check_config(config: Any) -> None:
    """ValueError naming the audio_config field (or its absence) this tower does not run."""
    audio = getattr(config, "audio_config", None)
    if audio is None:
        raise ValueError(
            f"{config.architectures[0]} without audio_config has no audio tower (only the "
            "E2B / E4B checkpoints take audio)"
        )
    channels = list(audio.subsampling_conv_channels)
    if len(channels) != 2:
        raise ValueError(
            f"audio_config.subsampling_conv_channels={channels}: two convolutions are supported"
        )


class Gemma4Audio(AudioProcessor):
    """The host side: features of the valid frames, a bracketed run per clip."""

    def __init__(self, path: Any, config: Any, tokenizer: Any, limit: int | None = None) -> None:
        check_config(config)
        super().__init__(path, config, tokenizer, limit)
        mels = int(self.extractor.feature_size)
        channels = list(config.audio_config.subsampling_conv_channels)
        if audio_rows(mels) != channels[0] // 4:  # the projection's input width
            raise ValueError(
                f"the feature extractor's {mels} mel bins pool to {audio_rows(mels)}, not "
                f"audio_config.subsampling_conv_channels[0] // 4 = {channels[0] // 4}"
            )
        self.mels = mels
        self.bounds = self.bound_ids()

    def placeholder_id(self) -> int:
        return int(self.config.audio_token_id)

    def bound_ids(self) -> tuple[int, int]:
        """(the token before a clip's run, the token after it)."""
        end = getattr(self.config, "eoa_token_index", None)
        if end is None:
            end = self.config.eoa_token_id
        return int(self.config.boa_token_id), int(end)

    def load(self, wave: np.ndarray, what: str) -> Loaded:
        out = self.extract([wave], what)  # (as a batch: HF's processor calls it so)
        valid = int(out["input_features_mask"][0].sum())
        n = audio_rows(valid)
        if n < 1:
            raise ValueError(f"{what}: the clip is too short ({wave.size} samples)")
        features = out["input_features"][0][:valid].float().contiguous()  # [L, mels]
        return features, (valid,), n

    def place_runs(
        self, ids: list[int], lengths: list[int]
    ) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """Each lone <|audio|> -> <|audio> + the clip's run + <audio|>; a run already of the
        clip's length (HF's processor's ids) stays as it is."""
        tok, (boa, eoa) = self.placeholder, self.bounds
        runs: list[tuple[int, int]] = []  # (start, length)
        for i, t in enumerate(ids):
            if t == tok:
                if runs and sum(runs[-1]) == i:
                    runs[-1] = (runs[-1][0], runs[-1][1] + 1)
                else:
                    runs.append((i, 1))
        if len(runs) != len(lengths) or any(
            k not in (1, n) for (_, k), n in zip(runs, lengths, strict=False)
        ):
            found = ", ".join(str(k) for _, k in runs) or "none"
            raise ValueError(
                f"multi_modal_data['audio'] has {len(lengths)} audio(s) but the prompt has "
                f"{len(runs)} audio placeholder(s) (token id {tok}; runs of {found} tokens): put "
                "one audio token per clip where it belongs (or its whole run)"
            )
        out: list[int] = []
        starts: list[int] = []
        added: list[tuple[int, int]] = []
        last = 0
        for (start, k), n in zip(runs, lengths, strict=True):
            out += ids[last:start]
            bracketed = ids[start - 1 : start] == [boa] and ids[start + k : start + k + 1] == [eoa]
            if k == n and (n > 1 or bracketed):  # expanded already (HF's processor's ids)
                starts.append(len(out))
                out += ids[start : start + k]
            else:
                starts.append(len(out) + 1)
                out += [boa, *([tok] * n), eoa]
                added.append((start, n + 2 - k))
            last = start + k
        return out + ids[last:], starts, added

    def _placed(self, token_ids: list[int], items: list[ImageInput]) -> tuple[ImageInput, ...]:
        """Clips processed ahead: on their runs, each holding this model's features for it."""
        for m in items:
            self._check_placed(m)
        return super()._placed(token_ids, items)

    def _check_placed(self, m: ImageInput) -> None:
        f, size = m.pixel_values, m.image_size
        if (
            f is None
            or size is None
            or len(size) != 1
            or tuple(f.shape) != (size[0], self.mels)
            or audio_rows(size[0]) != m.length
        ):
            raise ValueError(
                "multi_modal_data['audio']: a processed clip's features do not match its "
                "placeholder run for this model"
            )


def sinusoids(positions: torch.Tensor, width: int) -> torch.Tensor:
    """[N] positions -> [N, width]: sin over width / 2 timescales 1 .. 10^4, then cos."""
    count = width // 2
    step = math.log(1.0e4) / max(count - 1, 1)
    inv = torch.exp(torch.arange(count, dtype=torch.float32, device=positions.device) * -step)
    angles = positions.float()[:, None] * inv[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class SubsampleLayer(nn.Module):
    def __init__(self, c_in: int, c_out: int, eps: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False)
        self.norm = nn.LayerNorm(c_out, eps=eps, bias=False)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [B, C, T, mels]; valid: [B, T] (the invalid frames are zeroed before the conv)
        x = self.conv((x * valid[:, None, :, None]).to(self.conv.weight.dtype))
        x = F.relu(self.norm(x.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)
        return x, valid[:, ::2]


class SubsampleProjection(nn.Module):
    def __init__(self, audio: Any) -> None:
        super().__init__()
        c0, c1 = (int(c) for c in audio.subsampling_conv_channels)
        eps = float(audio.rms_norm_eps)
        self.layer0 = SubsampleLayer(1, c0, eps)
        self.layer1 = SubsampleLayer(c0, c1, eps)
        self.input_proj_linear = nn.Linear(c0 // 4 * c1, int(audio.hidden_size), bias=False)

    def forward(self, features: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, valid = self.layer0(features[:, None], valid)  # [B, T, mels] -> [B, c0, T/2, mels/2]
        x, valid = self.layer1(x, valid)
        b, _, t, _ = x.shape
        return self.input_proj_linear(x.permute(0, 2, 3, 1).reshape(b, t, -1)), valid


class FeedForward(nn.Module):
    def __init__(self, audio: Any) -> None:
        super().__init__()
        d, clipped = int(audio.hidden_size), bool(audio.use_clipped_linears)
        self.ffw_layer_1 = ClippableLinear(d, 4 * d, clipped)
        self.ffw_layer_2 = ClippableLinear(4 * d, d, clipped)
        self.pre_layer_norm = Olmo2RMSNorm(d, _HF_EPS)
        self.post_layer_norm = Olmo2RMSNorm(d, _HF_EPS)
        self.act = get_act_fn(audio.hidden_act)
        self.clip = float(audio.gradient_clipping)
        self.scale = float(audio.residual_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = min(self.clip, torch.finfo(x.dtype).max)
        h = self.pre_layer_norm(x.clamp(-c, c))
        h = self.ffw_layer_2(self.act(self.ffw_layer_1(h)))
        return x + self.post_layer_norm(h.clamp(-c, c)) * self.scale


class LocalAttention(nn.Module):
    """Local self-attention with a relative-position term (see the module doc)."""

    def __init__(self, audio: Any) -> None:
        super().__init__()
        d, clipped = int(audio.hidden_size), bool(audio.use_clipped_linears)
        self.heads = int(audio.num_attention_heads)
        self.head_dim = d // self.heads
        for name in ("q_proj", "k_proj", "v_proj", "post"):
            setattr(self, name, ClippableLinear(d, d, clipped))
        self.relative_k_proj = nn.Linear(d, d, bias=False)
        self.per_dim_scale = nn.Parameter(torch.zeros(self.head_dim))
        self.left = int(audio.attention_context_left)
        self.right = int(audio.attention_context_right)
        context = int(audio.attention_chunk_size) + self.left - 1 + self.right
        self.half = context // 2  # sinusoid indices p = 0 .. half (distances half .. 0)
        self.cap = float(audio.attention_logit_cap)
        self.invalid = float(audio.attention_invalid_logits_value)
        self.q_scale = self.head_dim**-0.5 / math.log(2)
        self.k_scale = math.log(1 + math.e) / math.log(2)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape  # valid: [B, T], True on a clip's rows
        shape = (b, t, self.heads, self.head_dim)
        scale = self.q_scale * F.softplus(self.per_dim_scale.float())
        q = (self.q_proj(x).float().view(shape) * scale).transpose(1, 2)  # [B, H, T, hd]
        k = (self.k_proj(x).float().view(shape) * self.k_scale).transpose(1, 2)
        v = self.v_proj(x).float().view(shape).transpose(1, 2)
        distances = torch.arange(self.half, -1, -1, device=x.device)
        rel = self.relative_k_proj(sinusoids(distances, d).to(x.dtype)).float()
        rel = rel.view(-1, self.heads, self.head_dim).permute(1, 2, 0)  # [H, hd, half + 1]
        pos = torch.arange(t, device=x.device)
        ahead = pos[None, :] - pos[:, None]  # [T, T]: k - q
        p = ahead + self.left - 1
        bias = torch.gather(q @ rel, -1, p.clamp(0, self.half).expand(b, self.heads, t, t))
        logits = q @ k.transpose(-1, -2) + torch.where(p <= self.half, bias, 0.0)
        logits = torch.tanh(logits / self.cap) * self.cap
        near = ((-ahead >= 0) & (-ahead < self.left - 1)) | ((ahead > 0) & (ahead < self.right))
        keep = near[None, None] & valid[:, None, None, :]
        weights = torch.softmax(logits.masked_fill(~keep, self.invalid), dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(b, t, d)
        return self.post(out.to(x.dtype))


class CausalConv1d(nn.Conv1d):
    """A depthwise conv over time that reads a row and the kernel - 1 rows before it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, D, T]
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class LightConv(nn.Module):
    def __init__(self, audio: Any) -> None:
        super().__init__()
        d, clipped = int(audio.hidden_size), bool(audio.use_clipped_linears)
        eps = float(audio.rms_norm_eps)
        self.linear_start = ClippableLinear(d, 2 * d, clipped)
        self.linear_end = ClippableLinear(d, d, clipped)
        kernel = int(audio.conv_kernel_size)
        self.depthwise_conv1d = CausalConv1d(d, d, kernel, groups=d, bias=False)
        self.pre_layer_norm = Olmo2RMSNorm(d, eps)
        self.conv_norm = Olmo2RMSNorm(d, eps)
        self.act = get_act_fn(audio.hidden_act)
        self.clip = float(audio.gradient_clipping)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1)
        h = self.depthwise_conv1d(h.transpose(1, 2)).transpose(1, 2)
        c = min(self.clip, torch.finfo(h.dtype).max)
        return x + self.linear_end(self.act(self.conv_norm(h.clamp(-c, c))))


class ConformerLayer(nn.Module):
    def __init__(self, audio: Any) -> None:
        super().__init__()
        d = int(audio.hidden_size)
        self.feed_forward1 = FeedForward(audio)
        self.feed_forward2 = FeedForward(audio)
        self.self_attn = LocalAttention(audio)
        self.lconv1d = LightConv(audio)
        self.norm_pre_attn = Olmo2RMSNorm(d, _HF_EPS)
        self.norm_post_attn = Olmo2RMSNorm(d, _HF_EPS)
        self.norm_out = Olmo2RMSNorm(d, _HF_EPS)
        self.clip = float(audio.gradient_clipping)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        c = min(self.clip, torch.finfo(self.norm_pre_attn.weight.dtype).max)
        x = self.feed_forward1(x)
        h = self.self_attn(self.norm_pre_attn(x.clamp(-c, c)), valid)
        x = x + self.norm_post_attn(h.clamp(-c, c))
        x = self.feed_forward2(self.lconv1d(x))
        return self.norm_out(x.clamp(-c, c))


class AudioTower(nn.Module):
    """Padded clips [B, T, mels] and their valid frames -> [B, ceil(ceil(T / 2) / 2), out]."""

    def __init__(self, audio: Any) -> None:
        super().__init__()
        self.subsample_conv_projection = SubsampleProjection(audio)
        self.layers = nn.ModuleList(ConformerLayer(audio) for _ in range(audio.num_hidden_layers))
        self.output_proj = nn.Linear(int(audio.hidden_size), int(audio.output_proj_dims))

    def forward(self, features: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        x, valid = self.subsample_conv_projection(features, valid)
        for layer in self.layers:
            x = layer(x, valid)
        return self.output_proj(x)


class AudioEmbedder(nn.Module):
    """`embed_audio`: a weightless RMSNorm, then the projection to the text width."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        audio = config.audio_config
        self.embedding_pre_projection_norm = UnitRMSNorm(float(audio.rms_norm_eps))
        self.embedding_projection = nn.Linear(
            int(audio.output_proj_dims), int(config.text_config.hidden_size), bias=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))


class Gemma4AudioEncoder(nn.Module):
    """Clips -> rows of the text model's input embedding (one per audio soft token)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        check_config(config)
        per_layer = int(getattr(config.text_config, "hidden_size_per_layer_input", 0) or 0)
        if per_layer and get_parallel_state().pp_size > 1:  # later stages never see the clips
            raise ValueError(
                "Gemma 4 audio with per-layer inputs (text_config.hidden_size_per_layer_input) "
                "does not support pipeline parallelism"
            )
        self.audio_tower = AudioTower(config.audio_config)
        self.embed_audio = AudioEmbedder(config)

    def encode(self, clips: Sequence[ImageInput]) -> list[torch.Tensor]:
        device = self.embed_audio.embedding_projection.weight.device
        feats = [m.pixel_values for m in clips]  # each [L, mels]: its valid frames
        assert all(f is not None for f in feats)
        frames = [f.shape[0] for f in feats]  # type: ignore[union-attr]
        longest = max(frames)
        padded = [F.pad(f, (0, 0, 0, longest - n)) for f, n in zip(feats, frames, strict=True)]
        features = torch.stack(padded).to(device)  # [B, T, mels], zeros past each clip
        lengths = torch.tensor(frames, device=device)
        valid = torch.arange(longest, device=device)[None, :] < lengths[:, None]
        rows = self.embed_audio(self.audio_tower(features, valid))
        return [r[: m.length] for r, m in zip(rows, clips, strict=True)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_audio_weights(self, weights)


def load_audio_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """The checkpoint's `[model.]audio_tower.*` and `[model.]embed_audio.*` tensors into a
    Gemma 4 / Gemma 3n audio encoder (`module`); ValueError naming a missing or unexpected one."""

    def ours(name: str) -> str | None:
        name = name.removeprefix("model.")
        return name if name.startswith(("audio_tower.", "embed_audio.")) else None

    picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
    return load_named_weights(module, picked)
