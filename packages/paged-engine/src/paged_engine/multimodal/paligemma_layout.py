"""PaliGemma's prompts on the host (multimodal/paligemma.py is the encoder side).

    HF's PaliGemmaProcessor:  "<image>" x (n * images) + "<bos>" + prompt + "\\n"  tokenized
    a paged prompt:           [<bos>] [<image> x images] [<bos>] prompt   (vLLM's form: the
                              prompt alone; HF's form: lone <image> tokens first)
        -> the runs, <bos>, then prompt + "\\n" encoded again as one text (so a prompt ending
           in "\\n" gets HF's "\\n\\n" token)

A prompt that holds the runs already (HF's processor output) is taken as it is. The whole
prompt is the prefix that attends both ways (`ImageInput.prefix_end`), so each image's hash
covers the prompt too: a prefix-cache hit needs the same images and the same whole prompt (an
image's keys and values depend on the text after it). Refused by name: text-only prompts,
image tokens after the text, image embeddings (features) and, for PaliGemma 2, a prompt longer
than the sliding window (HF's sliding layers let the prefix see past the window; ours keep it).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import Layout, Loaded
from paged_engine.multimodal.paligemma import image_tokens


class PaliGemmaLayout(Layout):
    takes_embeds = False
    bidirectional = True  # the engine keeps max_num_batched_tokens >= an image's tokens
    # a text-only prompt is refused (engine/input_processor.py): HF's processor wants an image,
    # and HF's model, with no token_type_ids, attends over a text-only prompt both ways
    needs_image = True

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        if tokenizer is None:
            raise ValueError("the tokenizer is needed for PaliGemma's image prompts")
        self.config = config
        self.placeholder = placeholder
        self.tokenizer = tokenizer
        self.fixed = image_tokens(config)
        self.bos = int(tokenizer.bos_token_id)
        self.window = getattr(config.text_config, "sliding_window", None)

    def segment(self, loaded: Loaded) -> list[int]:  # (not Layout's: the prompt is rebuilt)
        return [self.placeholder] * self.fixed

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """HF's prompt: the runs, <bos>, the text with "\\n" (see the module)."""
        at = 1 if ids[:1] == [self.bos] else 0
        lone = 0
        while at + lone < len(ids) and ids[at + lone] == self.placeholder:
            lone += 1
        at += lone
        at += 1 if ids[at : at + 1] == [self.bos] else 0
        rest = ids[at:]
        if self.placeholder in rest or lone not in (0, len(segments)):
            raise ValueError(
                f"multi_modal_data['image'] has {len(segments)} image(s): PaliGemma's images "
                "come before the text, so a prompt holds either no image token or one per "
                f"image at its start (token id {self.placeholder}), not after the text"
            )
        text = self.tokenizer.decode(rest, skip_special_tokens=False)
        tail = self.tokenizer.encode(text + "\n", add_special_tokens=False)
        runs = [t for s in segments for t in s]
        starts = [i * self.fixed for i in range(len(segments))]
        return [*runs, self.bos, *tail], starts

    def finish(self, ids: list[int], images: tuple[ImageInput, ...]) -> tuple[ImageInput, ...]:
        """The images with the prompt-wide prefix (and its hash); ValueError unless they are
        the prompt's first tokens or where the prefix would outrun the sliding window."""
        n = len(images) * self.fixed
        first = [m.offset for m in images] == [i * self.fixed for i in range(len(images))]
        if not first or ids[:n] != [self.placeholder] * n or self.placeholder in ids[n:]:
            raise ValueError(
                "multi_modal_data['image']: PaliGemma's image runs must be the prompt's first "
                "tokens, one after another"
            )
        if self.window is not None and len(ids) > int(self.window):
            raise ValueError(
                f"multi_modal_data['image']: the prompt's {len(ids)} tokens attend to each other "
                f"both ways, more than text_config.sliding_window={self.window} (not supported)"
            )
        # each hash: its pixels' first 16 hex digits, then 16 of the prompt's and all images'
        # (the same again for images finished already: processed ahead by a server)
        whole = hashlib.sha256(repr(ids).encode())
        for m in images:
            whole.update(m.mm_hash[:16].encode())
        key = whole.hexdigest()[:16]
        return tuple(
            dataclasses.replace(m, prefix_end=len(ids), mm_hash=m.mm_hash[:16] + key)
            for m in images
        )

    def fits(self, m: ImageInput) -> bool:
        return m.prefix_end > 0 and super().fits(m)
