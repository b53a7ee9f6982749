"""Phi-4-multimodal's audio (Phi4MultimodalForCausalLM: transformers' Phi4MultimodalAudioModel
and Phi4MultimodalAudioEmbedding; vLLM's phi4_multimodal.py): a conformer over log-mel frames,
then the speech projector into the text width.

    clip (16 kHz) -> Phi4MultimodalFeatureExtractor (transformers', numpy and torch):
        [T, 80] log-mel frames; n = ceil(T / audio_compression_rate) rows
    -> (x - global_mean) * global_invstd -> NeMo subsampling: a 3 x 3 stride-2 conv, then
       (depthwise 3 x 3 stride 2, pointwise 1 x 1) per further halving, `nemo_activation` after
       each; [C, T / 8, F'] -> flattened per frame -> linear to hidden: ceil(T / 8) rows
    -> past 500 rows: zero-padded to a multiple of 500 and run as windows of 500 (HF's unfold)
    -> conformer blocks, each:
         x = x + ff_in(x) / 2;  x = x + attn(norm_att(x));  x = x + conv(x);
         x = x + ff_out(x) / 2;  x = norm(x)
       ff: LayerNorm, gate_up (up * act(gate)), down. attn: biased q / k / v / o, scores +
       a T5-style relative bias per head (bias_values[clamp(j - i) + buckets / 2]) + the
       chunk mask as HF adds it: a bool mask added to the float bias is +1 where a key is in
       the query's chunk window and +0 elsewhere (never -inf; with chunk_size <= 0 every key
       gets +1, which softmax ignores). conv: LayerNorm, a GLU 1 x 1 conv (first half + b1,
       times act(second half + b2)), a causal depthwise conv (kernel k, padded k - 1 on both
       sides, the last k - 1 outputs cut), a 1 x 1 conv, act, a 1 x 1 conv
    -> up_proj_for_speech -> GELU (exact) -> down_proj_for_speech -> the first n rows; in a
       prompt that also holds images, the vision-speech projector (`*_for_vision_speech`)
    prompt: each <|audio|> (audio_config.audio_token_id) becomes a run of n

Images and audio in one prompt (in any order, several of each): each placeholder expands in
place (images first, then clips, as the input processor runs them; HF's processor expands both
in the text alike), and the clips take the vision-speech projector: HF's
Phi4MultimodalFeatureEmbedding picks it whenever the forward carries image pixels, the Hub's
remote code in its VISION_SPEECH input mode, vLLM's `embed_multimodal` after the images. A
clip's `image_size` is (frames, projector: 0 speech, 1 vision-speech), set from the prompt by
`beside_images`, so its hash (encoder cache, prefix cache) differs between the two. The
checkpoint's speech LoRA (`speech-lora/`) is served as a per-request adapter, as for images
(phi4mm.py); with images and audio the remote code runs the vision LoRA. A clip is run alone
(HF's batch of one: no padding mask).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.audio import AudioProcessor, Loaded
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import digest

_PREFIX = "model.embed_tokens_extend.audio_embed."
_WINDOW = 500  # HF's max_seq_len: longer encodings run as windows of this many rows
SPEECH, VISION_SPEECH = 0, 1  # a clip's projector (its image_size[1])


def check_config(audio: Any) -> None:
    """ValueError naming an audio_config field these steps do not run."""
    reduction = int(audio.time_reduction)
    if reduction < 2 or reduction & (reduction - 1):
        raise ValueError(f"audio_config.time_reduction={reduction} is not a power of 2 (>= 2)")
    if int(audio.downsample_rate) != 1:
        raise ValueError(f"audio_config.downsample_rate={audio.downsample_rate}: only 1 runs")
    width = int(audio.hidden_size)
    for key in ("ext_pw_out_channel", "depthwise_separable_out_channel"):
        if int(getattr(audio, key)) != width:
            raise ValueError(f"audio_config.{key}={getattr(audio, key)} is not hidden_size")
    if int(audio.depthwise_multiplier) != 1:
        raise ValueError(f"audio_config.depthwise_multiplier={audio.depthwise_multiplier}: 1")


class Phi4MMAudio(AudioProcessor):
    """The host side: clips -> transformers' features, <|audio|> -> its run."""

    def __init__(self, path: Path, config: Any, tokenizer: Any, limit: int | None = None) -> None:
        super().__init__(path, config, tokenizer, limit)
        check_config(config.audio_config)
        rate, down = self.extractor.audio_compression_rate, self.extractor.audio_downsample_rate
        if int(rate) != int(config.audio_config.time_reduction) or int(down) != 1:
            raise ValueError(
                f"the feature extractor's audio_compression_rate={rate} / audio_downsample_rate="
                f"{down} differ from audio_config.time_reduction "
                f"{config.audio_config.time_reduction} / 1 (the run would not match the rows)"
            )

    def placeholder_id(self) -> int:
        return int(self.config.audio_config.audio_token_id)

    def load(self, wave: np.ndarray, what: str) -> Loaded:
        if wave.size < int(self.extractor.win_length):
            raise ValueError(f"{what}: the clip is too short ({wave.size} samples)")
        out = self.extract(wave, what)
        features = out["audio_input_features"][0].float()  # [T, mels]
        return features, (int(features.shape[0]), SPEECH), int(out["audio_embed_sizes"][0])

    def beside_images(self, clips: tuple, with_images: bool) -> tuple[ImageInput, ...]:
        """A prompt's clips with the projector its images decide: vision-speech where the
        prompt has images, speech where it has none (clips processed ahead for another prompt
        included); the hash follows the projector."""
        projector = VISION_SPEECH if with_images else SPEECH
        out = []
        for m in clips:
            assert m.pixel_values is not None  # (process refuses a clip without features)
            size = (int(m.pixel_values.shape[0]), projector)
            if m.image_size != size:
                m = dataclasses.replace(m, image_size=size, mm_hash=digest(m.pixel_values, size))
            out.append(m)
        return tuple(out)


