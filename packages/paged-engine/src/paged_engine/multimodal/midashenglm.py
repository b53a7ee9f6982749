"""MiDashengLM (`MiDashengLMModel`, remote code: mispeech/midashenglm-7b): the Dasheng audio
ViT over log-mel patches, a 5-row subsampling MLP, into Qwen2.5.

    clip (16 kHz; under 3200 samples zero-padded to 3200, as vLLM pads) of L samples
      -> log-mel [n_mels, T], T = L // 160 + 1 (host: torchaudio's MelSpectrogram +
         AmplitudeToDB(top_db=120) written with torch.stft: periodic Hann window, reflect
         padding, power 2, HTK filters without norm, 10 log10(max(x, 1e-10)) floored at the
         clip's maximum - 120 dB)
      -> init_bn (BatchNorm2d over the mels, running statistics) -> patch_embed (one n_mels x 4
         patch a step) [D, t], t = T // 4
      -> windows of target_length // 4 patches, each: + time_pos_embed[:, :, :, :width]
         + freq_pos_embed -> blocks (pre-norm ViT, LayerNorm eps 1e-6, fused qkv, exact GELU
         MLP, optional LayerScale ls1 / ls2), keys at or past L // 640 masked -> norm
      -> the windows' rows concatenated; t % 5 trailing rows dropped; 5 rows as one [5 D] row
         -> audio_projector.net.0 -> GELU -> net.2 -> n = max(1, T // 4 // 5) rows
    prompt: <|audio_bos|><|AUDIO|> x n<|audio_eos|> (vLLM's placeholder text; the one
        <|AUDIO|> (config.audio_token_id) becomes the run)

As vLLM's midashenglm.py runs it. vLLM pads a batch's clips to the longest and runs them
together; paged computes each clip alone (its own spectrogram, maximum and padding), which is
what vLLM gives for a clip served alone and what the encoder cache needs. vLLM casts the
waveform to the model dtype before its float32 front end; paged keeps it float32. Where every
key of a window is masked (a last window of one patch, that patch past L // 640) vLLM's
attention gives NaN; paged lets that window attend to itself.
The release's feature extractor is Wav2Vec2FeatureExtractor with do_normalize false (the
release processor asserts it; true is refused by name), so the waveform reaches the front end
as it is. The config: models/midashenglm_config.py (what it refuses by name); the decoder:
Qwen2 under `decoder.` (models/text_wrappers.py). The checkpoint's `audio_encoder.front_end.*`
buffers, if any, are passed over: the filters come from the config.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.models.midashenglm_config import FRAMES_PER_PATCH, HOP, SUBSAMPLE
from paged_engine.multimodal.audio import AudioProcessor, Loaded
from paged_engine.multimodal.granite_speech import htk_mel_filters, power_spectrum
from paged_engine.multimodal.inputs import ImageInput

MIN_SAMPLES = 3200  # vLLM's get_min_audio_len: shorter clips are zero-padded to it
AUDIO_TOKEN = "<|AUDIO|>"


def placeholders(samples: int) -> int:
    """vLLM's audio rows of a clip of `samples` samples: max(1, mel frames // 4 // 5)."""
    return max(1, (1 + samples // HOP) // FRAMES_PER_PATCH // SUBSAMPLE)


class LogMel:
    """The Dasheng front end's settings (audio_encoder_config) and one clip's log-mel."""

    def __init__(self, audio: Any) -> None:
        self.n_fft, self.win_length = int(audio.n_fft), int(audio.win_length)
        self.hop = int(audio.hop_length)
        self.filters = htk_mel_filters(self.n_fft, int(audio.n_mels), int(audio.sample_rate))
        self.window = torch.hann_window(self.win_length, dtype=torch.float32)

    def __call__(self, wave: np.ndarray) -> torch.Tensor:
        """[n_mels, L // hop + 1] float32 log-mel (dB) of a mono clip of L > n_fft / 2 samples."""
        power = power_spectrum(wave, self.n_fft, self.hop, self.win_length, self.window)
        mel = self.filters.T.float() @ power  # [n_mels, frames]
        db = 10.0 * mel.clamp(min=1e-10).log10()
        return torch.maximum(db, db.max() - 120.0)


class MiDashengLM(AudioProcessor):
    def load_extractor(self) -> Any:
        extractor = super().load_extractor()
        if getattr(extractor, "do_normalize", False):
            raise ValueError(
                f"{self.path}: the feature extractor's do_normalize=True is not supported: "
                "MiDashengLM's processor requires false (the waveform unnormalized)"
            )
        audio = self.config.audio_encoder_config
        if int(extractor.sampling_rate) != int(audio.sample_rate):
            raise ValueError(
                f"{self.path}: the feature extractor's sampling_rate={extractor.sampling_rate} "
                f"differs from audio_encoder_config.sample_rate={audio.sample_rate}"
            )
        self.mel = LogMel(audio)
        return extractor

    def placeholder_id(self) -> int:
        token = getattr(self.config, "audio_token_id", None)
        if token is None:
            token = self.tokenizer.convert_tokens_to_ids(AUDIO_TOKEN)
            if token is None or token == self.tokenizer.unk_token_id:
                raise ValueError(
                    f"{self.path}: config.json has no audio_token_id and the tokenizer no "
                    f"{AUDIO_TOKEN} token"
                )
        return int(token)

    def load(self, wave: np.ndarray, what: str) -> Loaded:
        wave = np.pad(wave.astype(np.float32), (0, max(0, MIN_SAMPLES - wave.size)))
        return self.mel(wave), (int(wave.size),), placeholders(wave.size)


class Block(nn.Module):
    """One Dasheng ViT block (DashengBlock's names): pre-norm attention and GELU MLP."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, qkv_bias: bool, scale: Any) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.attn.proj = nn.Linear(dim, dim)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(dim, int(dim * mlp_ratio))
        self.mlp.fc2 = nn.Linear(int(dim * mlp_ratio), dim)
        if scale:  # LayerScale (init_values set): the branches times a learned gamma
            self.ls1, self.ls2 = nn.Module(), nn.Module()
            self.ls1.gamma = nn.Parameter(torch.ones(dim))
            self.ls2.gamma = nn.Parameter(torch.ones(dim))
        self.scaled = bool(scale)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        b, n, d = x.shape  # x: [B, N, D]; keep: [B, N] keys attended, None: all
        q, k, v = self.attn.qkv(self.norm1(x)).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        mask = keep[:, None, None, :] if keep is not None else None
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        o = self.attn.proj(o.transpose(1, 2).reshape(b, n, d))
        x = x + (o * self.ls1.gamma if self.scaled else o)
        h = self.mlp.fc2(F.gelu(self.mlp.fc1(self.norm2(x))))
        return x + (h * self.ls2.gamma if self.scaled else h)


class DashengEncoder(nn.Module):
    """The Dasheng ViT (DashengAudioTransformer's names, its front end on the host)."""

    def __init__(self, audio: Any) -> None:
        super().__init__()
        d, mels = int(audio.embed_dim), int(audio.n_mels)
        self.window = int(audio.target_length) // FRAMES_PER_PATCH  # patches a window
        self.init_bn = nn.BatchNorm2d(mels, momentum=0.01)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(1, d, (mels, FRAMES_PER_PATCH), (mels, FRAMES_PER_PATCH))
        self.time_pos_embed = nn.Parameter(torch.zeros(1, d, 1, self.window))
        self.freq_pos_embed = nn.Parameter(torch.zeros(1, d, 1, 1))
        self.blocks = nn.ModuleList(
            Block(d, int(audio.num_heads), audio.mlp_ratio, bool(audio.qkv_bias), audio.init_values)
            for _ in range(int(audio.depth))
        )
        self.norm = nn.LayerNorm(d, eps=1e-6)

    def forward(self, mel: torch.Tensor, samples: int) -> torch.Tensor:
        """mel [n_mels, T] of a clip of `samples` samples -> [T // 4, D]."""
        w = self.patch_embed.proj.weight
        bn = self.init_bn
        x = F.batch_norm(  # over the mel bins (vLLM permutes them into BatchNorm2d's channels)
            mel.to(w.dtype)[None, :, None, :],
            bn.running_mean,
            bn.running_var,
            bn.weight,
            bn.bias,
            False,
            0.0,
            bn.eps,
        ).transpose(1, 2)  # [1, 1, n_mels, T]
        x = self.patch_embed.proj(x)  # [1, D, 1, t]
        t = x.shape[-1]
        keep = torch.arange(t, device=x.device) < samples // (HOP * FRAMES_PER_PATCH)
        out = []
        for at in range(0, t, self.window):
            part = x[..., at : at + self.window]
            part = part + self.time_pos_embed[..., : part.shape[-1]] + self.freq_pos_embed
            h = part.flatten(2).transpose(1, 2)  # [1, width, D]
            k = keep[at : at + self.window]
            mask = k[None] if k.any() else None  # (all masked: vLLM's NaN, see the module)
            for block in self.blocks:
                h = block(h, mask)
            out.append(self.norm(h)[0])
        return torch.cat(out)


class MiDashengLMEncoder(nn.Module):
    """The Dasheng encoder and the projector: `encode(clips)` -> each clip's [n, text hidden]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        d, hidden = int(config.audio_encoder_config.embed_dim), config.text_config.hidden_size
        self.audio_encoder = DashengEncoder(config.audio_encoder_config)
        self.audio_projector = nn.Module()
        self.audio_projector.net = nn.Sequential(
            nn.Linear(SUBSAMPLE * d, hidden), nn.GELU(), nn.Linear(hidden, hidden)
        )

    def encode(self, clips: Sequence[ImageInput]) -> list[torch.Tensor]:
        out = []
        device = self.audio_encoder.norm.weight.device
        for m in clips:
            assert m.pixel_values is not None and m.image_size is not None
            x = self.audio_encoder(m.pixel_values.to(device), m.image_size[0])
            x = x[: x.shape[0] // SUBSAMPLE * SUBSAMPLE]
            rows = self.audio_projector.net(x.reshape(-1, SUBSAMPLE * x.shape[-1]))
            if rows.shape[0] < m.length:
                raise RuntimeError(f"an audio clip gave {rows.shape[0]} rows, not {m.length}")
            out.append(rows[: m.length])
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `audio_encoder.*` / `audio_projector.*` tensors (BatchNorm's running
        statistics included; the front end's buffers and num_batches_tracked passed over);
        ValueError naming a missing one."""
        own = dict(self.named_parameters())
        own |= {n: b for n, b in self.named_buffers() if not n.endswith("num_batches_tracked")}
        loaded: set[str] = set()
        for name, tensor in weights:
            if name in own:
                if own[name].shape != tensor.shape:
                    raise ValueError(
                        f"MiDashengLM's {name} is {tuple(tensor.shape)} in the checkpoint, "
                        f"{tuple(own[name].shape)} by its config"
                    )
                own[name].data.copy_(tensor.to(own[name].dtype))
                loaded.add(name)
        missing = sorted(set(own) - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks MiDashengLM's audio encoder's {missing[0]}")
        return loaded
