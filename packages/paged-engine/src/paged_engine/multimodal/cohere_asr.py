"""Cohere ASR's host side: a request's clip as its log-mel frames, its decoder prompt as ids.

The prompt forms and `process` are Whisper's (multimodal/whisper.py `CrossAttendedAudio`:
{"prompt", "multi_modal_data": {"audio": clip}} or vLLM's encoder / decoder prompts). An empty
decoder prompt is the transcription prompt in English, as vLLM defaults `language` to "en":
the ten control tokens transformers' `CohereAsrProcessor.get_decoder_prompt_ids` and vLLM's
`get_generation_prompt` write ("▁", <|startofcontext|>, <|startoftranscript|>,
<|emo:undefined|>, <|lang|> twice, <|pnc|>, <|noitn|>, <|notimestamp|>, <|nodiarize|>).

`clip_features` runs the checkpoint's CohereAsrFeatureExtractor (dither seeded by the clip's
length, pre-emphasis, log-mel, per-feature normalization over the valid frames) on one clip
and keeps its valid frames [valid, mels] (models/cohere_asr.py encodes them). No placeholders:
the item spans every decoder position, so its hash keys every prefix-cache block.

/v1/audio/transcriptions: `transcription_prompt(language)` (one of the 14 languages; None:
"en"); clips longer than the window (WINDOW_SECONDS, at most the extractor's
max_audio_clip_s - overlap_chunk_second, past which transformers' extractor chunks) are split
by the route. Refused by name: task "translate" and a context `prompt` (vLLM's Cohere ASR is
transcription only, no context), a language outside LANGUAGES or missing from the tokenizer,
more than one clip a prompt, a clip under 0.05 s or over the window, mm_processor_kwargs, an
extractor not at 16 kHz / hop 160 or whose mels differ from encoder_config.num_mel_bins.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from paged_engine.models.cohere_asr import HOP, SAMPLE_RATE, WINDOW_SECONDS
from paged_engine.multimodal.whisper import WHAT, CrossAttendedAudio, request_prompt

# transformers' processing_cohere_asr.LANGUAGES (vLLM's ISO639_1_SUPPORTED_LANGS)
LANGUAGES = ("ar", "de", "el", "en", "es", "fr", "it", "ja", "ko", "nl", "pl", "pt", "vi", "zh")
MIN_SAMPLES = 800  # 0.05 s: a handful of frames (the normalization divides by valid - 1)


def prompt_tokens(language: str) -> list[str]:
    return [
        "▁",
        "<|startofcontext|>",
        "<|startoftranscript|>",
        "<|emo:undefined|>",
        f"<|{language}|>",
        f"<|{language}|>",
        "<|pnc|>",
        "<|noitn|>",
        "<|notimestamp|>",
        "<|nodiarize|>",
    ]


class CohereAsrAudio(CrossAttendedAudio):
    """The host side of Cohere ASR's audio (audio_archs.py's "cohere_asr" kind)."""

    family = "Cohere ASR"
    default_language = "en"

    def __init__(self, path: Any, config: Any, tokenizer: Any, limit: int | None = None) -> None:
        super().__init__(path, config, tokenizer, limit)
        fe = self.extractor
        mels = int(config.encoder_config.num_mel_bins)
        if (self.sampling_rate, int(fe.hop_length), int(fe.feature_size)) != (
            SAMPLE_RATE,
            HOP,
            mels,
        ):
            raise ValueError(
                f"{path}: the feature extractor gives {fe.feature_size} mels every {fe.hop_length} "
                f"samples at {self.sampling_rate} Hz; the encoder takes {mels} mels "
                f"(encoder_config.num_mel_bins) every {HOP} samples at {SAMPLE_RATE} Hz"
            )
        self.span = int(config.max_position_embeddings)  # every decoder position
        # past this many seconds transformers' extractor splits a clip itself
        limit_s = float(fe.max_audio_clip_s) - float(fe.overlap_chunk_second)
        self.window_s = min(float(WINDOW_SECONDS), limit_s)

    @property
    def transcription_window(self) -> int:
        """Samples of one transcription request: the clip a slot holds (models/cohere_asr.py)."""
        return int(self.window_s * self.sampling_rate)

    def prompt_ids(self, language: str) -> list[int]:
        """The decoder prompt for `language`; ValueError naming `language`."""
        if language not in LANGUAGES:
            raise ValueError(
                f"language: {language!r} is not one of Cohere ASR's {', '.join(LANGUAGES)}"
            )
        tokens = prompt_tokens(language)
        vocab = self.tokenizer.get_vocab()
        missing = [t for t in tokens if t not in vocab]
        if missing:
            raise ValueError(f"language: the tokenizer lacks Cohere ASR's control tokens {missing}")
        return [vocab[t] for t in tokens]

    def request_prompt(self, prompt: Any) -> dict:
        """Whisper's prompt forms; an empty decoder prompt is the "en" transcription prompt."""
        empty = -1  # what the shared code writes for "no decoder prompt" (no start token here)
        out = request_prompt(
            prompt, self.tokenizer, SimpleNamespace(decoder_start_token_id=empty), self.family
        )
        if out["prompt_token_ids"] == [empty]:
            out = {**out, "prompt_token_ids": self.prompt_ids(self.default_language)}
        return out

    def transcription_prompt(
        self, language: str | None, task: str, prompt: str, timestamps: bool = False
    ) -> dict:
        """The ten control tokens for `language` (None: "en", as vLLM)."""
        if task != "transcribe":
            raise ValueError(f"task: Cohere ASR only transcribes (got {task!r})")
        if prompt:
            raise ValueError("prompt: Cohere ASR takes no context text")
        return {"prompt_token_ids": self.prompt_ids(language or self.default_language)}

    def clip_features(self, wave: np.ndarray) -> torch.Tensor:
        """The clip's valid log-mel frames [N // hop, mels]; ValueError for a clip outside
        [MIN_SAMPLES, the window]."""
        n = wave.shape[0]
        if n < MIN_SAMPLES or n > self.transcription_window:
            raise ValueError(
                f"{WHAT}: a clip of {n / self.sampling_rate:.3f} s; Cohere ASR takes "
                f"{MIN_SAMPLES / self.sampling_rate:.3f} s to {self.window_s:g} s (split a "
                "longer clip)"
            )
        out = self.extract(wave, WHAT, return_attention_mask=True)
        valid = int(out["attention_mask"][0].sum())
        return out["input_features"][0, :valid].float().contiguous()