class _FeedForward(nn.Module):
    def __init__(self, audio: Any) -> None:
        super().__init__()
        width, inner = int(audio.hidden_size), int(audio.intermediate_size)
        self.layer_norm = nn.LayerNorm(width)
        self.gate_up_proj = nn.Linear(width, 2 * inner)
        self.down_proj = nn.Linear(inner, width)
        self.act = get_act_fn(audio.activation, "audio_config.activation")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, gate = self.gate_up_proj(self.layer_norm(x)).chunk(2, dim=-1)
        return self.down_proj(up * self.act(gate))


class _Attention(nn.Module):
    def __init__(self, audio: Any) -> None:
        super().__init__()
        width, self.heads = int(audio.hidden_size), int(audio.num_attention_heads)
        self.q_proj, self.k_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.v_proj, self.o_proj = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:  # bias [1, H, L, L]
        n, length, _ = x.shape
        q, k, v = (
            p(x).view(n, length, self.heads, -1).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.o_proj(out.transpose(1, 2).reshape(n, length, -1))


class _Glu(nn.Module):
    def __init__(self, audio: Any) -> None:
        super().__init__()
        width, out = int(audio.hidden_size), int(audio.ext_pw_out_channel)
        self.ext_pw_conv_1d = nn.Conv1d(width, 2 * out, 1)
        self.b1 = nn.Parameter(torch.zeros(1, out, 1))
        self.b2 = nn.Parameter(torch.zeros(1, out, 1))
        self.act = get_act_fn(audio.conv_glu_type, "audio_config.conv_glu_type")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, D, L]
        a, b = self.ext_pw_conv_1d(x).chunk(2, dim=1)
        return (a + self.b1) * self.act(b + self.b2)


class _Conv(nn.Module):
    def __init__(self, audio: Any) -> None:
        super().__init__()
        width, self.k = int(audio.hidden_size), int(audio.kernel_size)
        self.layer_norm = nn.LayerNorm(width)
        self.glu = _Glu(audio)
        self.dw_sep_conv_1d = nn.Module()
        self.dw_sep_conv_1d.dw_conv = nn.Conv1d(
            width, width, self.k, padding=self.k - 1, groups=width
        )
        self.dw_sep_conv_1d.pw_conv = nn.Conv1d(width, width, 1)
        self.act = get_act_fn(audio.conv_activation, "audio_config.conv_activation")
        self.ext_pw_conv_1d = nn.Conv1d(width, width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, L, D]
        h = self.glu(self.layer_norm(x).transpose(1, 2))
        h = self.dw_sep_conv_1d.pw_conv(self.dw_sep_conv_1d.dw_conv(h))
        if self.k > 1:
            h = h[:, :, : -(self.k - 1)]  # causal: output t sees inputs t - k + 1 .. t
        return self.ext_pw_conv_1d(self.act(h)).transpose(1, 2)


class _Block(nn.Module):
    def __init__(self, audio: Any) -> None:
        super().__init__()
        width = int(audio.hidden_size)
        self.feed_forward_in = _FeedForward(audio)
        self.self_attn = _Attention(audio)
        self.conv = _Conv(audio)
        self.feed_forward_out = _FeedForward(audio)
        self.layer_norm_att = nn.LayerNorm(width)
        self.layer_norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + 0.5 * self.feed_forward_in(x)
        x = x + self.self_attn(self.layer_norm_att(x), bias)
        x = x + self.conv(x)
        return self.layer_norm(x + 0.5 * self.feed_forward_out(x))


