"""Whisper's host side: a request's audio clip as log-mel features, its decoder prompt as ids.

Two prompt forms, as vLLM takes them (`request_prompt`):

    {"prompt": "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>",
     "multi_modal_data": {"audio": (waveform, sample_rate)}}
    {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": ...}},
     "decoder_prompt": "<|startoftranscript|>..."}   (a str, token ids or a dict of either)

The decoder prompt's text is tokenized without special tokens added (a Whisper tokenizer would
add its own prefix and <|endoftext|>); a missing, None or empty decoder prompt is
config.decoder_start_token_id alone. `whisper_prompt` builds the usual prefix from (language,
task, timestamps); `WhisperAudio.transcription_prompt` (/v1/audio/transcriptions) puts a
client's context text before it after <|startofprev|>, cut to its last
max_target_positions // 2 - 1 tokens as OpenAI's Whisper cuts it (and transformers' long-form
generate cuts the previous window's tokens).

Speech-to-text helpers for the server (which runs them through the engine, never a second
model):
- `language_detection()`: transformers' `detect_language` as one engine request: the decoder
  start token alone, max_tokens=1, greedy over allowed_token_ids = the tokenizer's language
  tokens (<|en|>, ...; transformers masks every other logit of that step to -inf and takes
  the argmax: the same token).
- `transcription_prompt(..., timestamps=True)`: the prefix without <|notimestamps|> and with
  <|0.00|> forced after it (as vLLM's verbose_json does: nothing here applies Whisper's
  timestamp rules to the sampled tokens, so the first timestamp is written, not sampled).
- `timestamp_segments(tokens)`: the generated ids after that <|0.00|> split at each pair of
  adjacent timestamp tokens (timestamp i is id <|notimestamps|> + 1 + i, i * 0.02 s: two
  encoder frames), as transformers' `decode(..., output_offsets=True)` splits them. Unlike
  it: the prompt's <|0.00|> opens the first segment, times never wrap into a next 30 s
  window (a decreasing timestamp is taken as it is), and text after the last timestamp (or
  with none) is kept as a segment that ends with the window.

`WhisperAudio.process` (`CrossAttendedAudio`'s, shared with Moonshine: an AudioProcessor,
multimodal/audio.py, without a placeholder token)
turns the clip (mono float32 at the feature extractor's 16 kHz, multimodal/audio_io.py) into
transformers' WhisperFeatureExtractor output, padded to its window (chunk_length s:
[num_mel_bins, 2 * max_source_positions]). There are no placeholders: the
returned ImageInput (modality "audio") spans every decoder position [0, max_target_positions),
so it reaches the worker with every sequence that holds it (new, forked, resumed) and its hash
keys every prefix-cache block (two clips never share decoder KV). The decoder reads it through
cross-attention (worker/cross_attention.py).

Refused by name: timestamps with a tokenizer whose <|notimestamps|> is not followed by
<|0.00|> (`timestamps`), more than one clip a prompt, a clip longer than the window (vLLM's
chunking of long audio is not done), a prompt without audio, text in encoder_prompt,
mm_processor_kwargs, a feature extractor whose window or mel count does not match the model's
config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from paged_engine.multimodal.audio import AudioProcessor
from paged_engine.multimodal.audio_io import audio_item
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import digest

WHAT = "multi_modal_data['audio']"
TASKS = ("transcribe", "translate")


@dataclass(slots=True)
class Segment:
    """One timed stretch of a window's transcript, in seconds from the window's start."""

    start: float
    end: float
    text: str
    tokens: list[int]  # its ids, bounding timestamp tokens included
    sampled: tuple[int, int]  # [a, b): where its sampled ids sit in the generated ids


def whisper_prompt(
    tokenizer: Any, language: str = "en", task: str = "transcribe", timestamps: bool = False
) -> list[int]:
    """<|startoftranscript|> <|language|> <|task|> [<|notimestamps|>] as token ids; `language`
    a code ("en") or an English name ("english")."""
    from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    code = TO_LANGUAGE_CODE.get(language.lower(), language.lower())
    tokens = ["<|startoftranscript|>", f"<|{code}|>", f"<|{task}|>"]
    if not timestamps:
        tokens.append("<|notimestamps|>")
    vocab = tokenizer.get_vocab()
    if tokens[1] not in vocab:
        raise ValueError(f"language={language!r} is not a language of this Whisper tokenizer")
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ValueError(f"the tokenizer lacks Whisper's special tokens {missing}")
    return [vocab[t] for t in tokens]


def request_prompt(prompt: Any, tokenizer: Any, hf_config: Any, family: str = "Whisper") -> dict:
    """Either prompt form -> {"prompt" (text or None), "prompt_token_ids", "multi_modal_data",
    and the prompt's other keys} for the input processor; refusals name `family` (the model
    the request is for)."""
    if not isinstance(prompt, dict):
        text = "<|startoftranscript|>..." if family == "Whisper" else ""
        raise ValueError(
            f"{WHAT}: a {family} prompt is a dict with the clip, e.g. {{'prompt': '{text}', "
            "'multi_modal_data': {'audio': (waveform, sr)}}"
        )
    if "encoder_prompt" in prompt:
        enc = prompt["encoder_prompt"]
        if not isinstance(enc, dict) or "multi_modal_data" not in enc:
            raise ValueError("encoder_prompt must be a dict holding multi_modal_data['audio']")
        if enc.get("prompt") or enc.get("prompt_token_ids"):
            raise ValueError(f"encoder_prompt: {family}'s encoder takes audio only, not text")
        extra = {k: v for k, v in prompt.items() if k not in ("encoder_prompt", "decoder_prompt")}
        dec = prompt.get("decoder_prompt")
        if isinstance(dec, dict):
            unknown = sorted(set(dec) - {"prompt", "prompt_token_ids"})
            if unknown:
                raise ValueError(
                    f"decoder_prompt takes 'prompt' or 'prompt_token_ids', got {unknown}"
                )
            dec_fields = dict(dec)
        elif dec is None:
            dec_fields = {"prompt_token_ids": [int(hf_config.decoder_start_token_id)]}
        elif isinstance(dec, str):
            dec_fields = {"prompt": dec}
        else:
            dec_fields = {"prompt_token_ids": dec}
        kw = {k: enc[k] for k in ("mm_processor_kwargs",) if k in enc}
        prompt = {**extra, **kw, **dec_fields, "multi_modal_data": enc["multi_modal_data"]}
    mm = prompt.get("multi_modal_data")
    if not isinstance(mm, dict) or "audio" not in mm:
        raise ValueError(f"{WHAT}: every {family} prompt needs an audio clip")
    text = prompt.get("prompt")
    if "prompt_token_ids" not in prompt and isinstance(text, str):
        start = [int(hf_config.decoder_start_token_id)]
        ids = tokenizer.encode(text, add_special_tokens=False) if text else start
        prompt = {**prompt, "prompt_token_ids": ids}
    return prompt


class CrossAttendedAudio(AudioProcessor):
    """An encoder-decoder's audio (Whisper, Moonshine): one clip a prompt, no placeholder run
    (the decoder prompt's ids pass as they are, the decoder cross-attends to the clip), its
    item spanning every decoder position [0, span), the prompt in vLLM's forms
    (`request_prompt`). A family sets `family`, `span` and `clip_features`."""

    family: str  # the name refusals give
    span: int  # the decoder's positions

    def placeholder_id(self) -> int:
        return -1  # no token stands for the clip: the decoder cross-attends to it

    def clip_features(self, wave: np.ndarray) -> torch.Tensor:
        """One clip (mono float32 at `sampling_rate`) as the encoder reads it; ValueError
        naming multi_modal_data['audio'] for a clip the family refuses."""
        raise NotImplementedError

    def request_prompt(self, prompt: Any) -> dict:
        return request_prompt(prompt, self.tokenizer, self.config, self.family)

    def process(
        self, token_ids: list[int], data: Any, kwargs: Any = None
    ) -> tuple[list[int], tuple[ImageInput, ...], list[tuple[int, int]]]:
        """(the decoder prompt's ids as they are, the clip's item, no run added)."""
        if kwargs:
            name = next(iter(kwargs))
            raise ValueError(f"mm_processor_kwargs[{name!r}]: {self.family}'s audio takes none")
        clips = data if isinstance(data, list) else [data]
        if len(clips) != 1:
            raise ValueError(f"{WHAT}: {self.family} takes one clip a prompt, got {len(clips)}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"{WHAT}: limit_mm_per_prompt['audio']={self.limit}")
        clip = clips[0]
        if isinstance(clip, ImageInput):  # this method's output (a server's request thread)
            if clip.modality != "audio" or (clip.offset, clip.length) != (0, self.span):
                raise ValueError(f"{WHAT}: a processed clip that is not {self.family}'s")
            return token_ids, (clip,), []
        features = self.clip_features(audio_item(clip, self.sampling_rate, WHAT))
        item = ImageInput(features, 0, self.span, digest(features, None), modality="audio")
        return token_ids, (item,), []


class WhisperAudio(CrossAttendedAudio):
    """The host side of Whisper's audio (audio_archs.py's "whisper" kind): one clip a prompt,
    no placeholder run (the decoder prompt's ids pass as they are)."""

    def __init__(self, path: Any, config: Any, tokenizer: Any, limit: int | None = None) -> None:
        super().__init__(path, config, tokenizer, limit)
        fe = self.extractor
        frames = 2 * int(config.max_source_positions)  # conv2 halves the frames
        if fe.nb_max_frames != frames or fe.feature_size != int(config.num_mel_bins):
            raise ValueError(
                f"{path}: the feature extractor's chunk_length={fe.chunk_length} s gives "
                f"{fe.nb_max_frames} frames of {fe.feature_size} mels; the model takes {frames} "
                f"of {config.num_mel_bins} (config.max_source_positions, config.num_mel_bins)"
            )
        self.span = int(config.max_target_positions)  # every decoder position
        from transformers.models.whisper.tokenization_whisper import LANGUAGES

        vocab = tokenizer.get_vocab()
        # {language token id: its code}; <|0.00|> where it follows <|notimestamps|>, else None
        self.languages = {vocab[f"<|{c}|>"]: c for c in LANGUAGES if f"<|{c}|>" in vocab}
        first = vocab.get("<|0.00|>")
        self.first_timestamp = first if first == vocab.get("<|notimestamps|>", -2) + 1 else None

    family = "Whisper"
    default_language = "en"  # what transcription_prompt writes for language None

    @property
    def transcription_window(self) -> int:
        """Samples of one transcription request (the feature extractor's window): the
        /v1/audio routes split a longer clip at quiet points and run each window."""
        return int(self.extractor.n_samples)

    def transcription_prompt(
        self, language: str | None, task: str, prompt: str, timestamps: bool = False
    ) -> dict:
        """/v1/audio/transcriptions' decoder prompt: [<|startofprev|> context] then
        `whisper_prompt` (language None: "en", as vLLM defaults it); `timestamps`: ending in
        <|0.00|> instead of <|notimestamps|>."""
        ids = whisper_prompt(self.tokenizer, language or "en", task, timestamps)
        if timestamps:
            ids.append(self._first_timestamp("timestamps"))
        if not prompt:
            return {"prompt_token_ids": ids}
        prev = self.tokenizer.get_vocab().get("<|startofprev|>")
        if prev is None:
            raise ValueError("prompt: this Whisper tokenizer has no <|startofprev|> token")
        context = self.tokenizer.encode(" " + prompt.strip(), add_special_tokens=False)
        keep = self.span // 2 - 1  # OpenAI's Whisper: the context's last n_text_ctx // 2 - 1
        return {"prompt_token_ids": [prev, *context[-keep:], *ids]}

    # ---- language detection and timestamps (the /v1/audio routes) ----------------------------
    def language_detection(self) -> tuple[dict, dict[int, str]] | None:
        """(the detection prompt without the audio, {language token id: its code}) for one
        greedy step restricted to those ids; None for a tokenizer without language tokens
        (English-only checkpoints)."""
        if not self.languages:
            return None
        return {"prompt_token_ids": [int(self.config.decoder_start_token_id)]}, self.languages

    @property
    def time_precision(self) -> float:
        """Seconds between timestamp tokens: two feature frames (conv2's stride)."""
        return 2 * self.extractor.hop_length / self.sampling_rate

    @property
    def has_timestamps(self) -> bool:
        """Whether the tokenizer has Whisper's timestamp tokens (`timestamps` prompts)."""
        return self.first_timestamp is not None

    def _first_timestamp(self, what: str) -> int:
        """The id of <|0.00|>: the one after <|notimestamps|> (Whisper's layout)."""
        if self.first_timestamp is None:
            raise ValueError(
                f"{what}: this Whisper tokenizer has no timestamp tokens (<|0.00|> right "
                "after <|notimestamps|>)"
            )
        return self.first_timestamp

    def timestamp_segments(self, generated: list[int], window: float) -> list[Segment]:
        """The segments of tokens sampled after a `timestamps` prompt over a clip of `window`
        seconds (see the module docstring); a trailing end-of-text is dropped."""
        begin = self._first_timestamp("timestamps")
        eos = self.tokenizer.eos_token_id
        gen = list(generated[:-1] if generated and generated[-1] == eos else generated)
        seq = [begin, *gen]  # the prompt's <|0.00|> opens the first segment
        is_ts = [t >= begin for t in seq]
        # a segment ends at a timestamp followed by another (the next one's start), or at the
        # last timestamp
        cuts = [i for i in range(1, len(seq)) if is_ts[i - 1] and is_ts[i]]
        last_ts = max(i for i, t in enumerate(is_ts) if t)
        if last_ts + 1 not in cuts:
            cuts.append(last_ts + 1)
        out, first = [], 0
        for cut in cuts:
            piece = seq[first:cut]
            if len(piece) > 1:
                end = (piece[-1] - begin) * self.time_precision
                out.append(self._segment(piece, piece[0], end, first))
            first = cut
        if first < len(seq):  # text after the last timestamp: to the window's end
            if cut - 1 == 0 or is_ts[cut - 2]:  # a lone timestamp opens it: its start
                first -= 1
            out.append(self._segment(seq[first:], seq[last_ts], window, first))
        return out

    def _segment(self, piece: list[int], opened: int, end: float, first: int) -> Segment:
        """`piece` = seq[first : first + len(piece)], seq[0] the forced <|0.00|> (not
        sampled): its sampled ids are generated[max(first - 1, 0) : first + len - 1]."""
        begin = self._first_timestamp("timestamps")
        words = [t for t in piece if t < begin]
        text = self.tokenizer.decode(words, skip_special_tokens=True)
        start = (opened - begin) * self.time_precision
        sampled = (max(first - 1, 0), first + len(piece) - 1)
        return Segment(start, end, text, piece, sampled)

    def clip_features(self, wave: np.ndarray) -> torch.Tensor:
        """The log-mel features [num_mel_bins, 2 * max_source_positions], padded to the
        window; ValueError for a clip longer than it."""
        fe = self.extractor
        if wave.shape[0] > fe.n_samples:
            raise ValueError(
                f"{WHAT}: a clip of {wave.shape[0] / self.sampling_rate:.2f} s is longer than "
                f"Whisper's {fe.chunk_length} s window (split it into clips of the window)"
            )
        return self.extract(wave, WHAT)["input_features"][0].float().contiguous()
