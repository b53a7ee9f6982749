"""Voxtral (VoxtralForConditionalGeneration): Whisper's encoder over whole 30 s windows, four
rows stacked into each projector row, into a Llama / Mistral decoder.

    clip (16 kHz) zero-padded to a multiple of the window (chunk_length s) -> one log-mel
        spectrogram of the padded clip (WhisperFeatureExtractor; its normalization sees the
        whole clip) cut into W windows [W, mels, 2 * max_source_positions]
      -> the tower (multimodal/whisper_encoder.py), every row valid: Voxtral masks nothing, the
         padding included -> layer_norm  [W, P, D]
      -> each 4 consecutive rows as one [4 * D] row (audio_config.intermediate_size)
      -> linear_1 -> act -> linear_2 (no biases): n = W * P / 4 rows
    prompt (as mistral_common writes it): [BEGIN_AUDIO][AUDIO] x n per clip, inside a user
        turn [INST] ... [/INST]; a prompt's lone [AUDIO] is expanded and [BEGIN_AUDIO] put
        before it where the prompt lacks it

As transformers runs it (VoxtralProcessor._retrieve_input_features, VoxtralModel); HF builds
the prompt ids with mistral_common's tokenizer, whose audio encoding is [BEGIN_AUDIO] then
ceil(frames / 8) [AUDIO] over the padded clip, the same n. transformers keeps
embed_positions in float32 under a half-precision model; here it takes the model's dtype.

`transcription_prompt` is mistral_common's instruct transcription request:
[BOS][INST][BEGIN_AUDIO][AUDIO][/INST], then "lang:xx" where a language is given, then
[TRANSCRIBE]. Refused by name: task "translate" and a context `prompt` (the request has
neither), a tokenizer without those special tokens, a merge other than 4 rows
(audio_config.intermediate_size), a feature extractor whose window is not the tower's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from paged_engine.multimodal.audio import Loaded
from paged_engine.multimodal.audio_io import MAX_SECONDS
from paged_engine.multimodal.audioflamingo3 import (
    AudioFlamingo3,
    MlpProjector,
    load_audio_weights,
)
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.whisper_encoder import WhisperEncoder

MERGE = 4  # tower rows per projector row
_REQUEST = ("[INST]", "[BEGIN_AUDIO]", "[AUDIO]", "[/INST]", "[TRANSCRIBE]")


class Voxtral(AudioFlamingo3):
    max_audio_len = MAX_SECONDS  # no cut of its own: any clip audio_io takes is read whole

    def load_extractor(self) -> Any:
        from paged_engine.mistral_audio import native_audio, native_feature_extractor

        if native_audio(self.path):  # Mistral's native files: tekken.json's audio settings
            return native_feature_extractor(self.path)
        return super().load_extractor()

    def check_window(self, frames: int, mels: int) -> None:
        super().check_window(frames, mels)
        if (frames // 2) % MERGE:
            raise ValueError(
                f"audio_config.max_source_positions={frames // 2}: Voxtral stacks {MERGE} "
                "tower rows into each projector row, so it must be a multiple of 4"
            )

    def marks(self) -> tuple[int | None, int | None]:
        begin = self.tokenizer.convert_tokens_to_ids("[BEGIN_AUDIO]")
        return (None if begin in (None, self.tokenizer.unk_token_id) else begin), None

    def load(self, wave: np.ndarray, what: str) -> Loaded:
        out = self.extract(
            wave, what, padding=True, truncation=False, pad_to_multiple_of=self.window
        )
        features = out["input_features"][0].float()  # [mels, W * frames]
        frames = self.window // int(self.extractor.hop_length)
        windows = features.reshape(features.shape[0], -1, frames).transpose(0, 1).contiguous()
        n = windows.shape[0]
        assert n == math.ceil(wave.size / self.window), (windows.shape, wave.size)
        return windows, (n,), n * frames // 2 // MERGE

    def transcription_prompt(self, language: str | None, task: str, prompt: str) -> dict:
        if task != "transcribe":
            raise ValueError(f"task: Voxtral's transcription request has no {task!r} task")
        if prompt:
            raise ValueError("prompt: Voxtral's transcription request takes no context text")
        vocab = self.tokenizer.get_vocab()
        missing = [t for t in _REQUEST if t not in vocab]
        if missing or self.tokenizer.bos_token_id is None:
            raise ValueError(
                f"the tokenizer lacks the transcription request's tokens {missing or ['bos']}"
            )
        inst, begin, audio, end, transcribe = (vocab[t] for t in _REQUEST)
        ids = [self.tokenizer.bos_token_id, inst, begin, audio, end]
        if language is not None:
            ids += self.tokenizer.encode(f"lang:{language}", add_special_tokens=False)
        return {"prompt_token_ids": [*ids, transcribe]}


class VoxtralEncoder(nn.Module):
    """The tower over whole windows, the 4-row stack and the projector."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        audio = config.audio_config
        if audio.intermediate_size != MERGE * audio.hidden_size:
            raise ValueError(
                f"audio_config.intermediate_size={audio.intermediate_size}: Voxtral's projector "
                f"reads {MERGE} tower rows at once, so it must be {MERGE} * hidden_size"
            )
        hidden = config.text_config.hidden_size
        self.audio_tower = WhisperEncoder(audio)
        self.multi_modal_projector = MlpProjector(
            audio.intermediate_size, hidden, hidden, config.projector_hidden_act, False
        )

    def encode(self, clips: Sequence[ImageInput]) -> list[torch.Tensor]:
        assert all(m.pixel_values is not None for m in clips)
        w = self.multi_modal_projector.linear_1.weight
        features = torch.cat([m.pixel_values for m in clips]).to(w.device)  # type: ignore[misc]
        rows = self.audio_tower.frames // 2  # every row of every window is valid
        x = self.audio_tower(features, [rows] * features.shape[0])  # [W, P, D]
        x = self.multi_modal_projector(x.reshape(x.shape[0], -1, MERGE * x.shape[-1]))
        return list(x.flatten(0, 1).split([m.length for m in clips]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_audio_weights(self, weights, "Voxtral's audio tower")
