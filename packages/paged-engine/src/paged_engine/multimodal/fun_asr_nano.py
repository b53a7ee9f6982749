"""Fun-ASR-Nano (FunAsrNanoForConditionalGeneration): a SenseVoice SAN-M encoder into Qwen3.

    clip (16 kHz) -> Kaldi filterbank (25 ms frames every 10 ms, edges snipped: F frames of
        feature_size log mel energies) -> LFR: windows of num_frames_lfr frames every stride_lfr
        (first frame repeated before, last after) stacked: [L, feature_size * num_frames_lfr],
        L = ceil(F / stride_lfr)
    -> the encoder and adaptor (multimodal/fun_asr_nano_encoder.py) -> L rows
    prompt: the audio token (<|object_ref_start|>) x L (the chat template writes one per clip)

As transformers runs it (FunAsrNanoFeatureExtractor, FunAsrNanoProcessor): the extractor is
torchaudio's `compliance.kaldi.fbank` with its defaults (no dither, DC offset removed per
frame, pre-emphasis 0.97, a symmetric Hamming window, FFT size the next power of two, power
spectrum, Kaldi's mel banks from 20 Hz to Nyquist, log floored at float32's eps), which paged
does not require: `KaldiFeatures` computes the same with torch. The text model is Qwen3
(models/text_wrappers.py serves it). `transcription_prompt` is the processor's
`apply_transcription_request` rendered by the checkpoint's chat template: a user turn of the
audio, the client's prompt (a text part) and the language (a language part, the checkpoint's
Chinese name for zh / en / ja).

Refused by name: extractor settings that are no positive whole numbers, a window other than
"hamming", LFR features of another width than audio_config's num_mel_bins * num_stacked_frames,
clips shorter than one frame or longer than the sinusoids (audio_config.max_position_embeddings
- 1 rows: the /v1/audio routes split longer clips at `transcription_window`), task
"translate", a language outside the processor's table.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from paged_engine.multimodal.audio import AudioProcessor, Loaded
from paged_engine.multimodal.granite_speech import saved_settings, set_positive_ints

_DEFAULTS = {
    "feature_size": 80,
    "sampling_rate": 16_000,
    "frame_length": 25,  # ms
    "frame_shift": 10,  # ms
    "num_frames_lfr": 7,
    "stride_lfr": 6,
}


def kaldi_mel(f: torch.Tensor | float) -> Any:
    """Kaldi's mel scale: 1127 ln(1 + f / 700)."""
    return 1127.0 * (
        torch.log1p(f / 700.0) if isinstance(f, torch.Tensor) else math.log1p(f / 700.0)
    )


