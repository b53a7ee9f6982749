"""Audio prompts on the host: clips -> features, each audio token -> its run of placeholders.

    prompt (Qwen2-Audio):  ... <|audio_bos|><|AUDIO|><|audio_eos|> ...
    ->                     ... <|audio_bos|><|AUDIO|> x n<|audio_eos|> ...
    an `ImageInput` (modality "audio") at the run: the clip's features (the checkpoint's feature
    extractor, e.g. Whisper's log-mel spectrogram), n = the encoder's output rows

vLLM's prompt form: `{"prompt": ..., "multi_modal_data": {"audio": clip or [clips]}}`, a clip
being (waveform, sampling_rate) or a waveform at the model's rate (multimodal/audio_io.py). Each
audio token of the prompt stands for one clip, in order; a run already expanded to the clip's
length (an earlier output's ids, a client's HF processor) is taken as it is. Items that are
`ImageInput`s already (this class's output, from a server's request thread) are checked
against the prompt and taken as they are.

A family subclasses `AudioProcessor` with its placeholder token and `load` (its feature
extractor's output and the run length the encoder gives for it); multimodal/audio_archs.py
names each family's class and encoder. On the worker the features go to the family's audio
encoder (worker/image_embeds.py: the same encoder cache and splicing as images).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paged_engine.multimodal.audio_io import audio_item
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import digest, expand_runs
from paged_engine.multimodal.processor_files import check_processor_files

Loaded = tuple[torch.Tensor, tuple[int, ...] | None, int]  # (features, size, placeholders)
_FILES = ("preprocessor_config.json", "processor_config.json")


def feature_extractor(path: Path) -> Any:
    """transformers' feature extractor saved with the checkpoint (preprocessor_config.json, or
    transformers 5's processor_config.json); ValueError when there is none."""
    from transformers import AutoFeatureExtractor

    if not any((Path(path) / f).exists() for f in _FILES):
        raise ValueError(
            f"{path} has neither preprocessor_config.json nor processor_config.json: its audio "
            "feature extractor is needed to run audio (pass limit_mm_per_prompt={'audio': 0} "
            "to serve its text model only)"
        )
    config = Path(path) / "processor_config.json"
    if config.exists():  # transformers 5 nests the extractor's settings in the processor's
        saved = json.loads(config.read_text()).get("feature_extractor")
        if isinstance(saved, dict) and saved.get("feature_extractor_type"):
            import transformers

            cls = getattr(transformers, saved["feature_extractor_type"])
            return cls(**{k: v for k, v in saved.items() if k != "feature_extractor_type"})
    return AutoFeatureExtractor.from_pretrained(path)


