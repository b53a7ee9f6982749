"""Florence-2's prompts on the host (multimodal/florence2.py is the model): vLLM 0.10's prompt
forms split into the decoder prompt the engine runs and the encoder input the decoder
cross-attends to, an image and a text.

    {"prompt": "<CAPTION>" | text, "multi_modal_data": {"image": image}}
        or {"prompt_token_ids": [...], "multi_modal_data": ...}: the encoder prompt; the
        decoder prompt is [eos_token_id] (vLLM's Florence-2 processor), with
        decoder_start_token_id put in front where it differs (Florence-2: both </s>, so [2],
        which is also what transformers' generate starts from)
    {"encoder_prompt": <one of the above>, "decoder_prompt": text | ids | dict | None}

The encoder text: a task token (`TASKS`, the processor's tables) becomes its question
("<CAPTION>" -> "What does the image describe?"; "<OPEN_VOCABULARY_DETECTION>cat" -> "Locate cat
in the image."), then [bos] + ids + [eos] as transformers' Florence2Processor writes
`<s>{text}</s>` (the BART tokenizer's own special tokens, which vLLM's tokenizer call adds);
prompt_token_ids are taken as they are. The image: the checkpoint's image processor
(CLIPImageProcessor: resize to `size`, rescale, normalize; its PIL class where torchvision is
missing, multimodal/torch_processors.py) -> pixels [3, H, W].

A request's items (its mm_inputs): the image (modality "image", the pixels) then the encoder
text (modality "text", its ids [L], int64), each spanning every decoder position so that both
reach the worker with every sequence holding them and both hashes key every prefix-cache block.
The encoder reads image_rows (the tower's map cells + 1) + L rows, within
text_config.max_position_embeddings (its position table).

Refused by name (ValueError): a prompt without an image (vLLM 0.10 ran it with no encoder
input at all, which transformers has no counterpart for), more than one image (vLLM's limit),
other modalities, an image that is not a PIL image or has no pixels, mm_processor_kwargs, a
task token with other text where the processor takes it alone, an encoder input longer than
the position table, decoder prompts with multi_modal_data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from paged_engine.engine.encoder_prompt import (
    EncoderPrompts,
    ImageEncoderPrompts,
    SplitPrompt,
    decoder_fields,
    prompt_ids,
    prompt_text,
    split_encoder_decoder,
)
from paged_engine.multimodal.florence2 import conv_out, image_rows
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import digest
from paged_engine.unicode_text import check_text

# transformers' Florence2Processor task tables: a task token alone, or with its input
TASKS = {
    "<OCR>": "What is the text in the image?",
    "<OCR_WITH_REGION>": "What is the text in the image, with regions?",
    "<CAPTION>": "What does the image describe?",
    "<DETAILED_CAPTION>": "Describe in detail what is shown in the image.",
    "<MORE_DETAILED_CAPTION>": "Describe with a paragraph what is shown in the image.",
    "<OD>": "Locate the objects with category name in the image.",
    "<DENSE_REGION_CAPTION>": "Locate the objects in the image, with their descriptions.",
    "<REGION_PROPOSAL>": "Locate the region proposals in the image.",
}
TASKS_WITH_INPUT = {
    "<CAPTION_TO_PHRASE_GROUNDING>": "Locate the phrases in the caption: {input}",
    "<REFERRING_EXPRESSION_SEGMENTATION>": "Locate {input} in the image with mask",
    "<REGION_TO_SEGMENTATION>": "What is the polygon mask of region {input}",
    "<OPEN_VOCABULARY_DETECTION>": "Locate {input} in the image.",
    "<REGION_TO_CATEGORY>": "What is the region {input}?",
    "<REGION_TO_DESCRIPTION>": "What does the region {input} describe?",
    "<REGION_TO_OCR>": "What text is in the region {input}?",
}


def task_text(prompt: str) -> str:
    """The processor's `_construct_prompts` for one prompt."""
    for token, text in TASKS.items():
        if token in prompt:
            if prompt != token:
                raise ValueError(
                    f"prompt: the task token {token} must be the whole prompt, got {prompt!r}"
                )
            return text
    for token, text in TASKS_WITH_INPUT.items():
        if token in prompt:
            return text.format(input=prompt.replace(token, "").strip())
    return prompt


