"""Qwen2-Audio (Qwen2AudioForConditionalGeneration): Whisper's encoder, pooled, into Qwen2.

    clip (16 kHz) -> WhisperFeatureExtractor, padded to its window (30 s: 3000 frames of 128
        mels), valid frames L -> the tower (multimodal/whisper_encoder.py; frames past
        (L - 1) // 2 + 1 after conv2 masked) -> AvgPool1d(2) -> layer_norm
        -> multi_modal_projector.linear -> n = ((L - 1) // 2 + 1 - 2) // 2 + 1 rows
    prompt: <|audio_bos|><|AUDIO|> x n<|audio_eos|> (the chat template writes
        "Audio k: <|audio_bos|><|AUDIO|><|audio_eos|>"; the processor expands the one token)

As transformers runs it (Qwen2AudioProcessor, Qwen2AudioModel): the feature extractor pads to
max_length with its attention mask, a clip longer than the window is cut to it (30 s). The text
model is Qwen2 with 1-D positions (models/text_wrappers.py serves it); the tower's weights are
`audio_tower.*` and the projector's `multi_modal_projector.linear.*` (under `model.` in
transformers 5's saves).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from paged_engine.multimodal.audio import AudioProcessor, Loaded
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.processor_files import ProcessorFileError
from paged_engine.multimodal.whisper_encoder import WhisperEncoder, load_audio_weights


def output_rows(valid_frames: int) -> int:
    """Encoder rows of a clip of `valid_frames` feature frames: conv2 halves, the pool halves."""
    return ((valid_frames - 1) // 2 + 1 - 2) // 2 + 1


class Qwen2Audio(AudioProcessor):
    def __init__(self, path: Any, config: Any, tokenizer: Any, limit: int | None = None) -> None:
        super().__init__(path, config, tokenizer, limit)
        # the window the tower takes: 2 * max_source_positions frames of num_mel_bins mels
        audio, fe = config.audio_config, self.extractor
        frames, mels = int(fe.nb_max_frames), int(fe.feature_size)
        if frames != 2 * int(audio.max_source_positions) or mels != int(audio.num_mel_bins):
            names = ("preprocessor_config.json", "processor_config.json")
            file = next((self.path / n for n in names if (self.path / n).is_file()), self.path)
            raise ProcessorFileError(
                f"{file}: the feature extractor (chunk_length, feature_size) gives windows "
                f"of {frames} frames of {mels} mels; the audio tower takes "
                f"{2 * int(audio.max_source_positions)} of {audio.num_mel_bins} "
                "(audio_config.max_source_positions, num_mel_bins)"
            )

    def placeholder_id(self) -> int:
        return int(self.config.audio_token_id)

    def load(self, wave: np.ndarray, what: str) -> Loaded:
        out = self.extract(wave, what, padding="max_length", return_attention_mask=True)
        valid = int(out["attention_mask"][0].sum())
        if valid < 3:  # (under two frames after conv2: no pooled row)
            raise ValueError(f"{what}: the clip is too short ({wave.size} samples)")
        return out["input_features"][0].float(), (valid,), output_rows(valid)


class Qwen2AudioEncoder(nn.Module):
    """The tower (pooled) and the projector: `encode(clips)` -> each clip's [n, text hidden]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.audio_tower = WhisperEncoder(config.audio_config, pool=nn.AvgPool1d(2, stride=2))
        self.multi_modal_projector = nn.Module()
        self.multi_modal_projector.linear = nn.Linear(
            config.audio_config.d_model, config.text_config.hidden_size
        )

    def encode(self, clips: Sequence[ImageInput]) -> list[torch.Tensor]:
        assert all(m.pixel_values is not None and m.image_size for m in clips)
        w = self.multi_modal_projector.linear.weight
        features = torch.stack([m.pixel_values for m in clips]).to(w.device)  # type: ignore[misc]
        valid = [(m.image_size[0] - 1) // 2 + 1 for m in clips]  # type: ignore[index]
        rows = self.multi_modal_projector.linear(self.audio_tower(features, valid))
        return [r[: m.length] for r, m in zip(rows, clips, strict=True)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_audio_weights(self, weights, "Qwen2-Audio's audio tower")
