"""Gemma 3n's audio path (Gemma3nForConditionalGeneration: E2B / E4B), its USM conformer.

    clip (16 kHz) -> Gemma3nAudioFeatureExtractor (numpy: 32 ms Hann frames every 10 ms,
        preemphasis, |rfft| of twice the frame, mel bank, log): F frames [F, mels], the first V
        starting inside the clip (all F for a clip alone; fewer for features padded as HF pads
        a batch, which a client may send processed)
    subsampling: two Conv2d blocks, each padded by one mel bin a side and kernel - 1 frames after
        (each row reads its own and later frames), a cumulative group norm over (mel, channel)
        (running mean and variance over the rows so far, a weight per channel) and ReLU; the
        (mel, channel) grid of each row flattened and projected -> T = ceil(ceil(F / 2) / 2)
        rows, row t valid when frame 4t is
    conformer layers: half-step FFN, local self-attention, light conv (causal), half-step FFN,
        RMSNorm; then every conf_reduction_factor-th row
    embed_audio: a soft-token RMSNorm (weight), projection, weightless RMSNorm -> n rows
    the run: audio_soft_tokens_per_image (188) rows, the clip's n valid ones then the embedding
        of the last audio vocabulary id (`embed_audio`'s hard-token path) for the rest
    prompt: each <audio_soft_token> becomes, in the text (HF's processor replaces it there, so
        the newlines merge with their neighbours'), "\\n\\n<start_of_audio>" + <audio_soft_token>
        x 188 + "<end_of_audio>\\n\\n"

The tower (subsampling, conformer, `embed_audio`) is multimodal/gemma3n_audio_tower.py.

A clip is encoded as transformers encodes it alone: its subsampling sees its own frames and
zeros after them. (transformers' processor pads a prompt's clips to the longest, and the
subsampling convolutions read a few frames of that padding, so the last valid rows of a shorter
clip batched with a longer one differ from the clip alone; such padded features handed over
processed give transformers' batched rows.) Clips are cut to the extractor's max_length (30 s).
`transcription_prompt` is vLLM's fixed request for Gemma 3n. Refused by name: a clip with more
rows than audio_soft_tokens_per_image, subsampling settings other than two convolutions, a
transcription `prompt` or a task other than "transcribe" / "translate".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from paged_engine.multimodal.audio import AudioProcessor, Loaded
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import run_starts

# the languages OpenAI's transcription API lists (vLLM's table): ISO 639-1 code -> name
LANGUAGES = {
    "af": "Afrikaans", "ar": "Arabic", "hy": "Armenian", "az": "Azerbaijani",
    "be": "Belarusian", "bs": "Bosnian", "bg": "Bulgarian", "ca": "Catalan", "zh": "Chinese",
    "hr": "Croatian", "cs": "Czech", "da": "Danish", "nl": "Dutch", "en": "English",
    "et": "Estonian", "fi": "Finnish", "fr": "French", "gl": "Galician", "de": "German",
    "el": "Greek", "he": "Hebrew", "hi": "Hindi", "hu": "Hungarian", "is": "Icelandic",
    "id": "Indonesian", "it": "Italian", "ja": "Japanese", "kn": "Kannada", "kk": "Kazakh",
    "ko": "Korean", "lv": "Latvian", "lt": "Lithuanian", "mk": "Macedonian", "ms": "Malay",
    "mr": "Marathi", "mi": "Maori", "ne": "Nepali", "no": "Norwegian", "fa": "Persian",
    "pl": "Polish", "pt": "Portuguese", "ro": "Romanian", "ru": "Russian", "sr": "Serbian",
    "sk": "Slovak", "sl": "Slovenian", "es": "Spanish", "sw": "Swahili", "sv": "Swedish",
    "tl": "Tagalog", "ta": "Tamil", "th": "Thai", "tr": "Turkish", "uk": "Ukrainian",
    "ur": "Urdu", "vi": "Vietnamese", "cy": "Welsh",
}  # fmt: skip


def strides(audio: Any) -> list[tuple[int, int]]:
    return [(int(t), int(f)) for t, f in audio.sscp_conv_stride_size]


def check_config(config: Any) -> None:
    """ValueError naming the audio_config field this tower does not run."""
    audio = config.audio_config
    for field in ("sscp_conv_channel_size", "sscp_conv_kernel_size", "sscp_conv_stride_size"):
        if len(getattr(audio, field)) != 2:
            raise ValueError(
                f"audio_config.{field}={getattr(audio, field)}: two convolutions are supported"
            )


def subsampled(frames: int, audio: Any) -> int:
    """Rows of the subsampling over `frames` feature frames (each conv pads kernel - 1 after)."""
    for s, _ in strides(audio):  # (frames + kernel - 1 - kernel) // s + 1
        frames = (frames - 1) // s + 1
    return frames


def valid_rows(frames: int, valid: int, audio: Any, reduction: int) -> int:
    """The clip's rows that reach the text model: row t (of the reduced rows) is valid when
    feature frame t * reduction * (time strides) lies inside the clip."""
    stride = int(np.prod([s for s, _ in strides(audio)]))
    rows = subsampled(frames, audio)
    kept = range(0, rows, reduction)
    return sum(1 for t in kept if min(t * stride, frames - 1) < valid)


class Gemma3nAudio(AudioProcessor):
    """The host side: a clip's frames, a fixed run spliced into the prompt's text."""

    def __init__(self, path: Any, config: Any, tokenizer: Any, limit: int | None = None) -> None:
        check_config(config)
        if tokenizer is None:
            raise ValueError("the tokenizer is needed for Gemma 3n's audio prompts")
        super().__init__(path, config, tokenizer, limit)
        self.run = int(config.audio_soft_tokens_per_image)
        self.mels = int(config.audio_config.input_feat_size)
        boa, soft, eoa = tokenizer.convert_ids_to_tokens(
            [int(config.boa_token_id), self.placeholder, int(config.eoa_token_id)]
        )
        self.clip_text = f"\n\n{boa}{soft * self.run}{eoa}\n\n"

    def placeholder_id(self) -> int:
        return int(self.config.audio_token_id)

    def load(self, wave: np.ndarray, what: str) -> Loaded:
        out = self.extract([wave], what)  # (as a batch: HF's processor calls it so)
        features = out["input_features"][0].float().contiguous()  # [F, mels], all frames
        valid = int(out["input_features_mask"][0].sum())
        audio = self.config.audio_config
        n = valid_rows(features.shape[0], valid, audio, int(audio.conf_reduction_factor))
        if n < 1:
            raise ValueError(f"{what}: the clip is too short ({wave.size} samples)")
        if n > self.run:
            raise ValueError(
                f"{what}: the clip gives {n} audio rows, over the model's "
                f"audio_soft_tokens_per_image={self.run} (cut it shorter)"
            )
        return features, (valid,), self.run

    def transcription_prompt(self, language: str | None, task: str, prompt: str) -> dict:
        """vLLM's request (Gemma 3n transcribes free-form; vLLM fixes the wording): one user
        turn "Transcribe this audio[ into <language>]: <audio_soft_token>", or for "translate"
        "Translate this audio[ from <language>]: ..." (vLLM names no target language unless the
        client gives one, which this endpoint does not); a code outside LANGUAGES is left
        unnamed, as vLLM leaves it."""
        if task not in ("transcribe", "translate"):
            raise ValueError(f"task: {task!r} is neither 'transcribe' nor 'translate'")
        if prompt:
            raise ValueError("prompt: Gemma 3n's transcription request takes no prompt")
        name = LANGUAGES.get(language or "", "")
        ask = "Transcribe" if task == "transcribe" else "Translate"
        where = "" if not name else f" into {name}" if task == "transcribe" else f" from {name}"
        soft = self.tokenizer.convert_ids_to_tokens(self.placeholder)
        text = f"<start_of_turn>user\n{ask} this audio{where}: {soft}<end_of_turn>\n"
        return {"prompt": text + "<start_of_turn>model\n"}

    def place_runs(
        self, ids: list[int], lengths: list[int]
    ) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """Each lone <audio_soft_token> replaced in the prompt's text by the clip's run (a
        prompt holding every clip's run already stays as it is)."""
        tok, clips = self.placeholder, len(lengths)  # (every clip's run is self.run long)
        starts = run_starts(ids, tok)
        runs = []
        for s in starts:
            k = s
            while k < len(ids) and ids[k] == tok:
                k += 1
            runs.append(k - s)
        if len(starts) == clips and all(k == self.run for k in runs):
            return ids, starts, []  # expanded already (HF's processor's ids)
        if len(starts) != clips or any(k != 1 for k in runs):
            found = ", ".join(str(k) for k in runs) or "none"
            raise ValueError(
                f"multi_modal_data['audio'] has {clips} audio(s) but the prompt has "
                f"{len(starts)} audio placeholder(s) (token id {tok}; runs of {found} tokens): "
                "put one audio token per clip where it belongs"
            )

        def text(part: list[int]) -> str:
            return self.tokenizer.decode(
                part, skip_special_tokens=False, clean_up_tokenization_spaces=False
            )

        pieces, last = [], 0
        for s in starts:
            pieces += [text(ids[last:s]), self.clip_text]
            last = s + 1
        pieces.append(text(ids[last:]))
        out = self.tokenizer.encode("".join(pieces), add_special_tokens=False)
        new = run_starts(out, tok)
        if len(new) != clips:
            raise ValueError("multi_modal_data['audio']: the prompt's text splits the audio run")
        # growth at each clip, counted to just after its run (the newline merges after it are
        # not: nothing else is placed in a Gemma 3n prompt)
        added, before = [], 0
        for s, at in zip(starts, new, strict=True):
            grown = (at + self.run) - (s + 1) - before
            added.append((s, grown))
            before += grown
        return out, new, added

    def _placed(self, token_ids: list[int], items: list[ImageInput]) -> tuple[ImageInput, ...]:
        """Clips processed ahead: on their runs, each holding this model's frames for it."""
        for m in items:
            self._check_placed(m)
        return super()._placed(token_ids, items)

    def _check_placed(self, m: ImageInput) -> None:
        f, size = m.pixel_values, m.image_size
        ok = f is not None and size is not None and len(size) == 1 and m.length == self.run
        if ok:
            assert f is not None and size is not None
            audio = self.config.audio_config
            reduction = int(audio.conf_reduction_factor)
            ok = (
                f.dim() == 2
                and f.shape[1] == self.mels
                and 0 < size[0] <= f.shape[0]
                and 0 < valid_rows(f.shape[0], size[0], audio, reduction) <= self.run
            )
        if not ok:
            raise ValueError(
                "multi_modal_data['audio']: a processed clip's features do not match its "
                "placeholder run for this model"
            )