class Florence2Prompts(ImageEncoderPrompts):
    """The InputProcessor's `encoder_prompts` for Florence-2: `split(prompt)` -> its
    SplitPrompt, whose items are (image, encoder text)."""

    family = "Florence-2"

    def __init__(self, tokenizer: Any, hf_config: Any, vocab_size: int, path: Path) -> None:
        super().__init__(tokenizer, hf_config, vocab_size, path)
        text = hf_config.text_config
        self.decoder = EncoderPrompts(tokenizer, text, vocab_size)  # the decoder prompt's
        self.vision = hf_config.vision_config
        self.limit = int(text.max_position_embeddings)
        self.bos, self.eos = int(text.bos_token_id), int(text.eos_token_id)
        self.pad = int(text.pad_token_id)  # an image row's id in encoder_prompt_token_ids

    def split(self, prompt: Any, truncate: int | None = None) -> SplitPrompt:
        enc, dec = split_encoder_decoder(prompt)
        self.check_encoder(enc, "encoder_prompt")
        pixels = self.pixels(enc["multi_modal_data"])
        ids = self._encoder_ids(enc)
        if truncate is not None and len(ids) > (self.limit if truncate == -1 else truncate):
            raise ValueError(
                f"truncate_prompt_tokens={truncate} would cut Florence-2's encoder text "
                f"({len(ids)} tokens, its task's question included): not supported; give a "
                "shorter text or no truncation"
            )
        rows = image_rows(int(pixels.shape[-2]), int(pixels.shape[-1]), self.vision)
        if rows + len(ids) > self.limit:
            raise ValueError(
                f"encoder_prompt is too long: {rows} image rows and {len(ids)} tokens, but the "
                f"encoder's position table holds {self.limit} "
                "(text_config.max_position_embeddings)"
            )
        if isinstance(dec, dict) and "multi_modal_data" in dec:
            raise ValueError("decoder_prompt: multi_modal_data is taken by the encoder prompt only")
        # vLLM's Florence-2 decoder prompt: [eos] (the start token put in front)
        dec_ids, dec_text, salt = self.decoder.decoder_prompt([self.eos] if dec is None else dec)
        salt = enc.get("cache_salt") if salt is None else salt
        span = self.decoder.limit  # every decoder position
        image = ImageInput(pixels, 0, span, digest(pixels, None))
        ids_t = torch.tensor(ids, dtype=torch.int64)
        text = ImageInput(ids_t, 0, span, digest(ids_t, None), modality="text")
        # the RequestOutput's, as vLLM 0.10's: the encoder text as given, and the ids the
        # encoder reads (the image's rows as pad_token_id, vLLM's placeholders, then the text)
        return SplitPrompt(
            decoder_fields(dec_text, dec_ids, salt),
            (image, text),
            prompt_text(enc),
            [self.pad] * rows + ids,
        )

    def _encoder_ids(self, enc: dict) -> list[int]:
        if "prompt_token_ids" in enc:  # BART's checks: a list of ids within the vocabulary
            given = {"prompt_token_ids": enc["prompt_token_ids"]}
            ids, _ = prompt_ids(given, "encoder_prompt", self.tokenizer, self.vocab_size)
        else:
            text = enc.get("prompt", "")
            if not isinstance(text, str):
                raise ValueError(f"prompt must be a str, got {type(text).__name__}")
            check_text(text, "prompt")
            body = self.tokenizer.encode(task_text(text), add_special_tokens=False)
            ids = [self.bos, *body, self.eos]
        if not ids:
            raise ValueError("encoder_prompt: prompt_token_ids must not be empty")
        return ids

    def pixels(self, data: Any) -> torch.Tensor:
        """The shared checks and pixels [3, H, W], then the tower's map within its position
        table."""
        pixels = super().pixels(data)
        side = max(conv_out(int(n), self.vision) for n in pixels.shape[-2:])
        if side > int(self.vision.max_position_embeddings):
            raise ValueError(
                f"multi_modal_data['image']: the image processor's {tuple(pixels.shape[-2:])} "
                f"pixels make a {side}-cell map side, over the tower's position table "
                f"(vision_config.max_position_embeddings={self.vision.max_position_embeddings})"
            )
        return pixels
