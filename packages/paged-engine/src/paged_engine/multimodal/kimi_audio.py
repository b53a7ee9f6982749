"""Kimi-Audio (`MoonshotKimiaForCausalLM`, remote code: moonshotai/Kimi-Audio-7B-Instruct), its
text output as vLLM's kimi_audio.py serves it: Whisper-large-v3's encoder, 4 frames a row, the
VQ adaptor, added to <|im_kimia_text_blank|>'s embedding, into Qwen2.

    clip (16 kHz; zero-padded to a multiple of hop_length, cut to 30 s) -> the subfolder's
        WhisperFeatureExtractor, unpadded (padding "longest" over one clip): [mels, F]
      -> gelu(conv1), gelu(conv2) [F', D], F' = (F - 1) // 2 + 1 -> + embed_positions[:F']
         -> the encoder layers (every frame a key) -> layer_norm
      -> zero rows to a multiple of 4 -> [F' / 4, 4 D] -> vq_adaptor: Linear -> GELU -> Linear
         -> LayerNorm (eps 1e-5): E = ceil(F' / 4) rows
    prompt: <|im_media_begin|><|im_kimia_text_blank|><|im_media_end|> (vLLM's placeholder), the
        blank token becoming a run of P = 13 (F // 100) + ceil((F % 100) / 8) tokens (vLLM's
        _get_feat_extract_output_lengths, Qwen3-ASR's count)
    run row i < min(P, E): (embed(blank) + adaptor row i) * sqrt(2); the rest embed(blank)

As vLLM runs it, where it differs from the release's own code (kept so outputs match vLLM's):
the adaptor's activation is GELU and its LayerNorm eps 1e-5 (the remote code: SiLU, eps
rms_norm_eps); the clip's discrete GLM-4-voice speech tokens (a second tokenizer model the
release adds on an audio stream) are not computed: the text stream's blank embedding stands in;
P exceeds E from 2 s of audio on (30 s: 390 against 375), the extra run tokens stay plain blanks.
One clip a prompt (vLLM's limit). The MIMO branch (the audio-token head) is not served. The
tower's weights are the `whisper-large-v3/` subfolder's (`model.encoder.*`); the adaptor's
`model.vq_adaptor.layers.{0,3,4}.*` and the blank row of `model.embed_tokens.weight` come from
the checkpoint. The config: models/kimi_audio_config.py; the decoder: Qwen2
(models/text_wrappers.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.models.kimi_audio_config import FRAMES_PER_ROW
from paged_engine.multimodal.audio import AudioProcessor, Loaded, feature_extractor
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.whisper_encoder import WhisperEncoder, load_into


def placeholders(frames: int) -> int:
    """vLLM's run length for a clip of `frames` feature frames (13 per full 100 frames)."""
    rest = (((frames % 100 - 1) // 2 + 1 - 1) // 2 + 1 - 1) // 2 + 1
    return rest + frames // 100 * 13


class KimiAudio(AudioProcessor):
    def load_extractor(self) -> Any:
        return feature_extractor(Path(self.config.whisper_path))

    def placeholder_id(self) -> int:
        return int(self.config.audio_token_id)

    def load_clips(self, waves: list[np.ndarray], whats: list[str]) -> list[Loaded]:
        if len(waves) > 1:
            raise ValueError(
                f"multi_modal_data['audio'] has {len(waves)} clips: Kimi-Audio takes one a "
                "prompt (vLLM's limit)"
            )
        return super().load_clips(waves, whats)

    def load(self, wave: np.ndarray, what: str) -> Loaded:
        if wave.size == 0:
            raise ValueError(f"{what}: the clip is empty")
        wave = np.pad(wave, (0, -wave.size % int(self.extractor.hop_length)))
        out = self.extract(wave, what, padding=True, return_attention_mask=True)
        frames = int(out["attention_mask"][0].sum())
        return out["input_features"][0, :, :frames].float(), (frames,), placeholders(frames)


class KimiAudioEncoder(nn.Module):
    """The Whisper tower, the VQ adaptor and the blank token's embedding: `encode(clips)` ->
    each clip's run rows [P, text hidden], fused as vLLM fuses them."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.whisper_path = Path(config.whisper_path)
        self.blank_id = int(config.audio_token_id)
        hidden = config.text_config.hidden_size
        self.audio_tower = WhisperEncoder(config.audio_config)
        self.vq_adaptor = nn.Module()
        self.vq_adaptor.layers = nn.Sequential(  # indices as the checkpoint's (2: dropout)
            nn.Linear(int(config.kimia_adaptor_input_dim), hidden),
            nn.GELU(),
            nn.Identity(),
            nn.Linear(hidden, hidden),
            nn.LayerNorm(hidden),
        )
        self.blank = nn.Parameter(torch.zeros(hidden))  # embed_tokens[<|im_kimia_text_blank|>]

    def tower(self, features: torch.Tensor) -> torch.Tensor:
        """features [mels, F] (one clip, unpadded) -> [F', D]: every frame a key."""
        t = self.audio_tower
        x = F.gelu(t.conv1(features[None].to(t.conv1.weight.dtype)))
        x = F.gelu(t.conv2(x)).transpose(1, 2)
        x = x + t.embed_positions.weight[: x.shape[1]]
        for layer in t.layers:
            x = layer(x, None)
        return t.layer_norm(x)[0]

    def encode(self, clips: Sequence[ImageInput]) -> list[torch.Tensor]:
        out = []
        for m in clips:
            assert m.pixel_values is not None
            x = self.tower(m.pixel_values.to(self.blank.device))
            x = F.pad(x, (0, 0, 0, -x.shape[0] % FRAMES_PER_ROW))
            rows = self.vq_adaptor.layers(x.reshape(-1, FRAMES_PER_ROW * x.shape[-1]))
            fused = min(m.length, rows.shape[0])  # vLLM fuses the first min(P, E) run tokens
            run = self.blank.expand(m.length, -1).clone()
            run[:fused] = (self.blank + rows[:fused]) * 2**0.5
            out.append(run)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The adaptor and the blank row from the checkpoint, the tower from the subfolder's
        safetensors; ValueError naming what is missing."""
        files = sorted(self.whisper_path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"Kimi-Audio: {self.whisper_path} holds no *.safetensors (the tower)")
        both = chain(self._own(weights), self._tower(files))
        return load_into(self, both, "Kimi-Audio's tower and adaptor")

    def _own(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.startswith("model.vq_adaptor."):
                yield name.removeprefix("model."), tensor
            elif name == "model.embed_tokens.weight":
                yield "blank", tensor[self.blank_id]

    @staticmethod
    def _tower(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is no dict)
                    base = name.removeprefix("model.")
                    if base.startswith("encoder."):  # (the decoder and proj_out passed over)
                        yield "audio_tower." + base.removeprefix("encoder."), f.get_tensor(name)