class AudioProcessor:
    """The host side of a checkpoint's audio: `process` places a prompt's clips."""

    def __init__(self, path: Path, config: Any, tokenizer: Any, limit: int | None = None) -> None:
        self.path = Path(path)
        check_processor_files(self.path)  # broken processor files refused at engine start
        self.config = config
        self.tokenizer = tokenizer
        self.limit = limit  # clips per prompt (limit_mm_per_prompt["audio"]); None: any
        self.extractor = self.load_extractor()
        self.sampling_rate = int(self.extractor.sampling_rate)
        self.placeholder = self.placeholder_id()

    # ---- what a family defines --------------------------------------------------------------
    def load_extractor(self) -> Any:
        """The checkpoint's feature extractor (has `sampling_rate`); a family whose
        transformers extractor cannot be built here (torchaudio) reads its settings itself."""
        return feature_extractor(self.path)

    def placeholder_id(self) -> int:
        """The token a prompt writes for a clip (and its run repeats)."""
        raise NotImplementedError

    def load(self, wave: np.ndarray, what: str) -> Loaded:
        """One clip (mono float32 at `sampling_rate`) -> (features, size, placeholders)."""
        raise NotImplementedError

    def load_clips(self, waves: list[np.ndarray], whats: list[str]) -> list[Loaded]:
        """A prompt's clips, each `load`ed alone; a family whose processor extracts a prompt's
        clips together (padded to the longest: Qwen3-Omni) overrides this."""
        return [self.load(w, what) for w, what in zip(waves, whats, strict=True)]

    def place_runs(
        self, token_ids: list[int], lengths: list[int]
    ) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """(the prompt with each clip's run, each run's start, (where, tokens added) of each):
        here each lone placeholder becomes a run of its clip's length (a run that long stays);
        a family whose runs come with more tokens (Gemma's bounds, text around them) overrides
        this."""
        return expand_runs(token_ids, self.placeholder, lengths, "audio")

    def beside_images(self, clips: tuple, with_images: bool) -> tuple:
        """A prompt's placed clips once its images are placed too (`with_images`: it has any);
        as they are here. Phi-4-multimodal projects a clip apart beside images."""
        return clips

    def transcription_prompt(self, language: str | None, task: str, prompt: str) -> dict:
        """The engine prompt (a dict without the audio) that asks this model to transcribe
        (task "transcribe") or translate into English ("translate") one clip in `language`
        (an ISO 639-1 code; None: the model detects it), `prompt` the client's context text;
        ValueError naming the argument a model does not take. Models that do not transcribe
        refuse it (/v1/audio/transcriptions answers 400)."""
        raise ValueError(
            f"model: {self.config.architectures[0]} does not serve transcriptions (no "
            "transcription prompt is defined for it)"
        )

    def request_prompt(self, prompt: Any) -> Any:
        """A request's prompt as the input processor takes it (Whisper: vLLM's encoder /
        decoder prompt form into one dict); as it is for a decoder-only model."""
        return prompt

    # ---- shared ---------------------------------------------------------------------------------
    def positions(self, num_tokens: int, items: tuple) -> Any:
        """M-RoPE positions of a prompt (None: the decoder's positions are 1-D)."""
        return None

    def extract(self, wave: np.ndarray, what: str, **kwargs: Any) -> Any:
        """The feature extractor on one clip, its failures as ValueErrors naming `what`."""
        try:
            return self.extractor(
                wave, sampling_rate=self.sampling_rate, return_tensors="pt", **kwargs
            )
        except Exception as e:
            raise ValueError(f"{what}: the audio could not be processed: {e}") from e

    def process(
        self, token_ids: list[int], data: Any, kwargs: Any = None
    ) -> tuple[list[int], tuple[ImageInput, ...], list[tuple[int, int]]]:
        """(token ids with each clip's run, the clips, (where, tokens added) of each run);
        ValueError naming multi_modal_data['audio'] for anything wrong."""
        if kwargs:
            name = next(iter(kwargs))
            raise ValueError(
                f"mm_processor_kwargs[{name!r}]: audio takes no processor kwargs (this model's "
                "feature extractor runs with the checkpoint's settings)"
            )
        items = data if isinstance(data, list) else [data]
        if not items:
            raise ValueError("multi_modal_data['audio'] is empty: give a clip or leave it out")
        if self.limit is not None and len(items) > self.limit:
            raise ValueError(
                f"multi_modal_data['audio'] has {len(items)} clips, over "
                f"limit_mm_per_prompt['audio']={self.limit}"
            )
        if all(isinstance(m, ImageInput) for m in items):
            return token_ids, self._placed(token_ids, items), []
        whats = [f"multi_modal_data['audio'][{i}]" for i in range(len(items))]
        waves = [audio_item(m, self.sampling_rate, w) for m, w in zip(items, whats, strict=True)]
        loaded = self.load_clips(waves, whats)
        ids, starts, added = self.place_runs(token_ids, [n for *_, n in loaded])
        out = tuple(
            ImageInput(f, at, n, digest(f, size), size, modality="audio")
            for (f, size, n), at in zip(loaded, starts, strict=True)
        )
        return ids, out, added

    def _placed(self, token_ids: list[int], items: list[ImageInput]) -> tuple[ImageInput, ...]:
        """Clips processed ahead: each must sit on a whole run of this model's placeholder, with
        the features it was processed with (their hash: features of another length would reach
        the encoder and fail the step there, not the request)."""
        for m in items:
            if m.pixel_values is None or m.mm_hash != digest(m.pixel_values, m.image_size):
                raise ValueError(
                    "multi_modal_data['audio']: a processed clip's features are not the ones it "
                    "was processed with (its hash differs): pass the clip itself"
                )
            run = token_ids[m.offset : m.end]
            before = token_ids[m.offset - 1] if m.offset else None
            after = token_ids[m.end] if m.end < len(token_ids) else None
            if (
                m.modality != "audio"
                or m.length < 1
                or len(run) != m.length
                or any(t != self.placeholder for t in run)
                or self.placeholder in (before, after)
            ):
                raise ValueError(
                    "multi_modal_data['audio']: a processed clip does not match the prompt's "
                    f"placeholder run at position {m.offset}"
                )
        return tuple(items)
