"""Music Flamingo (MusicFlamingoForConditionalGeneration): Audio Flamingo 3 with a rotary time
embedding between the tower and the projector, and each clip's run between two marks.

    clip -> windows -> the pooled tower, as Audio Flamingo 3 (multimodal/audioflamingo3.py)
      -> rows [W, T, D] rotated by the time embedding (below) -> linear_1 -> act -> linear_2
      -> the windows' valid rows, in order
    prompt: <sound> per clip -> <|sound_bos|><sound> x n<|sound_eos|> (the processor adds the
        marks: config.audio_bos_token_id / audio_eos_token_id)

The time embedding, as transformers runs it (MusicFlamingoRotaryEmbedding, whose rows are the
whole hidden vector, not heads): with T = max_source_positions // 2 pooled rows a window,
step = 4 * audio_frame_step seconds a row, row t of the clip's window k sits at
s = (k T + t) step seconds; inv = rope_theta ^ (-(0, 2, ..) / int(D * partial_rotary_factor));
angles = [k / L * inv, t / L * 2 pi * inv] (each entry twice, L = rope_theta) * (-2 pi s),
and the first len(angles) features of the row turn by them in interleaved pairs (x0, x1) ->
(x0 cos - x1 sin, x1 cos + x0 sin), in float64. HF derives k from the runs of <sound> in the
batch's ids; a clip's windows are its own here, which is the same k.

Music Flamingo's processor defines no transcription request: `transcription_prompt` refuses it
as the base class does. Refused by name: a time rope other than the default
(rope_parameters), plus Audio Flamingo 3's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from paged_engine.multimodal.audio import AudioProcessor
from paged_engine.multimodal.audioflamingo3 import AudioFlamingo3, AudioFlamingo3Encoder
from paged_engine.multimodal.inputs import ImageInput


class MusicFlamingo(AudioFlamingo3):
    max_audio_len = 1200.0

    def marks(self) -> tuple[int | None, int | None]:
        return int(self.config.audio_bos_token_id), int(self.config.audio_eos_token_id)

    def transcription_prompt(self, language: str | None, task: str, prompt: str) -> dict:
        return AudioProcessor.transcription_prompt(self, language, task, prompt)


class MusicFlamingoEncoder(AudioFlamingo3Encoder):
    """Audio Flamingo 3's tower and projector with the time rotation between them."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        rope = dict(config.rope_parameters or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(
                f"rope_parameters: rope_type {rope['rope_type']!r} in Music Flamingo's time "
                "embedding is not supported (the default rope is)"
            )
        theta = float(rope["rope_theta"])
        dim = int(config.audio_config.hidden_size * rope.get("partial_rotary_factor", 1.0))
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.span = theta  # L: the angles' period in windows and rows (max_position_embeddings)
        self.step = 4 * float(config.audio_frame_step)  # seconds a pooled row stands for
        self.rows = int(config.audio_config.max_source_positions) // 2  # T, pooled rows a window

    def rotate(self, x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """x [W, t, D] (t <= T rows of windows whose index in their clip is `window` [W])."""
        t = x.shape[1]
        inv = self.inv_freq.to(x.device)
        rows = torch.arange(t, device=x.device, dtype=torch.float32)
        seconds = (window[:, None] * self.rows) * self.step + rows * self.step  # [W, t]
        k = window.to(torch.float32) / self.span
        k_freqs = (k[:, None] * inv).repeat_interleave(2, dim=-1)  # [W, r]
        t_angles = rows / self.span * (2 * math.pi)
        t_freqs = (t_angles[:, None] * inv).repeat_interleave(2, dim=-1)  # [t, r]
        freqs = torch.cat(torch.broadcast_tensors(k_freqs[:, None], t_freqs[None]), dim=-1)
        freqs = freqs * (-seconds * 2 * math.pi)[..., None]  # [W, t, 2r]
        cos, sin = freqs.cos().double(), freqs.sin().double()
        h = x.double()
        r = cos.shape[-1]
        pairs = h[..., :r].unflatten(-1, (-1, 2))
        turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        rotated = h[..., :r] * cos + turned * sin
        return torch.cat((rotated, h[..., r:]), dim=-1).to(x.dtype)

    def before_projector(self, x: torch.Tensor, clips: Sequence[ImageInput]) -> torch.Tensor:
        k = [k for m in clips for k in range(len(m.image_size))]  # type: ignore[arg-type]
        return self.rotate(x, torch.tensor(k, device=x.device))
