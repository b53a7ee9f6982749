"""Donut's prompts on the host (multimodal/donut.py is the model): vLLM 0.10's prompt forms split
into the decoder prompt the engine runs (the task prompt) and the image the decoder
cross-attends to.

    {"prompt": "<s_docvqa><s_question>...</s_question><s_answer>" | text,
     "multi_modal_data": {"image": image}}  (or "prompt_token_ids": [...])
        -> the decoder prompt is the prompt, the encoder input the image
    {"encoder_prompt": {"prompt": "" | text, "multi_modal_data": {"image": image}},
     "decoder_prompt": text | ids | {"prompt" / "prompt_token_ids"} | None}
        (vLLM 0.10's example form; its encoder text, a placeholder there, is not read: Donut
        has no text encoder)

The decoder prompt's text is tokenized without special tokens (the Donut task prompt starts
the decoder: DonutProcessor's usage, vLLM's example) and taken as it is, as transformers'
generate takes Donut's decoder_input_ids (no start token put in front); an empty one is
[decoder_start_token_id] (the wrapper's, else the decoder's, else bos_token_id), what
transformers starts from with none. The image: the checkpoint's image processor
(DonutImageProcessor: thumbnail / resize into `size`, pad, rescale, normalize; its PIL class
where torchvision is missing) -> pixels [3, H, W], one item (modality "image") spanning
every decoder position, so its hash keys every prefix-cache block. The RequestOutput's
encoder_prompt is the encoder prompt's text where given, its encoder_prompt_token_ids the
image's rows as pad_token_id (vLLM's placeholders).

Refused by name (ValueError): a prompt without an image, more than one image (vLLM's limit),
other modalities, an image that is not a PIL image or has no pixels, mm_processor_kwargs,
multi_modal_data in the decoder prompt, an image whose tower map is too small for the window
(donut_swin.swin_grid) or has more rows than a slot (config.encoder.image_size's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from paged_engine.engine.encoder_prompt import (
    SINGLE_KEYS,
    ImageEncoderPrompts,
    SplitPrompt,
    decoder_fields,
    prompt_ids,
    prompt_text,
    split_encoder_decoder,
)
from paged_engine.multimodal.donut import slot_rows
from paged_engine.multimodal.donut_swin import swin_grid
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import digest
from paged_engine.unicode_text import check_text


def start_id(hf_config: Any) -> int:
    """The decoder's first token where the prompt gives none."""
    for cfg in (hf_config, hf_config.decoder):
        for field in ("decoder_start_token_id", "bos_token_id"):
            v = getattr(cfg, field, None)
            if v is not None:
                return int(v)
    raise ValueError("config.decoder_start_token_id (or decoder.bos_token_id) must be set")


class DonutPrompts(ImageEncoderPrompts):
    """The InputProcessor's `encoder_prompts` for Donut: `split(prompt)` -> its SplitPrompt,
    whose one item is the image."""

    family = "Donut"

    def __init__(self, tokenizer: Any, hf_config: Any, vocab_size: int, path: Path) -> None:
        super().__init__(tokenizer, hf_config, vocab_size, path)
        self.start = start_id(hf_config)
        self.limit = int(hf_config.decoder.max_position_embeddings)
        self.rows = slot_rows(hf_config)
        pad = getattr(hf_config, "pad_token_id", None)
        self.pad = int(hf_config.decoder.pad_token_id if pad is None else pad)

    def split(self, prompt: Any, truncate: int | None = None) -> SplitPrompt:
        """`truncate` is the InputProcessor's to apply to the decoder prompt (it refuses a
        cut by name): there is no encoder text to cut."""
        enc, dec = split_encoder_decoder(prompt)
        explicit = enc is not prompt
        self.check_encoder(enc, "encoder_prompt" if explicit else "prompt")
        if isinstance(dec, dict) and "multi_modal_data" in dec:
            raise ValueError("decoder_prompt: multi_modal_data is taken by the encoder prompt only")
        pixels = self.pixels(enc["multi_modal_data"])
        h, w = swin_grid(int(pixels.shape[-2]), int(pixels.shape[-1]), self.config.encoder)
        if h * w > self.rows:
            raise ValueError(
                f"multi_modal_data['image']: its {tuple(pixels.shape[-2:])} pixels make {h * w} "
                f"encoder rows, over the {self.rows} of encoder.image_size "
                f"{self.config.encoder.image_size}"
            )
        salt = enc.get("cache_salt")
        if explicit:
            ids, text, dec_salt = self._decoder(dec, "decoder_prompt")
            salt = salt if dec_salt is None else dec_salt
        else:  # the prompt is the decoder's
            rest = {k: v for k, v in enc.items() if k != "multi_modal_data"}
            ids, text, _ = self._decoder(rest, "prompt")
        return SplitPrompt(
            decoder_fields(text, ids or [self.start], salt),
            (ImageInput(pixels, 0, self.limit, digest(pixels, None)),),
            prompt_text(enc) if explicit else None,
            [self.pad] * (h * w),  # the image's rows as pad_token_id (vLLM's placeholders)
        )

    def _decoder(self, p: Any, what: str) -> tuple[list[int], str | None, Any]:
        """A decoder prompt (None, text, ids or their dict) -> (its ids, text, cache_salt)."""
        if p is None or (isinstance(p, dict) and not {"prompt", "prompt_token_ids"} & set(p)):
            return [], None, p.get("cache_salt") if isinstance(p, dict) else None
        text = p.get("prompt") if isinstance(p, dict) and "prompt_token_ids" not in p else p
        if not isinstance(text, str):  # ids, or their dict: BART's checks
            ids, salt = prompt_ids(p, what, self.tokenizer, self.vocab_size)
            return ids, None, salt
        refused = sorted(set(p) - set(SINGLE_KEYS)) if isinstance(p, dict) else []
        if refused:
            raise ValueError(
                f"{what}: {refused[0]!r} is not supported for Donut (a prompt dict takes "
                f"{list(SINGLE_KEYS)})"
            )
        check_text(text, what)
        salt = p.get("cache_salt") if isinstance(p, dict) else None
        # Donut's task prompts start the decoder: no special tokens added
        return list(self.tokenizer.encode(text, add_special_tokens=False)), text, salt
