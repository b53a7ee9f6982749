"""Nemotron-H Omni's audio path (NemotronH_Omni_Reasoning_V3 with an audio_config): a Parakeet
(FastConformer) encoder and a relu^2 projector into the Nemotron-H decoder; its images:
multimodal/nemotron_h_omni.py.

    clip (16 kHz) -> ParakeetFeatureExtractor (transformers', torch only): log-mel [F, mels],
        F = 1 + samples // hop frames, the first `valid` = samples // hop normalized (mask)
    -> subsampling: log2(subsampling_factor) stride-2 Conv2d stages over [1, F, mels] (the first
       dense, the others depthwise + 1x1), each ReLU, rows past the valid length zeroed after
       each conv -> [T, channels * mels / factor] -> linear (x sqrt(D) where scale_input)
    -> conformer blocks: x += ff1 / 2; x += attn (relative positions, Transformer-XL style:
       q + bias_u against keys, q + bias_v against relative_k_proj of sin / cos positions
       T-1 .. -(T-1), rel-shifted); x += conv (pointwise, GLU, depthwise, BatchNorm (eval),
       act, pointwise; invalid rows zeroed first); x += ff2 / 2; norm_out
    -> embed_audio: RMSNorm (float32, eps 1e-5) -> linear_1 -> relu^2 -> linear_2
    -> the clip's first n rows, n = subsample(valid + 1) (= the processor's estimate)
    prompt: <so_embedding> -> <so_start> <so_embedding> x n <so_end>

As transformers runs it (NemotronH_Omni_Reasoning_V3Model.get_audio_features, ParakeetEncoder
with the extractor's mask): keys and queries past subsample(valid) are masked (their scores
set to float32's minimum, so a row with every key masked attends evenly to all rows, as HF's);
each clip is encoded alone here (HF batches clips padded to the longest, which changes only
such fully masked rows). The processor (NemotronH_Omni_Reasoning_V3Processor._process_audio)
always writes the marks around each run; a run already expanded, and marks already there,
stay. Weights: the Hub's `sound_encoder.encoder.*`, `sound_projection.{norm,linear1,linear2}.*`
(transformers' `audio_tower.*`, `embed_audio.*` too); `sound_encoder.feature_extractor.*`
(the Hub's featurizer buffers) is passed over, as HF does.

Refused by name: a checkpoint without audio_config; a tokenizer without <so_start> /
<so_end>; grouped key / value heads (audio_config.num_key_value_heads).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.multimodal.audio import AudioProcessor, Loaded
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import expand_runs
from paged_engine.multimodal.nemotron_h_omni import _RMSNorm
from paged_engine.multimodal.whisper_encoder import load_into

START, END = "<so_start>", "<so_end>"
# the renames of transformers' conversion_mapping.py: the Hub's names -> transformers'
_RENAMES = (
    ("sound_encoder.encoder.", "audio_tower."),
    ("sound_projection.norm.", "embed_audio.layer_norm."),
    ("sound_projection.linear1.", "embed_audio.linear_1."),
    ("sound_projection.linear2.", "embed_audio.linear_2."),
)


def check_config(config: Any) -> Any:
    """The audio_config; ValueError naming the field (or its absence) this path does not run."""
    audio = getattr(config, "audio_config", None)
    if audio is None:
        raise ValueError(
            f"{config.architectures[0]} without audio_config has no audio encoder (its "
            "checkpoints with a Parakeet sound encoder take audio)"
        )
    heads = int(audio.num_attention_heads)
    if int(getattr(audio, "num_key_value_heads", heads)) != heads:
        raise ValueError(
            f"audio_config.num_key_value_heads={audio.num_key_value_heads} is not supported "
            f"(Parakeet's attention has {heads} key / value heads)"
        )
    return audio


def subsample(frames: int, audio: Any) -> int:
    """Rows of `frames` feature frames after the stride-2 stages (transformers' formula)."""
    k, s = int(audio.subsampling_conv_kernel_size), int(audio.subsampling_conv_stride)
    pad = (k - 1) // 2 * 2 - k
    for _ in range(int(math.log2(audio.subsampling_factor))):
        frames = math.floor((frames + pad) / s + 1.0)
    return frames


class NemotronOmniAudio(AudioProcessor):
    """The host side: clips -> the checkpoint's Parakeet features, <so_embedding> -> its run."""

    def __init__(self, path: Path, config: Any, tokenizer: Any, limit: int | None = None) -> None:
        self.audio = check_config(config)
        super().__init__(path, config, tokenizer, limit)
        self.marks = [tokenizer.convert_tokens_to_ids(t) for t in (START, END)]
        if any(m is None or m == tokenizer.unk_token_id for m in self.marks):
            raise ValueError(f"{path}: the tokenizer has no {START} / {END} token for audio")
        if int(self.extractor.feature_size) != int(self.audio.num_mel_bins):
            raise ValueError(
                f"{path}: the feature extractor gives {self.extractor.feature_size} mels; the "
                f"encoder takes {self.audio.num_mel_bins} (audio_config.num_mel_bins)"
            )

    def load_extractor(self) -> Any:
        """processor_config.json's `feature_extractor` (a ParakeetFeatureExtractor's settings);
        without one, the class's defaults at audio_config.num_mel_bins."""
        from transformers import ParakeetFeatureExtractor

        saved = self.path / "processor_config.json"
        settings = (
            json.loads(saved.read_text()).get("feature_extractor") if saved.exists() else None
        )
        if not isinstance(settings, dict):
            settings = {"feature_size": int(self.audio.num_mel_bins)}
        settings = {k: v for k, v in settings.items() if k != "feature_extractor_type"}
        return ParakeetFeatureExtractor(**settings)

    def placeholder_id(self) -> int:
        return int(self.config.audio_token_id)

    def load(self, wave: np.ndarray, what: str) -> Loaded:
        out = self.extract(wave, what, return_attention_mask=True)
        valid = int(out["attention_mask"].sum())
        if valid < 2:  # the extractor's variance divides by valid - 1
            raise ValueError(f"{what}: the clip is too short ({wave.size} samples)")
        rows = max(1, subsample(valid + 1, self.audio))
        return out["input_features"][0].float(), (valid,), rows  # features [F, mels]

    def place_runs(
        self, token_ids: list[int], lengths: list[int]
    ) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """expand_runs, then <so_start> / <so_end> around each run that lacks them."""
        ids, starts, added = expand_runs(token_ids, self.placeholder, lengths, "audio")
        before, after = self.marks
        out: list[int] = []
        placed, grown, last = [], [], 0
        for at, n, (where, more) in zip(starts, lengths, added, strict=True):
            lead = not (at > 0 and ids[at - 1] == before)
            tail = not (at + n < len(ids) and ids[at + n] == after)
            out += ids[last:at] + [before] * lead
            placed.append(len(out))
            out += ids[at : at + n] + [after] * tail
            grown.append((where, more + lead + tail))
            last = at + n
        return out + ids[last:], placed, grown


class _FeedForward(nn.Module):
    def __init__(self, audio: Any) -> None:
        super().__init__()
        d, inner, bias = audio.hidden_size, audio.intermediate_size, audio.attention_bias
        self.linear1 = nn.Linear(d, inner, bias=bias)
        self.linear2 = nn.Linear(inner, d, bias=bias)
        self.act = get_act_fn(audio.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.act(self.linear1(x)))


class _Attention(nn.Module):
    def __init__(self, audio: Any) -> None:
        super().__init__()
        d, self.heads, bias = audio.hidden_size, audio.num_attention_heads, audio.attention_bias
        self.head_dim = getattr(audio, "head_dim", None) or d // self.heads
        inner = self.heads * self.head_dim
        self.q_proj = nn.Linear(d, inner, bias=bias)
        self.k_proj = nn.Linear(d, inner, bias=bias)
        self.v_proj = nn.Linear(d, inner, bias=bias)
        self.o_proj = nn.Linear(inner, d, bias=bias)
        self.relative_k_proj = nn.Linear(d, inner, bias=False)
        self.bias_u = nn.Parameter(torch.zeros(self.heads, self.head_dim))
        self.bias_v = nn.Parameter(torch.zeros(self.heads, self.head_dim))

    def forward(self, x: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """x [T, D]; pos [2T - 1, D] (offsets T-1 .. -(T-1)); keep [T, T] bool."""
        t = x.shape[0]
        projs = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = (p(x).view(t, self.heads, -1).transpose(0, 1) for p in projs)
        r = self.relative_k_proj(pos).view(-1, self.heads, self.head_dim).permute(1, 2, 0)
        bd = (q + self.bias_v[:, None]) @ r  # [H, T, 2T - 1]: query i against offset slot j
        # the rel shift: entry (i, j) becomes the score of offset i - j (Transformer-XL)
        bd = F.pad(bd, (1, 0)).view(self.heads, -1, t)[:, 1:].view(self.heads, t, -1)[..., :t]
        bd = (bd * self.head_dim**-0.5).masked_fill(~keep, torch.finfo(bd.dtype).min)
        o = F.scaled_dot_product_attention(q + self.bias_u[:, None], k, v, attn_mask=bd)
        return self.o_proj(o.transpose(0, 1).reshape(t, -1))


class _Convolution(nn.Module):
    def __init__(self, audio: Any) -> None:
        super().__init__()
        d, k, bias = audio.hidden_size, audio.conv_kernel_size, audio.convolution_bias
        self.pointwise_conv1 = nn.Conv1d(d, 2 * d, 1, bias=bias)
        self.depthwise_conv = nn.Conv1d(d, d, k, padding=(k - 1) // 2, groups=d, bias=bias)
        self.norm = nn.BatchNorm1d(d)
        self.pointwise_conv2 = nn.Conv1d(d, d, 1, bias=bias)
        self.act = get_act_fn(audio.hidden_act)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """x [T, D]; valid [T] bool: the rows any query keeps (the others zeroed first)."""
        h = F.glu(self.pointwise_conv1(x.T[None]), dim=1).masked_fill(~valid, 0.0)
        n = self.norm  # eval statistics: the checkpoint's running mean / var
        h = F.batch_norm(
            self.depthwise_conv(h),
            n.running_mean,
            n.running_var,
            n.weight,
            n.bias,
            False,
            0.0,
            n.eps,
        )
        return self.pointwise_conv2(self.act(h))[0].T


class _Block(nn.Module):
    def __init__(self, audio: Any) -> None:
        super().__init__()
        d = audio.hidden_size
        self.feed_forward1 = _FeedForward(audio)
        self.self_attn = _Attention(audio)
        self.conv = _Convolution(audio)
        self.feed_forward2 = _FeedForward(audio)
        for name in ("feed_forward1", "self_att", "conv", "feed_forward2", "out"):
            setattr(self, f"norm_{name}", nn.LayerNorm(d))

    def forward(self, x: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = x + 0.5 * self.feed_forward1(self.norm_feed_forward1(x))
        x = x + self.self_attn(self.norm_self_att(x), pos, keep)
        x = x + self.conv(self.norm_conv(x), keep.any(0))
        x = x + 0.5 * self.feed_forward2(self.norm_feed_forward2(x))
        return self.norm_out(x)


class _Subsampling(nn.Module):
    """Module indices as the Hub's Sequential: conv, relu, then (depthwise, 1x1, relu) each."""

    def __init__(self, audio: Any) -> None:
        super().__init__()
        k, s = audio.subsampling_conv_kernel_size, audio.subsampling_conv_stride
        c = audio.subsampling_conv_channels
        stages = int(math.log2(audio.subsampling_factor))
        self.layers = nn.ModuleList([nn.Conv2d(1, c, k, s, (k - 1) // 2), nn.ReLU()])
        for _ in range(stages - 1):
            self.layers.extend(
                [nn.Conv2d(c, c, k, s, (k - 1) // 2, groups=c), nn.Conv2d(c, c, 1), nn.ReLU()]
            )
        width = c * (audio.num_mel_bins // s**stages)
        self.linear = nn.Linear(width, audio.hidden_size)

    def forward(self, features: torch.Tensor, valid: int) -> torch.Tensor:
        """features [F, mels], its first `valid` frames real -> [T, D]."""
        x = features[None, None]
        for layer in self.layers:
            x = layer(x)
            if isinstance(layer, nn.Conv2d):
                k, s, p = layer.kernel_size[0], layer.stride[0], layer.padding[0]
                valid = (valid + 2 * p - k) // s + 1 if s != 1 else valid
                x[:, :, valid:] = 0.0  # rows past the clip's length, after every conv
        return self.linear(x[0].transpose(0, 1).reshape(x.shape[2], -1))


class ParakeetEncoder(nn.Module):
    def __init__(self, audio: Any) -> None:
        super().__init__()
        self.audio = audio
        d = audio.hidden_size
        self.scale = math.sqrt(d) if getattr(audio, "scale_input", False) else 1.0
        self.subsampling = _Subsampling(audio)
        self.layers = nn.ModuleList(_Block(audio) for _ in range(audio.num_hidden_layers))
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, features: torch.Tensor, valid: int) -> torch.Tensor:
        x = self.subsampling(features, valid) * self.scale
        t = x.shape[0]
        offsets = torch.arange(t - 1, -t, -1, device=x.device, dtype=torch.float)
        freqs = offsets[:, None] * self.inv_freq.to(x.device)[None]
        pos = torch.stack((freqs.sin(), freqs.cos()), dim=-1).reshape(2 * t - 1, -1).to(x.dtype)
        kept = torch.arange(t, device=x.device) < subsample(valid, self.audio)
        keep = kept[:, None] & kept[None, :]
        for layer in self.layers:
            x = layer(x, pos, keep)
        return x


class _Projector(nn.Module):
    def __init__(self, width: int, hidden: int, out: int, bias: bool) -> None:
        super().__init__()
        self.layer_norm = _RMSNorm(width, 1e-5)
        self.linear_1 = nn.Linear(width, hidden, bias=bias)
        self.linear_2 = nn.Linear(hidden, out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(torch.relu(self.linear_1(self.layer_norm(x))).square())


class NemotronOmniAudioEncoder(nn.Module):
    """The Parakeet encoder and `embed_audio`: `encode(clips)` -> each clip's [n, hidden]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        audio = check_config(config)
        self.audio_tower = ParakeetEncoder(audio)
        self.embed_audio = _Projector(
            audio.hidden_size,
            audio.projection_hidden_size,
            config.text_config.hidden_size,
            bool(audio.projection_bias),
        )

    def encode(self, clips: Sequence[ImageInput]) -> list[torch.Tensor]:
        w = self.embed_audio.linear_1.weight
        out = []
        for m in clips:  # each alone: its rows do not depend on the clips beside it
            assert m.pixel_values is not None and m.image_size
            x = self.audio_tower(m.pixel_values.to(w.device, w.dtype), int(m.image_size[0]))
            out.append(self.embed_audio(x)[: m.length])
            assert out[-1].shape[0] == m.length, (out[-1].shape, m.length)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        buffers = {n: b for n, b in self.named_buffers() if "running_" in n}

        def mine() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.removeprefix("model.")
                for hub, ours in _RENAMES:
                    if name.startswith(hub):
                        name = ours + name[len(hub) :]
                if name in buffers:  # BatchNorm's running statistics (buffers, not parameters)
                    buffers.pop(name).copy_(tensor)
                elif name.startswith(("audio_tower.", "embed_audio.")):
                    yield name, tensor

        loaded = load_into(self, mine(), "Nemotron-H Omni's audio encoder")
        if buffers:
            raise ValueError(f"the checkpoint has no {next(iter(buffers))} for the audio encoder")
        return loaded
