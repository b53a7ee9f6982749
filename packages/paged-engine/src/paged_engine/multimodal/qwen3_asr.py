"""Qwen3-ASR (Qwen3ASRForConditionalGeneration): Qwen3-Omni's audio tower into Qwen3, and the
prompt that asks it for a transcription.

    clips of a prompt (16 kHz) -> Qwen3ASRFeatureExtractor, together: each clip under 0.5 s
        zero-padded to 0.5 s, the clips padded to the longest, the mel axis to a multiple of
        2 * n_window frames; L valid frames
    -> the tower (multimodal/omni_audio.py Qwen3AudioTower: chunks of 2 * n_window frames,
       three stride-2 Conv2d, conv_out, windowed layers, ln_post) -> multi_modal_projector
       (linear_1 -> act -> linear_2): n = 13 rows a full chunk plus r(r(r(L % (2 * n_window))))
    prompt: <|audio_start|> <|audio_pad|> x n <|audio_end|> (the chat template writes one)

What differs from Qwen3-Omni's tower, as transformers runs it: every chunk is 2 * n_window
frames wide as the extractor padded it (the last chunk's padding is the extractor's: log-mels of
the zeros a shorter clip is padded with, then zeros), so a clip's features are kept to its
last valid chunk's end; the sinusoids are audio_config.max_position_embeddings long; the tower
has no head of its own (the projector is `multi_modal_projector.*`). The text model is Qwen3
with 1-D positions (models/text_wrappers.py serves it).

`transcription_prompt` is the processor's `apply_transcription_request` rendered by the
checkpoint's chat template: a system turn holding the client's prompt (none when it is empty),
the user's audio, and the assistant's turn continued from "language <Name><asr_text>" where a
language is given (the model names the language itself otherwise).

Refused by name: task "translate" (the model transcribes only), a language outside the
processor's table (ISO codes or names), and what omni_audio.check_audio_config refuses.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.multimodal.audio import AudioProcessor, Loaded
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.omni_audio import Qwen3AudioTower, check_audio_config, qwen3_rows
from paged_engine.multimodal.whisper_encoder import load_audio_weights


def _languages() -> dict[str, str]:
    """The processor's ISO code -> language name table."""
    from transformers.models.qwen3_asr.processing_qwen3_asr import LANGUAGE_CODE_TO_NAME

    return dict(LANGUAGE_CODE_TO_NAME)


class Qwen3Asr(AudioProcessor):
    """A prompt's clips extracted together, as Qwen3ASRProcessor extracts them."""

    def placeholder_id(self) -> int:
        return int(self.config.audio_token_id)

    def load(self, wave: np.ndarray, what: str) -> Loaded:
        return self.load_clips([wave], [what])[0]

    def load_clips(self, waves: list[np.ndarray], whats: list[str]) -> list[Loaded]:
        what = whats[0] if len(whats) == 1 else "multi_modal_data['audio']"
        n_window = int(self.config.audio_config.n_window)
        out = self.extract(
            waves,
            what,
            padding="longest",
            truncation=False,
            return_attention_mask=True,
            n_window=n_window,
        )
        chunk = 2 * n_window
        loaded = []
        for i, (wave, name) in enumerate(zip(waves, whats, strict=True)):
            valid = int(out["attention_mask"][i].sum())
            if valid < 1:
                raise ValueError(f"{name}: the clip is too short ({wave.size} samples)")
            width = math.ceil(valid / chunk) * chunk  # (its last chunk as the extractor padded it)
            features = out["input_features"][i, :, :width].float().contiguous()
            loaded.append((features, (valid,), qwen3_rows(valid, n_window)))
        return loaded

    def transcription_prompt(self, language: str | None, task: str, prompt: str) -> dict:
        if task != "transcribe":
            raise ValueError(
                f"task: {task!r} is not served; Qwen3-ASR transcribes only (task 'transcribe')"
            )
        name = None
        if language is not None:
            table = _languages()
            name = table.get(language.lower())
            if name is None and language.title() in table.values():
                name = language.title()
            if name is None:
                raise ValueError(
                    f"language: {language!r} is not one Qwen3-ASR names; it takes "
                    f"{', '.join(sorted(table))} (or their names)"
                )
        messages: list[dict[str, Any]] = []
        if prompt:
            messages.append({"role": "system", "content": [{"type": "text", "text": prompt}]})
        messages.append({"role": "user", "content": [{"type": "audio"}]})
        prefill = f"language {name}<asr_text>" if name is not None else ""
        messages.append({"role": "assistant", "content": [{"type": "text", "text": prefill}]})
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, continue_final_message=True
        )
        return {"prompt": text}


class Qwen3AsrTower(Qwen3AudioTower):
    """Qwen3-Omni's convolutions and windowed layers over the extractor's 2 * n_window chunks."""

    positions_field = "max_position_embeddings"

    def chunks(self, features: torch.Tensor, valid: int) -> tuple[torch.Tensor, list[int]]:
        """Every chunk as the extractor padded it (the features end on a chunk's end)."""
        parts = features.split(self.window, dim=-1)
        x = torch.stack([F.pad(c, (0, self.window - c.shape[-1])) for c in parts])
        return x, [min(self.window, valid - i * self.window) for i in range(len(parts))]


class Qwen3AsrEncoder(nn.Module):
    """The tower and the projector: `encode(clips)` -> each clip's [n, text hidden]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        check_audio_config(config, True, Qwen3AsrTower.positions_field)
        audio = config.audio_config
        self.audio_tower = Qwen3AsrTower(audio)
        self.multi_modal_projector = nn.Module()
        self.multi_modal_projector.linear_1 = nn.Linear(audio.d_model, audio.d_model)
        self.multi_modal_projector.linear_2 = nn.Linear(audio.d_model, audio.output_dim)
        self.act = get_act_fn(audio.activation_function, "audio_config.activation_function")

    def encode(self, clips: Sequence[ImageInput]) -> list[torch.Tensor]:
        p = self.multi_modal_projector
        device = p.linear_1.weight.device
        features = [m.pixel_values.to(device) for m in clips]  # type: ignore[union-attr]
        valid = [m.image_size[0] for m in clips]  # type: ignore[index]
        rows = self.audio_tower.hidden(features, valid)
        out = p.linear_2(self.act(p.linear_1(torch.cat(rows))))
        return list(out.split([r.shape[0] for r in rows]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_audio_weights(self, weights, "Qwen3-ASR's audio tower")
