"""IBM Granite Speech (GraniteSpeechForConditionalGeneration): a conformer into Granite.

    clip (16 kHz) -> power mel spectrogram (n_fft 512, window 400, hop 160, 80 HTK mels)
        -> log10, floored at max - 8, / 4 + 1 -> pairs of frames stacked: [L, 160], L = frames // 2
    -> the encoder (multimodal/granite_speech_encoder.py: a CTC conformer, then a Q-Former
        over windows of `window_size` rows, window_size // downsample_rate queries each)
    -> n = ceil(L / window_size) * (window_size // downsample_rate) rows
    prompt: <|audio|> x n (the chat template writes one <|audio|> per clip)

As transformers runs it (GraniteSpeechFeatureExtractor, GraniteSpeechModel): the extractor is
torchaudio's MelSpectrogram, which paged does not require; `MelFeatures` computes the same
thing with torch.stft (periodic Hann window centred in n_fft, reflect padding, power 2, the
triangular HTK filterbank without norm: torchaudio's defaults, the only ones HF builds). HF
pads a batch of clips to the longest and runs the conformer over the padding (no mask), so a
clip's rows there depend on its batch; paged computes each clip as HF does for it alone (its
own spectrogram and maximum; the conformer's block attention and depthwise convolution see
only its rows, the projector's last window is zero-padded), which the encoder cache needs.
The text model is Granite (models/granite.py via models/text_wrappers.py), with the wrapper's
logits: its own lm_head, not divided by text_config.logits_scaling (vLLM's text model divides).
HF multiplies the merged embeddings, audio rows included, by text_config.embedding_multiplier,
and so does paged's first stage (models/llama.py stage_input). Checkpoints ship a LoRA
adapter on the text model that HF's `generate` enables for audio prompts only
(config.has_lora_adapter): paged loads the base weights and logs that the adapter is not applied
by itself; sent as a lora_request with audio prompts (enable_lora), it gives HF's outputs with
the adapter on.

Refused by name: feature extractor settings that are no positive whole numbers, or a projector
window / downsample rate that differ from the config's (the prompt's run would not match the
encoder's rows); config.window_size not a multiple of config.downsample_rate (HF cannot run
it), a projector_config other than Blip-2's Q-Former; clips shorter than n_fft / 2 samples.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paged_engine.multimodal.audio import AudioProcessor, Loaded

logger = logging.getLogger(__name__)

_DEFAULTS = {
    "sampling_rate": 16_000,
    "n_fft": 512,
    "win_length": 400,
    "hop_length": 160,
    "n_mels": 80,
    "projector_window_size": 15,
    "projector_downsample_rate": 5,
}
# vLLM's transcription languages for Granite Speech (the model card's)
LANGUAGES = {"en": "English", "fr": "French", "de": "German", "pt": "Portuguese", "es": "Spanish"}
TRANSCRIBE = "can you transcribe the speech into a written format?"


def htk_mel_filters(n_fft: int, n_mels: int, sampling_rate: int) -> torch.Tensor:
    """[n_fft // 2 + 1, n_mels] triangular filters, evenly spaced on the HTK mel scale
    (2595 log10(1 + f / 700)) from 0 Hz to sampling_rate // 2, unnormalized (float32)."""
    freqs = torch.linspace(0, sampling_rate // 2, n_fft // 2 + 1)
    top = 2595.0 * math.log10(1.0 + float(sampling_rate // 2) / 700.0)
    edges = 700.0 * (10.0 ** (torch.linspace(0.0, top, n_mels + 2) / 2595.0) - 1.0)
    width = edges[1:] - edges[:-1]
    slopes = edges[None, :] - freqs[:, None]  # [freqs, n_mels + 2]
    rising = -slopes[:, :-2] / width[:-1]
    falling = slopes[:, 2:] / width[1:]
    return torch.clamp(torch.minimum(rising, falling), min=0.0)


def power_spectrum(
    wave: np.ndarray, n_fft: int, hop: int, win_length: int, window: torch.Tensor
) -> torch.Tensor:
    """[n_fft // 2 + 1, L // hop + 1] float32 |STFT|^2 of a mono clip of L > n_fft / 2 samples:
    centred frames, reflect padding."""
    spec = torch.stft(
        torch.from_numpy(wave).float(),
        n_fft,
        hop_length=hop,
        win_length=win_length,
        window=window,
        center=True,
        pad_mode="reflect",
        return_complex=True,
    )
    return spec.abs() ** 2


def set_positive_ints(target: Any, settings: dict[str, Any], defaults: dict[str, int]) -> None:
    """Each key of `defaults` set on `target` from the feature extractor's `settings` (the
    default where unset); ValueError naming one that is not a positive whole number."""
    for key, default in defaults.items():
        value = settings.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(
                f"the feature extractor's {key} must be a positive whole number, got {value!r}"
            )
        setattr(target, key, value)


class MelFeatures:
    """Granite Speech's feature extractor settings and its features for one clip."""

    def __init__(self, settings: dict[str, Any]) -> None:
        set_positive_ints(self, settings, _DEFAULTS)
        if self.win_length > self.n_fft:
            raise ValueError(
                f"the feature extractor's win_length {self.win_length} is over n_fft {self.n_fft}"
            )
        self.filters = htk_mel_filters(self.n_fft, self.n_mels, self.sampling_rate)
        self.window = torch.hann_window(self.win_length)  # periodic; stft centres it in n_fft
        self.min_samples = max(self.n_fft // 2 + 1, self.hop_length)  # reflect pad; two frames

    def rows(self, samples: int) -> int:
        """Feature rows (stacked frame pairs) of a clip: centred frames = samples // hop + 1."""
        return (samples // self.hop_length + 1) // 2

    def tokens(self, samples: int) -> int:
        """Placeholders of a clip: the projector's windows times their queries."""
        windows = math.ceil(self.rows(samples) / self.projector_window_size)
        return windows * (self.projector_window_size // self.projector_downsample_rate)

    def __call__(self, wave: np.ndarray) -> torch.Tensor:
        """[rows, 2 * n_mels] float32 features of a mono clip (at least `min_samples`)."""
        power = power_spectrum(wave, self.n_fft, self.hop_length, self.win_length, self.window)
        mel = power.T @ self.filters  # [frames, n_mels]
        logmel = mel.clamp(min=1e-10).log10()
        logmel = torch.maximum(logmel, logmel.max() - 8.0) / 4 + 1
        frames = logmel.shape[0] // 2 * 2  # an odd last frame is dropped
        return logmel[:frames].reshape(-1, 2 * self.n_mels)


def saved_settings(path: Path) -> dict[str, Any]:
    """The feature extractor's saved settings: processor_config.json's `audio_processor`
    (transformers 5) or preprocessor_config.json; ValueError when there are none."""
    nested = Path(path) / "processor_config.json"
    if nested.exists():
        saved = json.loads(nested.read_text())
        for key in ("audio_processor", "feature_extractor"):
            if isinstance(saved.get(key), dict):
                return saved[key]
    flat = Path(path) / "preprocessor_config.json"
    if flat.exists():
        return json.loads(flat.read_text())
    raise ValueError(
        f"{path} has no feature extractor settings (processor_config.json's audio_processor or "
        "preprocessor_config.json): they are needed to run audio (pass "
        "limit_mm_per_prompt={'audio': 0} to serve its text model only)"
    )


class GraniteSpeechAudio(AudioProcessor):
    """The host side: clips -> MelFeatures, <|audio|> -> its run."""

    def __init__(self, path: Path, config: Any, tokenizer: Any, limit: int | None = None) -> None:
        if getattr(config, "has_lora_adapter", False):
            logger.warning(
                "%s: config.has_lora_adapter is set; the checkpoint's LoRA adapter, which HF "
                "applies to audio prompts, is not applied (send it as a lora_request with them)",
                path,
            )
        super().__init__(path, config, tokenizer, limit)

    def load_extractor(self) -> MelFeatures:
        features = MelFeatures(saved_settings(self.path))
        for mine, theirs in (
            ("projector_window_size", "window_size"),
            ("projector_downsample_rate", "downsample_rate"),
        ):
            if getattr(features, mine) != getattr(self.config, theirs):
                raise ValueError(
                    f"the feature extractor's {mine} {getattr(features, mine)} differs from "
                    f"config.{theirs} {getattr(self.config, theirs)}: the prompt's audio run "
                    "would not match the encoder's rows"
                )
        return features

    def placeholder_id(self) -> int:
        return int(self.config.audio_token_index)

    def load(self, wave: np.ndarray, what: str) -> Loaded:
        x = self.extractor
        if wave.size < x.min_samples:
            raise ValueError(
                f"{what}: the clip is too short ({wave.size} samples; at least {x.min_samples})"
            )
        features = x(wave)
        return features, tuple(features.shape), x.tokens(wave.size)

    def transcription_prompt(self, language: str | None, task: str, prompt: str) -> dict:
        """vLLM's: one user turn of the chat template, "<|audio|>" then the request (translate:
        into English); the language is checked, not written (the model detects it)."""
        if language is not None and language not in LANGUAGES:
            raise ValueError(
                f"language: {language!r} is not one of Granite Speech's languages "
                f"({', '.join(sorted(LANGUAGES))})"
            )
        if task not in ("transcribe", "translate"):
            raise ValueError(f"task: {task!r} is neither 'transcribe' nor 'translate'")
        if prompt:
            raise ValueError("prompt: Granite Speech's transcription request takes no prompt")
        token = self.tokenizer.convert_ids_to_tokens(self.placeholder)
        ask = TRANSCRIBE if task == "transcribe" else "translate the speech to English"
        chat = [{"role": "user", "content": f"{token}{ask}"}]
        text = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        return {"prompt": text}
