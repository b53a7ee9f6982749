"""A text encoder-decoder's prompt (BART, mBART: models/bart.py): vLLM 0.10's prompt forms split
into the decoder prompt the engine runs and the encoder prompt the decoder cross-attends to.

    "text" / [ids] / {"prompt": ...} / {"prompt_token_ids": ...}
        -> the encoder prompt; the decoder prompt is the default below
    {"encoder_prompt": <one of the above>, "decoder_prompt": <one of them, or None>}
        (vLLM's ExplicitEncoderDecoderPrompt; `zip_enc_dec_prompts` in paged_engine.inputs)

As vLLM's InputPreprocessor: text of either prompt is tokenized with the tokenizer's special
tokens (BART's <s> ... </s>); a missing or None decoder prompt is [bos_token_id]; a decoder
prompt not starting with config.decoder_start_token_id gets it prepended (for BART: [</s>, <s>]
by default, which is what transformers' generate runs with forced_bos_token_id). What HF's
generation_config adds beyond that (num_beams, no_repeat_ngram_size, min_length,
length_penalty, forced_bos_token_id) vLLM did not apply and neither does paged: pass them as
SamplingParams where they exist there (beam search, min_tokens).

The encoder prompt's ids become the sequence's one item (`ImageInput`, modality "text"):
pixel_values the ids [L] (int64), spanning every decoder position [0, max_position_embeddings)
so it reaches the worker with every sequence that holds it, its hash keying every prefix-cache
block (two encoder prompts never share decoder KV). The request's `prompt` / `prompt_token_ids`
are the decoder prompt's, as vLLM's RequestOutput gives them; its `encoder_prompt` (the text,
when given as text) and `encoder_prompt_token_ids` are the encoder prompt's, as vLLM 0.10 filled
them. `split` returns all of it as one `SplitPrompt` (Florence-2's and Donut's splitters too:
multimodal/florence2_prompt.py, multimodal/donut_prompt.py, built on `ImageEncoderPrompts`: the
image processor and the one-image checks), which the InputProcessor reads.

`truncate_prompt_tokens` (SamplingParams) cuts the encoder prompt to its last k ids (-1: to
max_position_embeddings), its text then dropped: what vLLM's left-truncating tokenizer did to
the one prompt a completion gives, and what paged's server does to it. The decoder prompt is not
cut (the InputProcessor refuses one longer than k by name).

Refused by name (ValueError): an empty encoder prompt, one longer than
config.max_position_embeddings, ids outside the vocabulary, multi_modal_data, prompt_embeds,
keys of a prompt dict that are not a prompt's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from paged_engine.engine.input_processor import check_token_ids
from paged_engine.models.bart import decoder_start_id
from paged_engine.multimodal.inputs import ImageInput, to_rgb
from paged_engine.multimodal.layouts import digest
from paged_engine.unicode_text import check_text

SINGLE_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
# an image encoder-decoder's encoder prompt dict (ImageEncoderPrompts)
IMAGE_PROMPT_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data", "cache_salt")


@dataclass(frozen=True, slots=True)
class SplitPrompt:
    """One prompt of an encoder-decoder, split (`split` of EncoderPrompts, Florence2Prompts,
    DonutPrompts)."""

    # the decoder prompt the engine runs: {"prompt": text or None, "prompt_token_ids": ids,
    # "cache_salt" where given}
    decoder: dict
    # what the decoder cross-attends to, the request's mm_inputs: BART's encoder ids (one
    # item); Florence-2's image then encoder text; Donut's image
    items: tuple[ImageInput, ...]
    # RequestOutput.encoder_prompt: the encoder prompt's text where given (and not cut)
    encoder_prompt: str | None
    # RequestOutput.encoder_prompt_token_ids: the ids (image rows as pad ids) the encoder reads
    encoder_prompt_token_ids: list[int]


class EncoderPrompts:
    """The host side of a text encoder-decoder's prompts (the InputProcessor's
    `encoder_prompts`)."""

    def __init__(self, tokenizer: Any, hf_config: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.start = decoder_start_id(hf_config)
        bos = getattr(tokenizer, "bos_token_id", None)
        self.bos = int(hf_config.bos_token_id if bos is None else bos)
        # encoder rows (its position table) and decoder positions: both the config's
        self.limit = int(hf_config.max_position_embeddings)

    def split(self, prompt: Any, truncate: int | None = None) -> SplitPrompt:
        """Any prompt form -> its SplitPrompt; `truncate`: the request's
        truncate_prompt_tokens."""
        enc, dec = split_encoder_decoder(prompt)
        enc_ids, salt = prompt_ids(enc, "encoder_prompt", self.tokenizer, self.vocab_size)
        if not enc_ids:
            raise ValueError("encoder_prompt must not be empty")
        enc_text = prompt_text(enc)
        if truncate is not None:
            keep = self.limit if truncate == -1 else truncate
            if len(enc_ids) > keep:
                enc_ids, enc_text = enc_ids[-keep:], None
        if len(enc_ids) > self.limit:
            raise ValueError(
                f"encoder_prompt is too long: {len(enc_ids)} tokens, but the encoder's position "
                f"table holds {self.limit} (config.max_position_embeddings)"
            )
        dec_ids, text, dec_salt = self.decoder_prompt(dec)
        salt = salt if dec_salt is None else dec_salt
        ids = torch.tensor(enc_ids, dtype=torch.int64)
        item = ImageInput(ids, 0, self.limit, digest(ids, None), modality="text")
        return SplitPrompt(decoder_fields(text, dec_ids, salt), (item,), enc_text, enc_ids)

    def decoder_prompt(self, dec: Any) -> tuple[list[int], str | None, Any]:
        """A decoder prompt (text, ids, their dict, or None: [bos]) -> (its ids with the start
        token in front, its text, its cache_salt)."""
        text: str | None = None
        salt = None
        if dec is None:
            ids = [self.bos]
        else:
            ids, salt = prompt_ids(dec, "decoder_prompt", self.tokenizer, self.vocab_size)
            text = prompt_text(dec)
        if not ids or ids[0] != self.start:
            ids = [self.start, *ids]
        return ids, text, salt


class ImageEncoderPrompts:
    """What the image encoder-decoders' splitters share (Florence2Prompts, DonutPrompts; each
    writes its own `split`): the checkpoint's image processor, read from `path` on first use;
    the checks on an encoder prompt (an image, a prompt dict's keys); its one image -> pixels.
    `family` names the model in refusals."""

    family = ""

    def __init__(self, tokenizer: Any, hf_config: Any, vocab_size: int, path: Path) -> None:
        self.tokenizer, self.path, self.config = tokenizer, Path(path), hf_config
        self.vocab_size = vocab_size
        self._processor: Any = None

    @property
    def processor(self) -> Any:
        if self._processor is None:
            from paged_engine.multimodal.torch_processors import image_processor

            self._processor = image_processor(self.path, self.config)
        return self._processor

    def check_encoder(self, enc: Any, where: str) -> None:
        """Refuse (ValueError) an encoder prompt without multi_modal_data (text alone) and a
        prompt dict's keys other than IMAGE_PROMPT_KEYS, naming the dict as `where`."""
        if not isinstance(enc, dict) or "multi_modal_data" not in enc:
            raise ValueError(
                f"multi_modal_data: {self.family} prompts need an image ({{'prompt': ..., "
                "'multi_modal_data': {'image': image}}); text-only prompts are not supported"
            )
        refused = sorted(set(enc) - set(IMAGE_PROMPT_KEYS))
        if refused:
            raise ValueError(
                f"{where}: {refused[0]!r} is not supported for {self.family} (a prompt dict "
                f"takes {list(IMAGE_PROMPT_KEYS)})"
            )

    def pixels(self, data: Any) -> torch.Tensor:
        """multi_modal_data {"image": one image (a PIL image or a uint8 numpy array, as
        multimodal/processor.py's `as_image` takes it), or a list of one} -> the image
        processor's pixels [3, H, W] (float32); other forms refused by name (vLLM's limit of
        one image)."""
        if not isinstance(data, dict) or set(data) != {"image"}:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(
                f"multi_modal_data must be {{'image': image}} for {self.family}, got {got}"
            )
        image = data["image"]
        if isinstance(image, (list, tuple)):
            if len(image) != 1:
                raise ValueError(
                    f"multi_modal_data['image'] has {len(image)} images: {self.family} takes "
                    "one image a prompt (as vLLM)"
                )
            image = image[0]
        from paged_engine.multimodal.processor import as_image

        image = as_image(image, "multi_modal_data['image']")
        try:
            out = self.processor(images=[to_rgb(image)], return_tensors="pt")
        except ValueError as e:  # e.g. a 1 x 10000 strip thumbnailed to 0 rows
            raise ValueError(
                f"multi_modal_data['image'] ({image.size[0]}x{image.size[1]} pixels): "
                f"{self.family}'s image processor cannot take it: {e}"
            ) from None
        return out["pixel_values"][0].float().contiguous()  # [3, H, W]


def prompt_ids(p: Any, what: str, tokenizer: Any, vocab_size: int) -> tuple[list[int], Any]:
    """One singleton prompt (text, token ids, or their {"prompt" / "prompt_token_ids",
    "cache_salt"} dict) -> (its ids, its cache_salt or None). Text is tokenized with the
    tokenizer's special tokens (an empty text: no ids); ids must lie in [0, vocab_size); other
    keys and forms are refused by name (ValueError naming `what`)."""
    salt = None
    if isinstance(p, dict):
        refused = sorted(set(p) - set(SINGLE_KEYS))
        if refused:
            raise ValueError(
                f"{what}: {refused[0]!r} is not supported for text encoder-decoder models "
                f"(a prompt dict takes {list(SINGLE_KEYS)})"
            )
        salt = p.get("cache_salt")
        if "prompt_token_ids" in p:
            p = p["prompt_token_ids"]
            if not isinstance(p, (list, tuple)):  # (a str here is not text to tokenize)
                raise ValueError(
                    f"{what}: prompt_token_ids must be a list of token ids, got {type(p).__name__}"
                )
        elif "prompt" in p:
            p = p["prompt"]
        else:
            raise ValueError(f"{what} needs 'prompt' or 'prompt_token_ids', got {sorted(p)}")
    if isinstance(p, str):
        if not p:  # (an empty decoder prompt: the start token alone)
            return [], salt
        check_text(p, what)
        return list(tokenizer.encode(p)), salt
    if isinstance(p, (list, tuple)):
        return check_token_ids(p, vocab_size, what), salt
    raise ValueError(f"{what} must be a str, a list of token ids or a dict, got {type(p).__name__}")


def decoder_fields(text: str | None, ids: list[int], salt: Any) -> dict:
    """SplitPrompt.decoder: the decoder prompt as the InputProcessor takes a prompt dict."""
    fields: dict = {"prompt": text, "prompt_token_ids": ids}
    if salt is not None:
        fields["cache_salt"] = salt
    return fields


def split_encoder_decoder(prompt: Any) -> tuple[Any, Any]:
    """Any prompt form -> (its encoder prompt, its decoder prompt or None): an
    {"encoder_prompt", "decoder_prompt"} dict's two (other keys refused by name), else the
    prompt itself as the encoder prompt and no decoder prompt."""
    if not (isinstance(prompt, dict) and "encoder_prompt" in prompt):
        return prompt, None
    unknown = sorted(set(prompt) - {"encoder_prompt", "decoder_prompt"})
    if unknown:
        raise ValueError(
            f"an encoder / decoder prompt takes 'encoder_prompt' and 'decoder_prompt', "
            f"got {unknown}"
        )
    return prompt["encoder_prompt"], prompt.get("decoder_prompt")


def prompt_text(p: Any) -> str | None:
    """A singleton prompt's text as the RequestOutput gives it (None for token ids)."""
    text = p if isinstance(p, str) else p.get("prompt") if isinstance(p, dict) else None
    return text if isinstance(text, str) else None


def encoder_prompts(hf_config: Any, tokenizer: Any, vocab_size: int, path: Any = None) -> Any:
    """The prompt splitter of a text encoder-decoder checkpoint (BART; Florence-2's, which
    reads its image processor from `path`: multimodal/florence2_prompt.py), None for any
    other."""
    from paged_engine.models.bart import is_bart
    from paged_engine.multimodal.donut import is_donut
    from paged_engine.multimodal.florence2 import is_florence2

    if is_florence2(hf_config) and path is not None:
        from paged_engine.multimodal.florence2_prompt import Florence2Prompts

        return Florence2Prompts(tokenizer, hf_config, vocab_size, path)
    if is_donut(hf_config) and path is not None:  # (multimodal/donut_prompt.py)
        from paged_engine.multimodal.donut_prompt import DonutPrompts

        return DonutPrompts(tokenizer, hf_config, vocab_size, path)
    return EncoderPrompts(tokenizer, hf_config, vocab_size) if is_bart(hf_config) else None