def kaldi_mel_banks(n_mels: int, n_fft: int, sampling_rate: int) -> torch.Tensor:
    """[n_fft // 2 + 1, n_mels] float32: Kaldi's triangles, evenly spaced in mel from 20 Hz to
    Nyquist over the FFT bins below Nyquist (the Nyquist bin's row is zero)."""
    low, high = kaldi_mel(20.0), kaldi_mel(sampling_rate / 2)
    delta = (high - low) / (n_mels + 1)
    left = low + torch.arange(n_mels)[:, None] * delta  # [n_mels, 1]
    centre, right = left + delta, left + 2 * delta
    mel = kaldi_mel(sampling_rate / n_fft * torch.arange(n_fft // 2))[None, :]
    up, down = (mel - left) / (centre - left), (right - mel) / (right - centre)
    banks = torch.clamp(torch.minimum(up, down), min=0.0)  # [n_mels, n_fft // 2]
    return torch.nn.functional.pad(banks, (0, 1)).T.contiguous()


class KaldiFeatures:
    """FunAsrNanoFeatureExtractor's settings and its LFR features for one clip."""

    def __init__(self, settings: dict[str, Any]) -> None:
        set_positive_ints(self, settings, _DEFAULTS)
        window = settings.get("window", "hamming")
        if window != "hamming":
            raise ValueError(
                f"the feature extractor's window {window!r}: only 'hamming' (the checkpoints') "
                "is served"
            )
        self.size = int(self.sampling_rate * self.frame_length * 0.001)  # samples a frame
        self.shift = int(self.sampling_rate * self.frame_shift * 0.001)
        if self.size < 2 or self.shift < 1:
            raise ValueError(
                f"the feature extractor's frame_length / frame_shift ({self.frame_length} / "
                f"{self.frame_shift} ms) are under a sample at {self.sampling_rate} Hz"
            )
        self.n_fft = 1 << (self.size - 1).bit_length()
        self.window = torch.hamming_window(self.size, periodic=False, alpha=0.54, beta=0.46)
        self.banks = kaldi_mel_banks(self.feature_size, self.n_fft, self.sampling_rate)

    def frames(self, samples: int) -> int:
        return 1 + (samples - self.size) // self.shift

    def rows(self, samples: int) -> int:
        """LFR rows (= placeholders) of a clip of at least `size` samples."""
        return -(-self.frames(samples) // self.stride_lfr)

    def fbank(self, wave: np.ndarray) -> torch.Tensor:
        """[F, feature_size] Kaldi log mel energies (torchaudio's defaults, Hamming window)."""
        x = torch.from_numpy(wave).float()
        f = x.unfold(0, self.size, self.shift)[: self.frames(x.numel())]  # [F, size]
        f = f - f.mean(dim=1, keepdim=True)
        before = torch.cat([f[:, :1], f[:, :-1]], dim=1)  # x[i - 1], x[0] before the first
        f = (f - 0.97 * before) * self.window
        power = torch.fft.rfft(f, n=self.n_fft).abs() ** 2  # [F, n_fft // 2 + 1]
        return torch.clamp(power @ self.banks, min=torch.finfo(torch.float32).eps).log()

    def __call__(self, wave: np.ndarray) -> torch.Tensor:
        """[L, feature_size * num_frames_lfr] float32 LFR features of a mono clip."""
        fb = self.fbank(wave)
        m, s = self.num_frames_lfr, self.stride_lfr
        rows = -(-fb.shape[0] // s)
        left = (m - 1) // 2
        need = (rows - 1) * s + m  # the padded frames the last window reaches
        tail = max(need - left - fb.shape[0], m - 1 - left)
        padded = torch.cat([fb[:1].expand(left, -1), fb, fb[-1:].expand(tail, -1)])
        return padded.unfold(0, m, s)[:rows].transpose(1, 2).reshape(rows, -1)


class FunAsrNanoAudio(AudioProcessor):
    """The host side: clips -> KaldiFeatures, the audio token -> its run."""

    def load_extractor(self) -> KaldiFeatures:
        features = KaldiFeatures(saved_settings(self.path))
        a = self.config.audio_config
        width, want = features.feature_size * features.num_frames_lfr, a.num_mel_bins
        if width != want * a.num_stacked_frames:
            raise ValueError(
                f"the feature extractor's feature_size * num_frames_lfr {width} differs from "
                f"config.audio_config's num_mel_bins * num_stacked_frames "
                f"{want * a.num_stacked_frames}"
            )
        self.max_rows = a.max_position_embeddings - 1  # positions count from one
        return features

    def placeholder_id(self) -> int:
        return int(self.config.audio_token_id)

    @property
    def transcription_window(self) -> int:
        """The longest clip (samples) the encoder's positions take: the /v1/audio routes split
        longer ones. rows <= R <=> frames <= R * stride_lfr <=> samples < size + R * stride *
        shift."""
        x = self.extractor
        return x.size + self.max_rows * x.stride_lfr * x.shift - 1

    def load(self, wave: np.ndarray, what: str) -> Loaded:
        x = self.extractor
        if wave.size < x.size:
            raise ValueError(
                f"{what}: the clip is too short ({wave.size} samples; at least one "
                f"{x.frame_length} ms frame, {x.size})"
            )
        rows = x.rows(wave.size)
        if rows > self.max_rows:
            raise ValueError(
                f"{what}: the clip is too long ({rows} LFR rows; the encoder's positions reach "
                f"{self.max_rows}, about {self.max_rows * x.stride_lfr * x.frame_shift // 1000} s)"
            )
        features = x(wave)
        return features, tuple(features.shape), rows

    def transcription_prompt(self, language: str | None, task: str, prompt: str) -> dict:
        """FunAsrNanoProcessor.apply_transcription_request's prompt through the chat template."""
        from transformers.audio_utils import resolve_language
        from transformers.models.fun_asr_nano.processing_fun_asr_nano import (
            LANGUAGE_CODE_TO_NAME,
        )

        if task != "transcribe":
            raise ValueError(f"task: {task!r}: Fun-ASR-Nano only transcribes")
        try:
            name = resolve_language(language, LANGUAGE_CODE_TO_NAME, return_code=False)
        except ValueError as e:
            raise ValueError(f"language: {e}") from e
        content: list[dict] = [{"type": "audio", "audio": None}]
        if prompt:
            content.append({"type": "text", "text": prompt})
        if name is not None:
            content.append({"type": "language", "language": name})
        chat = [{"role": "user", "content": content}]
        text = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        return {"prompt": text}