class _Subsampling(nn.Module):
    """NeMo's striding convs: frames [N, T, F] -> [N, ceil(T / r), hidden]."""

    def __init__(self, audio: Any) -> None:
        super().__init__()
        c, act = int(audio.nemo_conv_channels), audio.nemo_activation
        self.act = get_act_fn(act, "audio_config.nemo_activation")
        convs: list[nn.Module] = [nn.Conv2d(1, c, 3, stride=2, padding=1)]
        for _ in range(int(math.log2(int(audio.time_reduction))) - 1):
            convs += [nn.Conv2d(c, c, 3, stride=2, padding=1, groups=c), nn.Conv2d(c, c, 1)]
        # HF's Sequential indexes the activations too: conv.0, conv.2, conv.3, conv.5, ...
        self.conv = nn.ModuleDict()
        index = 0
        for i, conv in enumerate(convs):
            self.conv[str(index)] = conv
            index += 1 if (i > 0 and i % 2 == 1) else 2
        self.out = nn.Linear(c * int(audio.nemo_final_size), int(audio.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.unsqueeze(1)
        convs = list(self.conv.values())
        h = self.act(convs[0](h))
        for dw, pw in zip(convs[1::2], convs[2::2], strict=True):
            h = self.act(pw(dw(h)))
        n, _, t, _ = h.shape
        return self.out(h.transpose(1, 2).reshape(n, t, -1))


class _Encoder(nn.Module):
    """`encoder` (Phi4MultimodalAudioModel's names)."""

    def __init__(self, audio: Any) -> None:
        super().__init__()
        width, mels = int(audio.hidden_size), int(audio.input_size)
        self.encoder_embedding = nn.Module()
        self.encoder_embedding.global_mean = nn.Parameter(torch.zeros(mels))
        self.encoder_embedding.global_invstd = nn.Parameter(torch.ones(mels))
        self.embed = _Subsampling(audio)
        self.relative_attention_bias_layer = nn.Module()
        self.max_distance, self.symmetric = int(audio.bias_max_distance), bool(audio.bias_symmetric)
        buckets = self.max_distance * (1 if self.symmetric else 2)
        self.relative_attention_bias_layer.bias_values = nn.Embedding(
            buckets, int(audio.num_attention_heads)
        )
        self.encoders = nn.ModuleList(_Block(audio) for _ in range(int(audio.num_blocks)))
        self.chunk, self.left = int(audio.chunk_size), int(audio.left_chunk)
        self.width = width

    def _bias(self, length: int, device: torch.device) -> torch.Tensor:
        """[1, H, L, L]: the relative bias plus HF's chunk mask as +1 / +0 (see the module)."""
        pos = torch.arange(length, device=device)
        rel = (pos[None, :] - pos[:, None]).clamp(-self.max_distance, self.max_distance - 1)
        idx = rel.abs() if self.symmetric else rel + self.max_distance
        bias = self.relative_attention_bias_layer.bias_values(idx).permute(2, 0, 1)[None]
        if self.chunk > 0:
            chunk = pos // self.chunk
            seen = (chunk[None, :] >= chunk[:, None] - self.left) & (
                chunk[None, :] <= chunk[:, None]
            )
        else:
            seen = torch.ones(length, length, dtype=torch.bool, device=device)
        return bias + seen.to(bias.dtype)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:  # [T, F] -> [ceil(T / r), D]
        norm = self.encoder_embedding
        x = self.embed(((frames - norm.global_mean) * norm.global_invstd)[None])[0]
        rows = x.shape[0]
        windows = math.ceil(rows / _WINDOW) if rows > _WINDOW else 1
        length = _WINDOW if rows > _WINDOW else rows
        x = F.pad(x, (0, 0, 0, windows * length - rows)).view(windows, length, -1)
        bias = self._bias(length, x.device)
        for block in self.encoders:
            x = block(x, bias)
        return x.reshape(-1, self.width)[:rows]


class Phi4MMAudioEncoder(nn.Module):
    """Clips -> rows of the text model's input embedding (one per <|audio|> of the run)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        audio = config.audio_config
        check_config(audio)
        width, text = int(audio.hidden_size), int(config.hidden_size)
        self.encoder = _Encoder(audio)
        self.up_proj_for_speech = nn.Linear(width, text)
        self.down_proj_for_speech = nn.Linear(text, text)
        self.up_proj_for_vision_speech = nn.Linear(width, text)
        self.down_proj_for_vision_speech = nn.Linear(text, text)

    def encode(self, clips: Sequence[ImageInput]) -> list[torch.Tensor]:
        weight = self.up_proj_for_speech.weight
        out = []
        for m in clips:
            assert m.pixel_values is not None and m.image_size is not None
            x = self.encoder(m.pixel_values.to(weight.device, weight.dtype))
            if m.image_size[1] == VISION_SPEECH:  # (the prompt has images)
                up, down = self.up_proj_for_vision_speech, self.down_proj_for_vision_speech
            else:
                up, down = self.up_proj_for_speech, self.down_proj_for_speech
            out.append(down(F.gelu(up(x)))[: m.length])
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `model.embed_tokens_extend.audio_embed.*` (both projectors)."""

        def ours(name: str) -> str | None:
            if not name.startswith(_PREFIX):
                return None
            return name[len(_PREFIX) :]

        picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)
