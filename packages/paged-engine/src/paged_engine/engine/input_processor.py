"""Turns what a caller submits (a prompt, its parameters) into a validated `Request`.

Everything that can be wrong with a request is caught here, before the scheduler sees it, with a
`ValueError` that names the parameter: the engine keeps serving everyone else.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

from paged_engine.config import EngineConfig
from paged_engine.core.request import Request
from paged_engine.engine.prompt_embeds import prompt_embeds_inputs
from paged_engine.multimodal.archs import IMAGE_ARCHS, VIDEO_MODELS
from paged_engine.multimodal.audio import AudioProcessor
from paged_engine.multimodal.audio_archs import AUDIO_ARCHS
from paged_engine.multimodal.inputs import is_embeds_prompt, shift_offsets
from paged_engine.multimodal.processor import ImageProcessor
from paged_engine.multimodal.qwen_video import VideoProcessor
from paged_engine.pooling import check_prompt_len, encode_truncated, is_pooling, truncated
from paged_engine.sample.beam_search import BeamSearchState
from paged_engine.sample.logits_processor import load_logits_processors
from paged_engine.sampling_params import BeamSearchParams, SamplingParams, whole_vocabulary
from paged_engine.structured_output.manager import StructuredOutputManager
from paged_engine.structured_output.request_constraint import RequestConstraint
from paged_engine.structured_output.thinking_budget import ThinkingBudget
from paged_engine.unicode_text import check_text

# mm_processor_kwargs only videos take (the image processor is not handed them)
VIDEO_ONLY = ("fps", "do_sample_frames")


def check_token_ids(ids: list | tuple, vocab_size: int, what: str) -> list[int]:
    """`ids` as a list of ints, or ValueError naming `what` unless each is an integer (numpy's
    too: `list(array)` holds them) in [0, vocab_size). Runs on every prompt: plain ints take
    the fast path (an ABC isinstance per id made a 128k-id prompt ~8x slower to check)."""
    if not all(type(t) is int for t in ids):  # numpy's integers, int subclasses, bad values
        bad = [t for t in ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
        if bad:
            raise ValueError(f"{what} token ids must be ints in [0, {vocab_size}); got {bad[:5]}")
        ids = [int(t) for t in ids]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} token ids must be ints in [0, {vocab_size}); got {bad[:5]}")
    return list(ids)


@dataclass(slots=True)
class ProcessedRequest:
    request: Request  # for the engine core
    prompt_text: str | None  # for the outputs
    num_returned: int  # outputs returned (n)
    # beam search: logprobs of each finished beam's tokens (None: none; -1: every candidate,
    # as LLM.beam_search returns them; k: the top k candidates and the chosen token)
    beam_logprobs: int | None = None
    # a text encoder-decoder's (encoder prompt text, its ids) for the outputs, else None
    encoder_prompt: tuple[str | None, list[int]] | None = None


class InputProcessor:
    def __init__(
        self,
        tokenizer,
        config: EngineConfig,
        *,
        vocab_size: int,
        eos_token_ids: set[int],
        structured: StructuredOutputManager | None = None,
        default_params: dict | None = None,
        images: ImageProcessor | None = None,
        videos: VideoProcessor | None = None,
        audios: AudioProcessor | None = None,
        embeds_width: int | None = None,
        think_ids: tuple[list[int], list[int]] | None = None,
        encoder_prompts: Any = None,
        lower_case: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        # sentence-transformers' do_lower_case: text prompts are tokenized lowercased
        self.lower_case = lower_case
        self.default_params = default_params or {}  # params=None: SamplingParams(**these)
        self.config = config
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.structured = structured
        self.images = images  # a checkpoint whose images run (multimodal/), else None
        # a checkpoint whose videos run (multimodal/video_archs.py), else None
        self.videos = videos
        self.audios = audios  # a checkpoint whose audio runs (multimodal/audio_archs.py)
        # BART / mBART: prompts split into decoder and encoder (engine/encoder_prompt.py)
        self.encoder_prompts = encoder_prompts
        # enable_prompt_embeds: the token embedding's width (engine/prompt_embeds.py), else None
        self.embeds_width = embeds_width
        # reasoning_config's (opener ids, closer ids) for thinking_token_budget, else None
        self.think_ids = think_ids
        # custom logits processors' classes: each checks a request's params when it arrives
        self.logits_processors = load_logits_processors(config.logits_processors or [])

    def make_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams | BeamSearchParams | None,
        arrival_time: float | None,
    ) -> ProcessedRequest:
        params = SamplingParams(**self.default_params) if params is None else params
        num_returned = None
        beam_logprobs = -1 if isinstance(params, BeamSearchParams) else None
        if isinstance(params, SamplingParams) and params.use_beam_search:
            num_returned = params.n  # the n best of beam_width = max(n, best_of) beams
            beam_logprobs = params.logprobs
            params = params.to_beam_search_params()
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise ValueError(f"params must be SamplingParams or BeamSearchParams, got {params!r}")
        if self.audios is not None:  # Whisper: its encoder / decoder prompt form
            prompt = self.audios.request_prompt(prompt)
        split = None  # BART, Florence-2, Donut: the prompt split (engine/encoder_prompt.py)
        if self.encoder_prompts is not None:  # (truncate_prompt_tokens cuts the encoder prompt)
            keep = getattr(params, "truncate_prompt_tokens", None)
            split = self.encoder_prompts.split(prompt, keep)
            prompt = split.decoder
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        mm_inputs: tuple = ()
        if isinstance(prompt, dict) and "prompt_embeds" in prompt:
            text, token_ids, mm_inputs = prompt.get("prompt"), *self._prompt_embeds(prompt, params)
        else:
            # A text prompt of a text-only request is truncated by the tokenizer (vLLM's
            # renderer): its special tokens stay; token ids are sliced below.
            plain = split is None and not mm_data and self.audios is None
            keep = getattr(params, "truncate_prompt_tokens", None) if plain else None
            text, token_ids = self._tokenize_prompt(prompt, keep, not is_pooling(params))
        if split is not None:  # what the decoder cross-attends to
            mm_inputs = split.items
        if mm_data and not mm_inputs:
            kwargs = prompt.get("mm_processor_kwargs") if isinstance(prompt, dict) else None
            token_ids, mm_inputs = self.multimodal(token_ids, mm_data, kwargs)
        if not mm_inputs and getattr(getattr(self.images, "layout", None), "needs_image", False):
            raise ValueError(  # PaliGemma (multimodal/paligemma_layout.py)
                "multi_modal_data: this model's prompts need an image (HF's processor takes "
                "none without one; a text-only prompt would attend both ways: not supported)"
            )
        max_len = self.config.max_model_len
        assert max_len is not None
        keep = getattr(params, "truncate_prompt_tokens", None)  # (BeamSearchParams: none)
        pooling = is_pooling(params)
        side = getattr(self.tokenizer, "truncation_side", "left")  # (LLMEngine sets it)
        cut = truncated(token_ids, keep, max_len, generate=not pooling, side=side)
        if cut is not token_ids:  # the text no longer fits
            if is_embeds_prompt(mm_inputs):
                raise ValueError(
                    "truncate_prompt_tokens would cut a prompt given as prompt_embeds: send "
                    "the rows to keep"
                )
            if split is not None:
                raise ValueError(
                    f"truncate_prompt_tokens={keep} would cut the decoder prompt "
                    f"({len(token_ids)} tokens, its start token included): for an "
                    "encoder-decoder model it cuts the encoder prompt only; send a shorter "
                    "decoder prompt or a larger truncate_prompt_tokens"
                )
            if mm_inputs:
                raise ValueError(
                    "truncate_prompt_tokens would cut a prompt with images (their placeholders "
                    "are whole or absent): give a shorter text or no truncation"
                )
            text, token_ids = None, cut
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt must be a non-empty str, got {salt!r}")
        check_prompt_len(len(token_ids), "tokens", max_len, pooling)
        self._check_params(params)
        if isinstance(params, SamplingParams) and -1 in (params.logprobs, params.prompt_logprobs):
            params = whole_vocabulary(params, self.vocab_size)
        eos = frozenset() if params.ignore_eos else frozenset(self.eos_token_ids)
        if isinstance(params, BeamSearchParams):
            beam = BeamSearchState(
                beam_width=params.beam_width,
                length_penalty=params.length_penalty,
                early_stopping=params.early_stopping,
                max_tokens=params.max_tokens if params.max_tokens is not None else max_len,
                eos_token_ids=set(eos),
            )
            num_returned = min(num_returned or params.beam_width, params.beam_width)
            # Beams finish through the search itself: no token-level stop rule applies.
            req = Request(request_id, token_ids, params, beam=beam, mm_inputs=mm_inputs)
        else:
            num_returned = params.n
            req = Request(
                request_id,
                token_ids,
                params,
                eos_token_ids=eos,
                stop_token_ids=frozenset(params.stop_token_ids),
                min_tokens=params.min_tokens,
                constraint=self._constraint(params, token_ids),
                mm_inputs=mm_inputs,
            )
        if arrival_time is not None:
            req.arrival_time = arrival_time
        req.cache_salt = salt
        if mm_inputs and not is_embeds_prompt(mm_inputs) and split is None:
            positions = self.images or self.videos or self.audios
            if getattr(self.videos, "places_images", False):  # Omni's table (omni_video.py)
                positions = self.videos
            assert positions is not None
            placed = mm_inputs
            if positions is not self.audios and not getattr(positions, "places_audio", False):
                placed = tuple(m for m in mm_inputs if m.modality != "audio")
            req.mrope = positions.positions(len(token_ids), placed)
        encoder_prompt = None
        if split is not None:
            encoder_prompt = (split.encoder_prompt, split.encoder_prompt_token_ids)
        return ProcessedRequest(req, text, num_returned, beam_logprobs, encoder_prompt)

    def _tokenize_prompt(
        self, prompt: str | list[int] | dict, keep: int | None = None, generate: bool = False
    ) -> tuple[str | None, list[int]]:
        """The prompt's text and ids; a text prompt is encoded with `keep` (its
        truncate_prompt_tokens) through pooling.encode_truncated."""
        media = isinstance(prompt, dict) and bool(prompt.get("multi_modal_data"))
        if isinstance(prompt, dict):
            # As in vLLM: token ids win when both are given; the text is kept for the output.
            text = prompt.get("prompt")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise ValueError(
                        f"prompt_token_ids must be a list of token ids, got {type(ids).__name__}"
                    )
                _, token_ids = self._tokenize_prompt(list(ids))
                return (text if isinstance(text, str) else None), token_ids
            if "prompt" not in prompt:
                raise ValueError(
                    f"prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}"
                )
            if text == "" and prompt.get("multi_modal_data"):  # an image alone (CLIP embeddings)
                return text, self.tokenizer.encode(text)
            prompt = text
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            check_text(prompt, "prompt")  # the tokenizer would raise a TypeError
            max_len = self.config.max_model_len
            assert max_len is not None
            text = prompt.lower() if self.lower_case else prompt
            ids = encode_truncated(self.tokenizer, text, keep, max_len, generate=generate)
            # A tokenizer larger than the model (added tokens past config.json's vocab_size):
            # such an id has no embedding row. (Media placeholders are the media path's.)
            if not media and ids and max(ids) >= self.vocab_size:
                bad = sorted({t for t in ids if t >= self.vocab_size})
                raise ValueError(
                    f"the prompt holds token(s) {self.tokenizer.convert_ids_to_tokens(bad[:5])} "
                    f"with ids {bad[:5]} past the model's vocabulary (vocab_size "
                    f"{self.vocab_size} in config.json): the tokenizer has tokens the model "
                    "cannot embed"
                )
            return prompt, ids
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise ValueError("prompt must not be empty (got no token ids)")
            return None, check_token_ids(prompt, self.vocab_size, "prompt")
        raise ValueError(
            f"prompt must be a str or a list of token ids, got {type(prompt).__name__}"
        )

    def _prompt_embeds(self, prompt: dict, params: Any) -> tuple[list[int], tuple]:
        """vLLM's EmbedsPrompt: the placeholder ids and the rows (engine/prompt_embeds.py)."""
        if self.embeds_width is None:
            raise ValueError(
                "prompt_embeds needs an engine started with enable_prompt_embeds=True "
                "(paged-server --enable-prompt-embeds)"
            )
        both = sorted({"prompt_token_ids", "multi_modal_data"} & set(prompt))
        if both:
            raise ValueError(f"prompt_embeds comes alone: drop {both} from the prompt dict")
        text = prompt.get("prompt")  # vLLM's: the rows' text, for the outputs only
        if text is not None and not isinstance(text, str):
            raise ValueError(f"prompt (beside prompt_embeds) must be a str, got {text!r:.80}")
        if getattr(params, "prompt_logprobs", None) is not None:
            raise ValueError("prompt_logprobs: a prompt given as prompt_embeds has no tokens")
        assert self.config.max_model_len is not None
        return prompt_embeds_inputs(
            prompt["prompt_embeds"],
            width=self.embeds_width,
            max_len=self.config.max_model_len,
            block_size=self.config.block_size,
            pooling=is_pooling(params),
        )

    def multimodal(
        self, token_ids: list[int], mm_data: Any, kwargs: Any = None
    ) -> tuple[list[int], tuple]:
        """vLLM's multi_modal_data: the prompt with each image's and video's placeholder run,
        and the items in prompt order; `kwargs`: the prompt's mm_processor_kwargs (a video
        takes fps, min_pixels and max_pixels of them)."""
        if not isinstance(mm_data, dict):
            raise ValueError(
                f"multi_modal_data must be a dict such as {{'image': image}}, got "
                f"{type(mm_data).__name__}"
            )
        other = sorted(str(k) for k in mm_data if k not in ("image", "video", "audio"))
        if other:
            raise ValueError(
                f"multi_modal_data[{other[0]!r}] is not supported (only 'image', 'video' and "
                "'audio')"
            )
        kw = kwargs if isinstance(kwargs, dict) else {}
        layout = getattr(self.images, "layout", None)
        tags = getattr(layout, "numbered_tags", None) or getattr(self.audios, "numbered_tags", None)
        if tags is not None:  # Phi4MMForCausalLM: "<|image_i|>" / "<|audio_i|>" -> placeholders
            token_ids = tags(token_ids, mm_data)
        if kw.get("use_audio_in_video") and hasattr(self.videos, "audio_in_video"):
            return self.videos.audio_in_video(self, token_ids, mm_data, kw)  # (Qwen-Omni)
        images: tuple = ()
        if "image" in mm_data:  # (a bad mm_processor_kwargs: the image processor names it)
            image_kw = {k: v for k, v in kw.items() if k not in VIDEO_ONLY} if kw else kwargs
            token_ids, images = self._images(token_ids, mm_data["image"], image_kw)
        if "audio" in mm_data:  # an image after a clip's run moves with it
            alone = "image" not in mm_data and "video" not in mm_data
            token_ids, clips, added = self._audio(token_ids, mm_data["audio"], kw, alone)
            clips = self.audios.beside_images(clips, bool(images))  # (Phi-4-mm's projector)
            images = tuple(sorted([*shift_offsets(images, added), *clips], key=lambda m: m.offset))
        if "video" not in mm_data:
            return token_ids, images
        if self.videos is None:
            why = (
                "limit_mm_per_prompt={'video': 0}"
                if self.config.video_limit == 0
                else f"videos run on {VIDEO_MODELS} checkpoints"
            )
            raise ValueError(f"multi_modal_data['video']: this model takes no videos ({why})")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError(f"mm_processor_kwargs must be a dict, got {type(kwargs).__name__}")
        names = self.videos.kwargs_names
        video_kw = {k: v for k, v in kw.items() if k in names}
        rest = {k: v for k, v in kw.items() if k not in names}
        if rest and self.images is not None:
            self.images.processor_kwargs(rest)  # a name neither processor takes: ValueError
        elif rest:
            self.videos.check_kwargs(rest)  # names the first it does not take
        expanded, videos, added = self.videos.process(token_ids, mm_data["video"], video_kw)
        moved = shift_offsets(images, added)  # an image after a video's run moves with it
        return expanded, tuple(sorted([*moved, *videos], key=lambda m: m.offset))

    def _audio(
        self, token_ids: list[int], data: Any, kwargs: dict[str, Any], alone: bool
    ) -> tuple[list[int], tuple, list[tuple[int, int]]]:
        """The prompt with each clip's placeholder run, the clips and the runs' growth
        (multimodal/audio.py). Audio takes none of mm_processor_kwargs: with images or videos
        in the prompt their processors check them; with clips `alone`, the model's image or
        video processor does (a name none of them takes is a ValueError)."""
        if self.audios is None:
            why = (
                "limit_mm_per_prompt={'audio': 0} serves the text model only"
                if self.config.audio_limit == 0
                else f"audio runs on {', '.join(AUDIO_ARCHS)} checkpoints"
            )
            raise ValueError(f"multi_modal_data['audio']: this model takes no audio ({why})")
        if kwargs and alone:
            if self.images is not None:
                self.images.processor_kwargs(kwargs)
            elif self.videos is not None:
                self.videos.check_kwargs(kwargs)
            else:
                self.audios.process(token_ids, [], kwargs)  # names the kwarg audio does not take
        return self.audios.process(token_ids, data)

    def _images(
        self, token_ids: list[int], mm_data: Any, kwargs: Any = None
    ) -> tuple[list[int], tuple]:
        """The prompt with each image's placeholder run, and the images
        (multimodal/processor.py)."""
        if self.images is None:
            limit = self.config.image_limit
            why = (
                "limit_mm_per_prompt={'image': 0} serves the text model only"
                if limit == 0
                else "this model runs text only: images run on "
                f"{', '.join(IMAGE_ARCHS)} checkpoints (other vision-language checkpoints serve "
                "their language model)"
            )
            raise ValueError(f"multi_modal_data is not supported: {why}")
        token_ids, images = self.images.process(token_ids, mm_data, kwargs)
        budget = self.config.max_num_batched_tokens
        for m in images:  # a two-way image runs in one step (core/token_plan.py whole_images)
            if m.prefix_end and budget is not None and m.prefix_end > budget:
                raise ValueError(  # PaliGemma: the whole prompt attends both ways
                    f"multi_modal_data['image']: the prompt's {m.prefix_end} tokens attend to "
                    f"each other both ways, more than max_num_batched_tokens={budget}: one step "
                    "must hold them all (raise max_num_batched_tokens)"
                )
            if m.bidirectional and budget is not None and m.length > budget:
                raise ValueError(
                    f"multi_modal_data['image']: an image of {m.length} tokens is more than "
                    f"max_num_batched_tokens={budget}, and its tokens attend to each other "
                    "both ways, so one step must hold them all"
                )
        return token_ids, images

    def _constraint(
        self, params: SamplingParams, prompt_ids: list[int]
    ) -> RequestConstraint | None:
        """The request's grammar (compiling from now on), bad words and thinking budget, if it
        has any."""
        budget = params.thinking_token_budget
        if params.structured_outputs is None and not params.bad_words and budget is None:
            return None
        if self.structured is None:
            raise ValueError("structured_outputs / bad_words are not available in this engine")
        thinking = None
        if budget is not None:
            if self.think_ids is None:
                raise ValueError(
                    "thinking_token_budget needs the reasoning markers: start the engine with "
                    "reasoning_config={'think_start_str': '<think>', 'think_end_str': "
                    "'</think>'} (paged-server --reasoning-config, or a --reasoning-parser)"
                )
            thinking = ThinkingBudget(*self.think_ids, budget, prompt_ids)
        return self.structured.new_constraint(
            params.structured_outputs, self._bad_words_ids(params.bad_words or []), thinking
        )

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, alone and after a space (as vLLM: the same word starts
        with another token mid-sentence)."""
        out: list[list[int]] = []
        for word in words:
            for text in (word, " " + word.lstrip(" ")):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def _check_params(self, params: SamplingParams | BeamSearchParams) -> None:
        if isinstance(params, SamplingParams) and not is_pooling(params):
            for cls in self.logits_processors:
                cls.validate_params(params)  # ValueError refuses the request
        if isinstance(params, SamplingParams):
            cap = self.config.max_logprobs
            cap = self.vocab_size if cap == -1 else cap
            # max_logprobs bounds the top-k counts; logprob_token_ids (whose count logprobs
            # then holds) have their own bound, MAX_LOGPROB_TOKEN_IDS, checked with the params
            counts = ("logprobs", "prompt_logprobs")[1 if params.logprob_token_ids else 0 :]
            for name in counts:
                k = getattr(params, name)
                k = self.vocab_size if k == -1 else k
                if k is not None and k > cap:
                    raise ValueError(
                        f"{name}={getattr(params, name)} asks for {k} logprobs, over "
                        f"max_logprobs={self.config.max_logprobs} (-1 allows the vocabulary)"
                    )
            for name in ("logit_bias", "allowed_token_ids", "logprob_token_ids"):
                bad = [t for t in getattr(params, name) or () if t >= self.vocab_size]
                if bad:
                    raise ValueError(
                        f"{name} has token ids outside the vocabulary [0, {self.vocab_size}): "
                        f"{sorted(bad)[:5]}"
                    )
            width = max(params.n, params.best_of or params.n)
        else:
            width = params.beam_width
        limit = min(self.config.max_num_seqs, self.config.max_num_batched_tokens or width)
        if width > limit:
            raise ValueError(
                f"n/best_of/beam_width={width} exceeds what one step can run "
                f"(max_num_seqs={self.config.max_num_seqs}, max_num_batched_tokens="
                f"{self.config.max_num_batched_tokens})"
            )
