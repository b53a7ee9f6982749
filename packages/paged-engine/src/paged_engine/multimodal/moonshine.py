"""Moonshine's host side: a request's clip as its raw samples, its decoder prompt as ids.

The prompt forms and `process` are Whisper's (multimodal/whisper.py `CrossAttendedAudio`:
{"prompt", "multi_modal_data": {"audio": clip}} or vLLM's encoder / decoder prompts); a missing
or empty decoder prompt is config.decoder_start_token_id alone, which is what transformers'
`generate` starts from (Moonshine has no language or task tokens).

`MoonshineAudio.clip_features` runs the checkpoint's feature extractor (a
Wav2Vec2FeatureExtractor: the waveform as it is, normalized where the checkpoint's do_normalize
says so) on the clip (mono float32 at 16 kHz, multimodal/audio_io.py) with no padding: the
item's pixel_values are its samples [N], and the encoder's frames follow its length
(models/moonshine.py). No placeholders:
the item spans every decoder position [0, max_position_embeddings), so it reaches the worker
with every sequence that holds it and its hash keys every prefix-cache block.

/v1/audio/transcriptions: `transcription_prompt` is the start token alone; longer clips are
split into WINDOW_SECONDS windows by the route (`transcription_window`).

Refused by name: more than one clip a prompt, a clip shorter than MIN_SAMPLES (the
convolutions leave no frame) or longer than WINDOW_SECONDS, mm_processor_kwargs, a feature
extractor not at 16 kHz mono, and on the transcription route task "translate" and a context
`prompt` (Moonshine has neither).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from paged_engine.models.moonshine import SAMPLE_RATE, WINDOW_SECONDS
from paged_engine.multimodal.moonshine_encoder import MIN_SAMPLES
from paged_engine.multimodal.whisper import WHAT, CrossAttendedAudio


class MoonshineAudio(CrossAttendedAudio):
    """The host side of Moonshine's audio (audio_archs.py's "moonshine" kind)."""

    family = "Moonshine"
    default_language = None  # no language token: a checkpoint transcribes its own language

    def __init__(self, path: Any, config: Any, tokenizer: Any, limit: int | None = None) -> None:
        super().__init__(path, config, tokenizer, limit)
        fe = self.extractor
        if self.sampling_rate != SAMPLE_RATE or int(getattr(fe, "feature_size", 1)) != 1:
            raise ValueError(
                f"{path}: the feature extractor gives {fe.feature_size} channel(s) at "
                f"{self.sampling_rate} Hz; Moonshine's encoder reads mono samples at "
                f"{SAMPLE_RATE} Hz"
            )
        self.span = int(config.max_position_embeddings)  # every decoder position

    @property
    def transcription_window(self) -> int:
        """Samples of one transcription request: a slot's clip (models/moonshine.py)."""
        return WINDOW_SECONDS * self.sampling_rate

    def transcription_prompt(
        self, language: str | None, task: str, prompt: str, timestamps: bool = False
    ) -> dict:
        """The decoder start token alone (transformers' generate); `language` is the
        checkpoint's own (no token selects it)."""
        if task != "transcribe":
            raise ValueError(f"task: Moonshine only transcribes (got {task!r})")
        if prompt:
            raise ValueError("prompt: Moonshine takes no context text")
        return {"prompt_token_ids": [int(self.config.decoder_start_token_id)]}

    def clip_features(self, wave: np.ndarray) -> torch.Tensor:
        """The clip's samples [N] (normalized where the checkpoint says so); ValueError for a
        clip outside [MIN_SAMPLES, WINDOW_SECONDS]."""
        n = wave.shape[0]
        if n < MIN_SAMPLES or n > self.transcription_window:
            raise ValueError(
                f"{WHAT}: a clip of {n / self.sampling_rate:.3f} s; Moonshine takes "
                f"{MIN_SAMPLES / self.sampling_rate:.3f} s to {WINDOW_SECONDS} s (split a "
                "longer clip)"
            )
        return self.extract(wave, WHAT)["input_values"][0].float().contiguous()
