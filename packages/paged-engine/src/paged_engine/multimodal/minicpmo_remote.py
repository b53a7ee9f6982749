"""MiniCPM-o 2.6 as the Hub ships it (`MiniCPMO`, remote code; vLLM's registry name, its
minicpmo.py): MiniCPM-V 2.6's images (multimodal/minicpmv_remote.py's layout and encoder, as
they are: archs.py maps `MiniCPMO` to the "minicpmv_remote" kind) plus audio input, this
module. The config: models/minicpmo_remote_config.py; the decoder: Qwen2 under `llm.`
(models/text_wrappers.py's row; `tts.*` skipped: the TTS is output-only, vLLM does not run it).

    clip (mono, 16 kHz, at most 30 s) -> transformers' WhisperFeatureExtractor padded to its
        30 s window with its attention mask, cut to the clip's L = ceil(samples / hop) frames
        (the remote processor's audio_feature_extract)
    -> `apm`: Whisper's encoder (multimodal/whisper_encoder.py's layers) on the L frames:
        gelu(conv1), gelu(conv2, stride 2) -> T = (L - 1) // 2 + 1 rows, + embed_positions[:T],
        the layers under a block-causal mask (row i reads rows j < (i // c + 1) c, c = 50 x
        audio_chunk_length: vLLM's subsequent_chunk_mask, num_left_chunks -1), layer_norm
        (hidden_states[-1])
    -> `audio_projection_layer`: linear1 -> relu -> linear2 (to the text width)
    -> AvgPool1d(audio_pool_step) over time: n = (T - 2) // 2 + 1 rows
    prompt: the k-th "(<audio>./</audio>)" of the text -> n <unk>s in 1 s chunks of 25, each
        chunk in <|audio_start|> ... <|audio_end|> (the remote get_audio_placeholder with
        chunk_input, as vLLM calls it); the text between tokenized apart (the markers are
        special tokens: the remote processor's single tokenization splits there as well)

Each 25-row chunk is one `ImageInput` (modality "audio") over its run of <unk>s, carrying the
whole clip's features and image_size (clip key, chunk index, n); the encoder runs a clip once
per call for all its chunks there and hands each its rows. Each clip is encoded alone, as
vLLM does with a single clip in the batch (its batching pads clips together and its padding
mask compares conv rows with mel lengths: a clip's rows there depend on its batch).

Refused by name: a clip longer than 30 s (the remote processor's 30 s windows of longer audio
are not served), a clip too short for one row, a preprocessor_config.json whose Whisper
settings differ from the release's (16 kHz, hop 160, 30 s window, feature_size num_mel_bins),
a tokenizer without <|audio_start|> / <|audio_end|>, a prompt whose "(<audio>./</audio>)"
count differs from its clips, mm_processor_kwargs (audio.py). Videos are not run.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.multimodal.audio import AudioProcessor, Loaded
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import digest, token_ids
from paged_engine.multimodal.minicpmv_remote import MARKERS
from paged_engine.multimodal.whisper_encoder import WhisperEncoder, load_into

PATTERN = "(<audio>./</audio>)"  # vLLM's audio placeholder text (get_placeholder_str)
AUDIO_START, AUDIO_END = "<|audio_start|>", "<|audio_end|>"
CHUNK_ROWS = 25  # rows of a 1 s chunk: ((100 - 1) // 2 + 1 - 2) // 2 + 1 (pool step 2)
MAX_SECONDS = 30
_WHISPER = {"sampling_rate": 16000, "hop_length": 160, "chunk_length": 30, "n_fft": 400}


def rows_of(frames: int, pool: int = 2) -> int:
    """Rows a clip of `frames` mel frames gives: conv2's stride 2, then the pooling."""
    return ((frames - 1) // 2 + 1 - pool) // pool + 1


class MiniCPMORemoteAudio(AudioProcessor):
    """The host side: clips -> their Whisper features, each "(<audio>./</audio>)" -> its
    chunked <unk> runs (the module doc), each chunk one `ImageInput`."""

    def load_extractor(self) -> Any:
        """WhisperFeatureExtractor at the release's settings (preprocessor_config.json's Whisper
        fields where it has them, checked)."""
        import transformers

        file = self.path / "preprocessor_config.json"
        saved = json.loads(file.read_text()) if file.is_file() else {}
        mels = int(self.config.audio_config.num_mel_bins)
        settings = {k: saved.get(k, v) for k, v in {**_WHISPER, "feature_size": mels}.items()}
        for name, want in {**_WHISPER, "feature_size": mels}.items():
            if settings[name] != want:
                raise ValueError(
                    f"MiniCPMO: preprocessor_config.json {name}={settings[name]!r} is not "
                    f"supported ({want}: the release's)"
                )
        return transformers.WhisperFeatureExtractor(**settings, padding_value=0.0)

    def placeholder_id(self) -> int:
        tok = self.tokenizer
        self.start, self.end = token_ids(tok, AUDIO_START, AUDIO_END)
        breaks = {int(self.config.image_token_id), *token_ids(tok, *MARKERS.values())}
        bos = getattr(tok, "bos_token_id", None)
        self.breaks = breaks | ({bos} if bos is not None else set())
        return int(self.config.image_token_id)  # "<unk>", the images' placeholder too

    def load(self, wave: np.ndarray, what: str) -> Loaded:
        """(features [mels, L], None, n rows); ValueError naming `what` past 30 s or under one
        row."""
        if len(wave) > MAX_SECONDS * self.sampling_rate:
            raise ValueError(
                f"{what}: a clip of {len(wave) / self.sampling_rate:.2f} s is longer than "
                f"{MAX_SECONDS} s (MiniCPM-o's 30 s windows of longer audio are not served)"
            )
        frames = math.ceil(len(wave) / self.extractor.hop_length)
        n = rows_of(frames)
        if n < 1:
            raise ValueError(f"{what}: the clip ({len(wave)} samples) is too short for one row")
        out = self.extract(wave, what, padding="max_length", return_attention_mask=True)
        assert int(out["attention_mask"].sum()) == frames, "the extractor's valid frames"
        return out["input_features"][0, :, :frames].float().contiguous(), None, n

    def place_runs(
        self, ids: list[int], lengths: list[int]
    ) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """Each PATTERN of the prompt's text (between image segments: spans of ids without
        the image placeholder or markers, decoded) -> its clip's chunked segment, the text
        around it tokenized apart; (ids, each clip's first <unk>, (span start, tokens
        added) of each span rewritten); ValueError naming multi_modal_data['audio'] unless
        there is one PATTERN per clip."""
        tok = self.tokenizer
        spans, s = [], None
        for i, t in enumerate([*ids, None]):
            if t is None or t in self.breaks:
                if s is not None:
                    spans.append((s, i))
                s = None
            elif s is None:
                s = i
        texts = {sp: tok.decode(ids[sp[0] : sp[1]], skip_special_tokens=False) for sp in spans}
        found = sum(text.count(PATTERN) for text in texts.values())
        if found != len(lengths):
            raise ValueError(
                f"multi_modal_data['audio'] has {len(lengths)} clip(s) but the prompt has "
                f"{found} audio placeholder(s) ({PATTERN}): put one per clip"
            )
        out: list[int] = []
        starts: list[int] = []
        added: list[tuple[int, int]] = []
        last, clip = 0, 0
        for (a, b), text in texts.items():
            if PATTERN not in text:
                continue
            out += ids[last:a]
            before = len(out)
            pieces = text.split(PATTERN)
            out += tok.encode(pieces[0], add_special_tokens=False)
            for piece in pieces[1:]:
                starts.append(len(out) + 1)
                out += self.segment(lengths[clip]) + tok.encode(piece, add_special_tokens=False)
                clip += 1
            added.append((a, len(out) - before - (b - a)))
            last = b
        return out + ids[last:], starts, added

    def segment(self, n: int) -> list[int]:
        """n <unk>s in chunks of CHUNK_ROWS, each between <|audio_start|> and <|audio_end|>."""
        out: list[int] = []
        for k in range(0, n, CHUNK_ROWS):
            out += [self.start] + [self.placeholder] * min(CHUNK_ROWS, n - k) + [self.end]
        return out

    def process(
        self, token_ids: list[int], data: Any, kwargs: Any = None
    ) -> tuple[list[int], tuple[ImageInput, ...], list[tuple[int, int]]]:
        """audio.py's, each placed clip then cut into its chunks' `ImageInput`s."""
        ids, clips, added = super().process(token_ids, data, kwargs)
        out: list[ImageInput] = []
        for m in clips:
            if m.image_size is not None and len(m.image_size) == 3:  # chunks already
                out.append(m)
                continue
            key, n = int(m.mm_hash[:12], 16), m.length
            for k in range(0, n, CHUNK_ROWS):
                size = (key, k // CHUNK_ROWS, n)
                at = m.offset + (k // CHUNK_ROWS) * (CHUNK_ROWS + 2)
                f = m.pixel_values
                assert f is not None
                out.append(
                    dataclasses.replace(
                        m,
                        offset=at,
                        length=min(CHUNK_ROWS, n - k),
                        mm_hash=digest(f, size),
                        image_size=size,
                    )
                )
        return ids, tuple(out), added


class _Projector(nn.Module):
    """`audio_projection_layer`: linear1 -> relu -> linear2."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(width, hidden)
        self.linear2 = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.relu(self.linear1(x)))


class MiniCPMORemoteAudioEncoder(nn.Module):
    """`apm` + `audio_projection_layer` + the pooling: a clip's features -> its n rows."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        audio = config.audio_config
        self.apm = WhisperEncoder(audio)  # (its modules; `rows` runs them)
        self.audio_projection_layer = _Projector(
            int(audio.d_model), int(config.text_config.hidden_size)
        )
        self.pool = int(config.audio_pool_step)
        self.chunk = int(config.audio_chunk_length * 50)  # encoder rows a second

    def rows(self, features: torch.Tensor) -> torch.Tensor:
        """features [mels, L] -> [rows_of(L), text width] (the module doc)."""
        apm, w = self.apm, self.apm.conv1.weight
        x = F.gelu(apm.conv1(features[None].to(w.device, w.dtype)))
        x = F.gelu(apm.conv2(x)).transpose(1, 2)
        t = x.shape[1]
        x = x + apm.embed_positions.weight[:t]
        i = torch.arange(t, device=x.device)
        mask = i[None, :] < (i[:, None] // self.chunk + 1) * self.chunk  # [query, key]
        for layer in apm.layers:
            x = layer(x, mask[None, None])
        x = self.audio_projection_layer(apm.layer_norm(x))
        return F.avg_pool1d(x.transpose(1, 2), self.pool, self.pool).transpose(1, 2)[0]

    def encode(self, clips: list[ImageInput]) -> list[torch.Tensor]:
        """Each chunk's rows; a clip runs once for all its chunks of the call."""
        done: dict[int, torch.Tensor] = {}
        out = []
        for m in clips:
            assert m.pixel_values is not None and m.image_size is not None
            key, k, n = m.image_size
            if key not in done:
                done[key] = self.rows(m.pixel_values)
                if done[key].shape[0] != n:
                    raise RuntimeError(f"an audio clip gave {done[key].shape[0]} rows, not {n}")
            out.append(done[key][k * CHUNK_ROWS : k * CHUNK_ROWS + m.length])
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `apm.*` and `audio_projection_layer.*` tensors (others passed
        over); ValueError naming a missing one."""

        def mine() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(("apm.", "audio_projection_layer.")):
                    yield name, tensor

        return load_into(self, mine(), "MiniCPMO's audio encoder")
