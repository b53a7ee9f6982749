"""Ultravox (`UltravoxModel`, fixie-ai's remote code; vLLM's models/ultravox.py): Whisper's
encoder, its rows stacked `stack_factor` at a time through a feed-forward projector, into a
Llama decoder (models/text_wrappers.py serves it; the config: models/ultravox_config.py).

    clip (16 kHz, padded to 2 hops if shorter) -> WhisperFeatureExtractor over the whole clip
        (padding "longest" to a multiple of the hop, no truncation): L valid frames
      -> windows of W = audio_context_size frames (the processor's 3000 = 30 s; at most
         2 * max_source_positions): the first L_0 = min(L, W) frames as they are (a clip of one
         window is not padded), each later one zero-padded to W with L_w valid frames
      -> the tower on each window (multimodal/whisper_encoder.py's modules, run on the window's
         own width): gelu(conv1) -> gelu(conv2) -> + positions[:T] -> layers (keys past
         (L_w - 1) // 2 + 1 masked) -> layer_norm  [T, D], T = rows of the window's width
      -> zero rows up to a multiple of s = stack_factor, each s rows as one [s * D] row
      -> multi_modal_projector: ln_pre -> linear_1 -> act -> ln_mid -> linear_2 -> ln_post
         (RMSNorms, eps 1e-6; ln_mid with projector_ln_mid (v0.5), else ln_post (v0.4); no
         biases; "swiglu": x * silu(gate) over linear_1's two halves, vLLM's MulAndSilu)
      -> each window's first ceil(L_w / (2 * s)) rows, the clip's windows in order
    prompt: the text's "<|audio|>" -> a run of audio_token_index (one past the text model's
        vocabulary, as the releases' is: its last id instead, `placeholder_id`)

As fixie's UltravoxProcessor (what vLLM runs) builds a prompt: the text split at "<|audio|>",
each part tokenized without special tokens (the caller writes BOS: vLLM tokenizes every
Ultravox prompt with add_special_tokens=False, and so does `request_prompt` here), a run of
placeholders between parts. Prompt token ids holding "<|audio|>" as text (a chat template's
output, encoded whole by LLM.chat and the server's chat route) are decoded and split the same
way when the prompt has audio (`process`); ids already holding audio_token_index pass as they
are. Chat: the releases' templates take string content, where a message's audio parts become
"<|audio|>" lines before its text (multimodal/chat_format.py, vLLM's "string" content format).

The tower is fixie's ModifiedWhisperEncoder: a window shorter than the tower's 30 s takes the
first T position rows, and a padded window's padding rows are computed (queries) but masked as
keys, their outputs reaching the stacked row they fall in, as HF's. Weights: `audio_tower.*`
(Whisper encoder names) and `multi_modal_projector.*`.

A release naming `audio_model_id` without a preprocessor_config.json of its own takes that
model's feature extractor (its tokenizer, if missing, is text_model_id's: loader.py).

Refused by name: the processor settings it does not implement (processor_config.json's
`encoder_ds_factor` other than 2, `audio_context_size` over the tower's context, a feature
extractor whose mel count is not audio_config.num_mel_bins), and the config fields
models/ultravox_config.py refuses.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.norm import RMSNorm
from paged_engine.models.ultravox_linked import AUDIO, linked_dir
from paged_engine.multimodal.audio import AudioProcessor, Loaded, feature_extractor
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.whisper_encoder import WhisperEncoder, load_audio_weights
from paged_engine.unicode_text import check_text

PLACEHOLDER = "<|audio|>"  # the prompt's text for a clip (UltravoxProcessor's audio_placeholder)
DS_FACTOR = 2  # feature frames per tower row (conv2's stride: the processor's encoder_ds_factor)


def window_tokens(valid: int, stack: int) -> int:
    """Projector rows a window of `valid` feature frames gives (the processor's count)."""
    return math.ceil(valid / (DS_FACTOR * stack))


class Ultravox(AudioProcessor):
    """Clips as windows of the tower's context; each clip one run of audio_token_index."""

    def __init__(self, path: Any, config: Any, tokenizer: Any, limit: int | None = None) -> None:
        super().__init__(path, config, tokenizer, limit)
        audio = config.audio_config
        context = 2 * int(audio.max_source_positions)
        settings: dict = {}
        saved = self.path / "processor_config.json"
        if saved.exists():
            settings = json.loads(saved.read_text())
        if int(settings.get("encoder_ds_factor", DS_FACTOR)) != DS_FACTOR:
            raise ValueError(
                f"{self.path}: processor_config.json's encoder_ds_factor="
                f"{settings['encoder_ds_factor']} (an older processor's count) is not "
                f"supported; the Whisper tower's is {DS_FACTOR}"
            )
        self.window = int(settings.get("audio_context_size") or context)  # frames a window
        if not 0 < self.window <= context:
            raise ValueError(
                f"{self.path}: processor_config.json's audio_context_size={self.window} frames "
                f"is over the audio tower's {context} (2 * audio_config.max_source_positions)"
            )
        if int(self.extractor.feature_size) != int(audio.num_mel_bins):
            raise ValueError(
                f"{self.path}: the feature extractor gives {self.extractor.feature_size} mels; "
                f"the audio tower takes {audio.num_mel_bins} (audio_config.num_mel_bins)"
            )
        self.stack = int(config.stack_factor)
        self.hop = int(self.extractor.hop_length)

    def load_extractor(self) -> Any:
        """The checkpoint's feature extractor; where it has no preprocessor_config.json,
        audio_model_id's (fixie's processor builds its audio processor from that id)."""
        model_id = getattr(self.config, "audio_model_id", None)
        if model_id is None or (self.path / "preprocessor_config.json").exists():
            return super().load_extractor()
        return feature_extractor(linked_dir(AUDIO, model_id))

    def placeholder_id(self) -> int:
        """audio_token_index, or where it is past the text model's vocabulary (the releases'
        `<|audio|>`, added to Llama 3's tokenizer at id vocab_size) its last id, a reserved
        token in Llama 3: paged embeds a step's every id before the audio rows replace the
        run's, and a prompt logprob reads the next id's row."""
        index, vocab = int(self.config.audio_token_index), int(self.config.text_config.vocab_size)
        return index if 0 <= index < vocab else vocab - 1

    def request_prompt(self, prompt: Any) -> Any:
        """A text prompt as token ids the way the processor writes them (see the module doc);
        token ids that come with audio and hold "<|audio|>" as text, split the same way."""
        if isinstance(prompt, str):
            return {"prompt": prompt, "prompt_token_ids": self._ids(prompt)}
        if not isinstance(prompt, dict) or "prompt_embeds" in prompt:
            return prompt
        ids, text = prompt.get("prompt_token_ids"), prompt.get("prompt")
        if ids is None and isinstance(text, str) and text:
            return {**prompt, "prompt_token_ids": self._ids(text)}
        data = prompt.get("multi_modal_data")
        if isinstance(data, dict) and "audio" in data and isinstance(ids, (list, tuple)):
            split = self._resplit(list(ids))
            if split is not None:
                return {**prompt, "prompt_token_ids": split}
        return prompt

    def process(
        self, token_ids: list[int], data: Any, kwargs: Any = None
    ) -> tuple[list[int], tuple[ImageInput, ...], list[tuple[int, int]]]:
        """The base class's, after ids that hold "<|audio|>" as text (a chat template's prompt
        encoded whole: the server's chat route) are split as the processor splits the text.
        (Then the runs' (where, added) count in the split ids: Ultravox takes no other media
        whose places would move with them.)"""
        if data is not None:
            token_ids = self._resplit(token_ids) or token_ids
        return super().process(token_ids, data, kwargs)

    def _resplit(self, ids: list[int]) -> list[int] | None:
        """`ids` decoded and split at "<|audio|>" (`_ids`) where they hold it as text and no
        placeholder id; None otherwise."""
        if self.placeholder in ids or not all(type(t) is int and t >= 0 for t in ids):
            return None
        text = self.tokenizer.decode(ids)
        return self._ids(text) if PLACEHOLDER in text else None

    def _ids(self, text: str) -> list[int]:
        if not text:
            raise ValueError("prompt must not be empty")
        check_text(text, "prompt")  # (the tokenizer would raise a UnicodeEncodeError)
        parts = [
            self.tokenizer.encode(p, add_special_tokens=False) for p in text.split(PLACEHOLDER)
        ]
        out = parts[0]
        for part in parts[1:]:
            out = out + [self.placeholder] + part
        return out

    def load(self, wave: np.ndarray, what: str) -> Loaded:
        if wave.size < 2 * self.hop:  # the processor's floor: two hops of samples
            wave = np.pad(wave, (0, 2 * self.hop - wave.size))
        out = self.extract(
            wave,
            what,
            padding="longest",
            pad_to_multiple_of=self.hop,
            truncation=False,
            return_attention_mask=True,
        )
        features = out["input_features"][0].float()  # [mels, L]
        frames = int(out["attention_mask"][0].sum())
        valid = [min(frames - at, self.window) for at in range(0, frames, self.window)]
        if len(valid) == 1:  # one window: its own width (no padding reaches conv2)
            windows = features[None, :, :frames]
        else:
            padded = F.pad(features[:, :frames], (0, len(valid) * self.window - frames))
            windows = padded.view(features.shape[0], len(valid), self.window).transpose(0, 1)
        count = sum(window_tokens(v, self.stack) for v in valid)
        return windows.contiguous(), tuple(valid), count  # [windows, mels, width]


class UltravoxProjector(nn.Module):
    """The stacked tower rows into the text model's hidden size (fixie's UltravoxProjector)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        d_in = int(config.audio_config.d_model) * int(config.stack_factor)
        d_mid, d_out = int(config.hidden_size), int(config.text_config.hidden_size)
        self.swiglu = config.projector_act == "swiglu"
        if self.swiglu:
            if d_mid % 2:
                raise ValueError(
                    f"Ultravox: hidden_size={d_mid} must be even for projector_act 'swiglu' "
                    "(linear_1's output is split in halves)"
                )
            self.act: nn.Module = nn.Identity()
        else:
            self.act = get_act_fn(config.projector_act, "projector_act")
        self.ln_pre = RMSNorm(d_in)
        self.linear_1 = nn.Linear(d_in, d_mid, bias=False)
        d_act = d_mid // 2 if self.swiglu else d_mid
        self.linear_2 = nn.Linear(d_act, d_out, bias=False)
        self.ln_mid = RMSNorm(d_act) if config.projector_ln_mid else None
        self.ln_post = None if config.projector_ln_mid else RMSNorm(d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, rows, s * D]
        h = self.linear_1(self.ln_pre(x))
        if self.swiglu:
            h, gate = h.chunk(2, dim=-1)
            h = h * F.silu(gate)
        else:
            h = self.act(h)
        if self.ln_mid is not None:
            h = self.ln_mid(h)
        h = self.linear_2(h)
        return h if self.ln_post is None else self.ln_post(h)


class UltravoxEncoder(nn.Module):
    """The tower and the projector: `encode(clips)` -> each clip's [n, text hidden]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.stack = int(config.stack_factor)
        self.audio_tower = WhisperEncoder(config.audio_config)
        self.multi_modal_projector = UltravoxProjector(config)

    def tower(self, features: torch.Tensor, valid: list[int]) -> torch.Tensor:
        """features [B, mels, width] (width <= the tower's frames) -> [B, T, D], each window's
        keys past its valid rows masked; every row computed (fixie's ModifiedWhisperEncoder)."""
        t = self.audio_tower
        x = F.gelu(t.conv1(features.to(t.conv1.weight.dtype)))
        x = F.gelu(t.conv2(x)).transpose(1, 2)
        rows = x.shape[1]
        x = x + t.embed_positions.weight[:rows]
        keep = [(v - 1) // 2 + 1 for v in valid]
        mask = None
        if min(keep) < rows:
            pos = torch.arange(rows, device=x.device)
            mask = (pos[None, :] < torch.tensor(keep, device=x.device)[:, None])[:, None, None]
        for layer in t.layers:
            x = layer(x, mask)
        return t.layer_norm(x)

    def encode(self, clips: Sequence[ImageInput]) -> list[torch.Tensor]:
        assert all(m.pixel_values is not None and m.image_size for m in clips)
        device = self.multi_modal_projector.linear_1.weight.device
        out: list[torch.Tensor | None] = [None] * len(clips)
        by_width: dict[int, list[int]] = {}  # windows of one width run as one batch
        for i, m in enumerate(clips):
            by_width.setdefault(m.pixel_values.shape[-1], []).append(i)  # type: ignore[union-attr]
        for idx in by_width.values():
            features = torch.cat([clips[i].pixel_values for i in idx]).to(device)  # type: ignore[misc]
            valid = [v for i in idx for v in clips[i].image_size]  # type: ignore[union-attr]
            x = self.tower(features, valid)
            b, rows, d = x.shape
            x = F.pad(x, (0, 0, 0, -rows % self.stack))
            x = self.multi_modal_projector(x.reshape(b, -1, self.stack * d))
            at = 0
            for i in idx:
                n = clips[i].pixel_values.shape[0]  # type: ignore[union-attr]
                parts = [
                    x[at + w, : window_tokens(v, self.stack)]
                    for w, v in enumerate(clips[i].image_size)  # type: ignore[arg-type]
                ]
                out[i] = torch.cat(parts)
                at += n
                assert out[i].shape[0] == clips[i].length, (out[i].shape, clips[i].length)
        return out  # type: ignore[return-value]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_audio_weights(self, weights, "Ultravox's audio tower")
