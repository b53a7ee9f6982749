"""Mantis (TIGER-Lab/Mantis-8B-siglip-llama3, -clip-llama3): LLaVA with each image's run of
placeholders wrapped in numbered text, as vLLM's `MantisForConditionalGeneration` (llava.py)
builds its prompts.

The releases are plain `LlavaForConditionalGeneration` checkpoints (config, weights, tower and
projector); vLLM reaches the name with `hf_overrides={"architectures":
["MantisForConditionalGeneration"]}` and changes only the prompt, redoing the Mantis
processor's text: image i (from 1) of a prompt becomes

    "(image i: <Image>" + "<image>" x N + "</Image>)"    N: LLaVA's run (576 at 336 pixels)

that whole string tokenized on its own (no special tokens), in place of the image's token. The
model is LLaVA's: the worker builds the tower from config.json as it is (multimodal/llava.py);
this layout is the host side alone (multimodal/archs.py KINDS "mantis"). The override is kept
apart from the text config (loader.apply_hf_overrides records it as `served_as`) and applied
to the wrapper config the image processor reads (`as_mantis`, engine/llm_engine.py).

Refused by name: image features given instead of images (vLLM's processor would wrap them, the
run's length is then the features'), a LLaVA config whose images take another path (a Pixtral
tower), and a tokenizer without the image token as a token of its own.
"""

from __future__ import annotations

import copy
from typing import Any

from paged_engine.multimodal.layouts import Layout, Loaded, replace_tokens, run_starts

ARCH = "MantisForConditionalGeneration"  # vLLM's name
WRAPPED = "LlavaForConditionalGeneration"  # what the checkpoint is


def as_mantis(config: Any) -> Any:
    """A copy of the LLaVA wrapper config named `ARCH` (image kind "mantis"); ValueError
    naming hf_overrides where the checkpoint's images take another path than LLaVA's."""
    from paged_engine.multimodal.archs import image_kind

    kind = image_kind(config)
    if kind != "llava":
        raise ValueError(
            f"hf_overrides architectures [{ARCH!r}]: the checkpoint's images take the {kind!r} "
            "path, not LLaVA's (Mantis is LLaVA with a CLIP or SigLIP tower)"
        )
    config = copy.copy(config)
    config.architectures = [ARCH]
    return config


class MantisLayout(Layout):
    """LLaVA 1.5's runs, each wrapped in "(image i: <Image>" ... "</Image>)"."""

    takes_embeds = False  # features have no image to number as Mantis' processor does

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        super().__init__(config, placeholder, tokenizer)
        if tokenizer is None:
            raise ValueError(f"{ARCH}: the image prompt text needs the model's tokenizer")
        self.tokenizer = tokenizer
        self.token = tokenizer.convert_ids_to_tokens(placeholder)

    def segment(self, loaded: Loaded) -> list[int]:  # (not Layout's: `splice` wraps the runs)
        return [self.placeholder] * self.length(loaded[1])

    def wrapped(self, index: int, run: int) -> tuple[list[int], int]:
        """(the tokens of image `index` (from 0) with a run of `run` placeholders, where the
        run starts in them)."""
        text = f"(image {index + 1}: <Image>{self.token * run}</Image>)"
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        starts = run_starts(ids, self.placeholder)
        if len(starts) != 1 or ids.count(self.placeholder) != run:
            raise ValueError(
                f"{ARCH}: the tokenizer does not keep {self.token!r} (id {self.placeholder}) as "
                "one token in Mantis' image text"
            )
        return ids, starts[0]

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """Each image token -> its numbered text around its run; the runs' starts."""
        lone = [i for i, t in enumerate(ids) if t == self.placeholder]
        super().splice(ids, segments)  # one lone image token per image, else ValueError
        pieces = [self.wrapped(i, len(s)) for i, s in enumerate(segments)]
        out, starts = replace_tokens(ids, lone, [p for p, _ in pieces])
        return out, [at + offset for at, (_, offset) in zip(starts, pieces, strict=True)]
