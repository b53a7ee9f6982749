"""Audio Flamingo 3 (AudioFlamingo3ForConditionalGeneration): Whisper's encoder, pooled, through
a two-layer projector into Qwen2; a clip longer than the window is read as several windows.

    clip (16 kHz) -> windows of chunk_length s (30 s; at most max_audio_len // chunk_length of
        them, the rest of the clip dropped), each through WhisperFeatureExtractor padded to the
        window (3000 frames of 128 mels), valid frames L_w
      -> each window through the tower (multimodal/whisper_encoder.py: frames past
        (L_w - 1) // 2 + 1 masked as keys) -> AvgPool1d(2) -> layer_norm
      -> multi_modal_projector: linear_1 -> act -> linear_2 (bias: config.projector_bias)
      -> the windows' valid rows, in order: n = sum_w ((L_w - 1) // 2 + 1 - 2) // 2 + 1
    prompt: the chat template's <sound> per clip, expanded to a run of n <sound>

As transformers runs it (AudioFlamingo3Processor, AudioFlamingo3Model) but for the count: the
processor counts a clip's tokens from the sum of its windows' frames, the model pools each
window; the two agree whenever the window's frames are a multiple of 4 (every real checkpoint's
3000), and this module counts what the model gives. The text model is Qwen2 with 1-D positions
(models/text_wrappers.py); the weights are `audio_tower.*` and `multi_modal_projector.*`
(under `model.` in some saves).

`transcription_prompt` is the processor's `apply_transcription_request`: one user turn of the
prompt text (default "Transcribe the input speech.") and the clip, through the chat template;
the /v1/audio routes split a clip over max_audio_len (`transcription_window`).
GLM-ASR (multimodal/glmasr.py) reuses the host side with its own tower.

Refused by name: a feature extractor whose window or mel count is not the tower's
(audio_config.max_source_positions, num_mel_bins), a clip with no encoder row, a transcription
`language` or task "translate" (the processor defines neither).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.multimodal.audio import AudioProcessor, Loaded
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.qwen2_audio import output_rows
from paged_engine.multimodal.whisper_encoder import WhisperEncoder, load_audio_weights


class AudioFlamingo3(AudioProcessor):
    """Clips as windows of the feature extractor's length; each clip one run of placeholders."""

    # the processor's defaults (processor_config.json overrides them)
    max_audio_len = 600.0  # seconds of a clip read; the rest is dropped
    default_transcription_prompt = "Transcribe the input speech."
    audio_first = False  # transcription turn: [text, audio] (GLM-ASR: [audio, text])

    def __init__(self, path: Any, config: Any, tokenizer: Any, limit: int | None = None) -> None:
        super().__init__(path, config, tokenizer, limit)
        saved = self.path / "processor_config.json"
        if saved.exists():
            settings = json.loads(saved.read_text())
            self.max_audio_len = float(settings.get("max_audio_len", self.max_audio_len))
            prompt = settings.get("default_transcription_prompt")
            self.default_transcription_prompt = prompt or self.default_transcription_prompt
        fe = self.extractor
        self.window = int(fe.n_samples)  # samples a window holds (chunk_length s)
        self.max_windows = max(1, int(self.max_audio_len // fe.chunk_length))
        self.check_window(int(fe.nb_max_frames), int(fe.feature_size))

    @property
    def transcription_window(self) -> int:
        """Samples a transcription request reads (max_audio_len): /v1/audio/transcriptions
        splits a longer clip rather than have the rest dropped."""
        return self.window * self.max_windows

    def check_window(self, frames: int, mels: int) -> None:
        """ValueError unless the feature extractor's window is what the tower takes."""
        audio = self.config.audio_config
        if frames != 2 * int(audio.max_source_positions) or mels != int(audio.num_mel_bins):
            raise ValueError(
                f"{self.path}: the feature extractor gives windows of {frames} frames of {mels} "
                f"mels; the audio tower takes {2 * int(audio.max_source_positions)} of "
                f"{audio.num_mel_bins} (audio_config.max_source_positions, num_mel_bins)"
            )

    def placeholder_id(self) -> int:
        return int(self.config.audio_token_id)

    def rows(self, frames: int) -> int:
        """Encoder rows of one window of `frames` valid feature frames."""
        return max(0, output_rows(frames))

    def load(self, wave: np.ndarray, what: str) -> Loaded:
        n = min(max(1, math.ceil(wave.size / self.window)), self.max_windows)
        chunks = [wave[i * self.window : (i + 1) * self.window] for i in range(n)]
        out = self.extract(chunks, what, padding="max_length", return_attention_mask=True)
        valid = tuple(int(v) for v in out["attention_mask"].sum(-1))
        count = sum(self.rows(v) for v in valid)
        if count < 1:
            raise ValueError(f"{what}: the clip is too short ({wave.size} samples)")
        return out["input_features"].float(), valid, count  # features [windows, mels, frames]

    def marks(self) -> tuple[int | None, int | None]:
        """The tokens the processor puts before and after each clip's run (None: none)."""
        return None, None

    def process(
        self, token_ids: list[int], data: Any, kwargs: Any = None
    ) -> tuple[list[int], tuple[ImageInput, ...], list[tuple[int, int]]]:
        """The base class's runs, each put between `marks()` unless the prompt has them there
        already (ids a processor expanded)."""
        ids, clips, added = super().process(token_ids, data, kwargs)
        before, after = self.marks()
        if not added or (before is None and after is None):  # (clips processed ahead: as is)
            return ids, clips, added
        out: list[int] = []
        placed, grown, last = [], [], 0
        for m, (where, n) in zip(clips, added, strict=True):
            lead = before is not None and not (m.offset > 0 and ids[m.offset - 1] == before)
            tail = after is not None and not (m.end < len(ids) and ids[m.end] == after)
            out += ids[last : m.offset] + [before] * lead  # type: ignore[list-item]
            placed.append(dataclasses.replace(m, offset=len(out)))
            out += ids[m.offset : m.end] + [after] * tail  # type: ignore[list-item]
            grown.append((where, n + lead + tail))
            last = m.end
        return out + ids[last:], tuple(placed), grown

    def transcription_prompt(self, language: str | None, task: str, prompt: str) -> dict:
        if task != "transcribe":
            raise ValueError(
                f"task: {self.config.architectures[0]} transcribes only (its processor defines "
                f"no translation request), got {task!r}"
            )
        if language is not None:
            raise ValueError(
                f"language: {self.config.architectures[0]}'s transcription request takes no "
                f"language (it detects it), got {language!r}"
            )
        parts = [{"type": "text", "text": prompt or self.default_transcription_prompt}]
        parts.insert(0 if self.audio_first else 1, {"type": "audio"})
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
        )
        return {"prompt": text}


class MlpProjector(nn.Module):
    """linear_1 -> act -> linear_2: the audio rows into the text model's hidden size."""

    def __init__(self, d_in: int, d_mid: int, d_out: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(d_in, d_mid, bias=bias)
        self.act = get_act_fn(act)
        self.linear_2 = nn.Linear(d_mid, d_out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def clip_rows(clips: Sequence[ImageInput], rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each clip's rows: its windows' (in `rows`, one tensor per window, in clip order)
    concatenated."""
    out, at = [], 0
    for m in clips:
        n = m.pixel_values.shape[0]  # type: ignore[union-attr]
        out.append(torch.cat(rows[at : at + n]))
        at += n
        assert out[-1].shape[0] == m.length, (out[-1].shape, m.length)
    return out


class AudioFlamingo3Encoder(nn.Module):
    """The pooled tower and the projector: `encode(clips)` -> each clip's [n, text hidden]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        audio = config.audio_config
        hidden = config.text_config.hidden_size
        self.audio_tower = WhisperEncoder(audio, pool=nn.AvgPool1d(2, stride=2))
        self.multi_modal_projector = MlpProjector(
            audio.d_model,
            hidden,
            hidden,
            config.projector_hidden_act,
            bool(getattr(config, "projector_bias", True)),
        )

    def encode(self, clips: Sequence[ImageInput]) -> list[torch.Tensor]:
        assert all(m.pixel_values is not None and m.image_size for m in clips)
        w = self.multi_modal_projector.linear_1.weight
        features = torch.cat([m.pixel_values for m in clips]).to(w.device)  # type: ignore[misc]
        frames = [v for m in clips for v in m.image_size]  # type: ignore[union-attr]
        x = self.audio_tower(features, [(v - 1) // 2 + 1 for v in frames])  # [windows, T, D]
        x = self.multi_modal_projector(self.before_projector(x, clips))
        rows = [r[: max(0, output_rows(v))] for r, v in zip(x, frames, strict=True)]
        return clip_rows(clips, rows)

    def before_projector(self, x: torch.Tensor, clips: Sequence[ImageInput]) -> torch.Tensor:
        """The tower's rows [windows, T, D] as the projector reads them (Music Flamingo turns
        them by time)."""
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_audio_weights(self, weights, "Audio Flamingo 3's audio tower")
