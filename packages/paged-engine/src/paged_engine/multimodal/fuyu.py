"""Fuyu's image path (FuyuForCausalLM, Adept Fuyu-8B): no vision tower, patches straight in.

    image -> the checkpoint's FuyuImageProcessor: shrunk (aspect kept) to fit size (H x W,
        1080 x 1920 by default) only where larger, padded right / down to H x W, normalized
        -> cropped to h x w, the unpadded size rounded up to whole p x p patches (p =
        config.patch_size, 30) -> patches row by row, each flattened (p, p, channel)
        -> [rows * cols, p * p * 3] (`ImageInput.pixel_values`)
        -> vision_embed_tokens (a Linear with bias) -> one text-embedding row a patch
    prompt (HF's FuyuProcessor):  ([|SPEAKER|] x cols + [|NEWLINE|]) x rows, "<s>",
        the prompt, "<0x04>" (beginning of answer); a row's patches take its |SPEAKER|
        tokens, each |NEWLINE| keeps its own embedding (`ImageInput.break_every` = cols + 1)
    text model: Persimmon (models/persimmon.py), 1-D positions from 0, causal throughout

The host side (`FuyuLayout`) takes vLLM's form, the prompt alone (a leading <s> dropped), and
writes HF's around it; a prompt that holds the expanded rows already (HF's processor output)
is taken as it is. One image a prompt, as HF's processor and vLLM take it; text-only prompts
are Persimmon's. Refused by name: a second image, |SPEAKER| tokens written in the text, image
embeddings (the span has line breaks between its rows), a processor size that is not whole
patches (mm_processor_kwargs['size'] / do_pad), and a tokenizer without |NEWLINE|, <s> or
<0x04>. vLLM's fuyu.py serves the same prompt and patches.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import Layout, Loaded, Run, Size, digest, token_ids

ARCH = "FuyuForCausalLM"


def patch_dim(config: Any) -> int:
    """Values in one flattened patch: p * p * channels."""
    return int(config.patch_size) ** 2 * int(config.num_channels)


def patchify(image: torch.Tensor, p: int) -> torch.Tensor:
    """[C, R * p, K * p] -> [R * K, p * p * C]: patches row by row, each (p, p, C) flattened
    (the order HF's patchify_image writes and vision_embed_tokens reads)."""
    c, h, w = image.shape
    grid = image.reshape(c, h // p, p, w // p, p).permute(1, 3, 2, 4, 0)
    return grid.reshape((h // p) * (w // p), p * p * c)


class FuyuLayout(Layout):
    """Rows of patches: (rows, cols) = image_size; span ([|SPEAKER|] x cols + [|NEWLINE|])
    x rows; pixels [rows * cols, p * p * C]."""

    takes_embeds = False  # features would need their rows' line breaks (not vLLM's input)

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        self.config = config
        self.placeholder = placeholder
        self.fixed = None
        self.patch = int(config.patch_size)
        self.dim = patch_dim(config)
        # HF's processor writes "|NEWLINE|", "<s>" and "<0x04>" as text: the vocab's ids
        self.newline, self.bos, self.boa = token_ids(tokenizer, "|NEWLINE|", "<s>", "<0x04>")

    def length(self, size: Size) -> int:
        if size is None or len(size) != 2 or min(size) < 1:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not (rows, cols)")
        return size[0] * (size[1] + 1)

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        assert size is not None and len(size) == 2
        return (size[0] * size[1], self.dim)

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])
        canvas = out["images"][0][0].float()  # [C, H, W]: fitted into `size`, padded to it
        h = int(out["image_unpadded_heights"][0][0])
        w = int(out["image_unpadded_widths"][0][0])
        p = self.patch
        # HF's crop: the unpadded image rounded up to whole patches, within the canvas
        rows_px = min(canvas.shape[-2], math.ceil(h / p) * p)
        cols_px = min(canvas.shape[-1], math.ceil(w / p) * p)
        if rows_px % p or cols_px % p or min(rows_px, cols_px) < p:
            raise ValueError(
                f"multi_modal_data['image']: the image processor gave a "
                f"{canvas.shape[-2]} x {canvas.shape[-1]} canvas holding a {h} x {w} image, "
                f"not whole {p} x {p} patches (config.patch_size): mm_processor_kwargs['size'] "
                "must be multiples of it, and 'do_pad' true"
            )
        if canvas.shape[0] * p * p != self.dim:
            raise ValueError(
                f"multi_modal_data['image']: the image processor gave {canvas.shape[0]} "
                f"channels, not config.num_channels={self.config.num_channels}"
            )
        patches = patchify(canvas[:, :rows_px, :cols_px], p).contiguous()
        return patches, (rows_px // p, cols_px // p)

    def segment(self, loaded: Loaded) -> list[int]:
        return self._rows(loaded[1])

    def _rows(self, size: Size) -> list[int]:
        assert size is not None and len(size) == 2
        return ([self.placeholder] * size[1] + [self.newline]) * size[0]

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        pixels, size = loaded
        assert size is not None
        n = len(segment)
        return [ImageInput(pixels, at, n, digest(pixels, size), size, break_every=size[1] + 1)]

    def span(self, m: ImageInput) -> list[int]:
        return self._rows(m.image_size)

    def fits(self, m: ImageInput) -> bool:
        size = m.image_size
        ok = size is not None and len(size) == 2 and super().fits(m)
        return ok and m.break_every == size[1] + 1

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """HF's prompt: the image's rows, <s>, the prompt (its own leading <s> dropped),
        <0x04>."""
        self._one(len(segments))
        if self.placeholder in ids:
            raise ValueError(
                f"multi_modal_data['image']: the prompt holds Fuyu's image token (id "
                f"{self.placeholder}, |SPEAKER|) outside an image's rows; Fuyu puts its image "
                "before the text itself: write the prompt without it"
            )
        rest = ids[1:] if ids[:1] == [self.bos] else ids
        return [*segments[0], self.bos, *rest, self.boa], [0]

    def finish(self, ids: list[int], images: tuple[ImageInput, ...]) -> tuple[ImageInput, ...]:
        self._one(len(images))  # (also for images processed ahead, or HF's expanded ids)
        return images

    def _one(self, count: int) -> None:
        if count != 1:
            raise ValueError(
                f"multi_modal_data['image'] has {count} images: Fuyu takes one image a prompt "
                "(as HF's FuyuProcessor and vLLM)"
            )


class FuyuImageEncoder(nn.Module):
    """Patches -> rows of the text model's input embedding (one row a patch)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = int(config.text_config.hidden_size)
        self.vision_embed_tokens = nn.Linear(patch_dim(config), hidden, bias=True)

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each image's rows [rows * cols, D]; the batch's patches in one matmul."""
        w = self.vision_embed_tokens.weight
        patches: list[torch.Tensor] = []  # [rows * cols, p * p * C] each
        for m in images:
            assert m.pixel_values is not None  # (no embeds: FuyuLayout.takes_embeds is False)
            patches.append(m.pixel_values)
        rows = self.vision_embed_tokens(torch.cat(patches).to(w.device, w.dtype))
        return list(rows.split([len(x) for x in patches]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `[model.]vision_embed_tokens.*` (transformers 5 / the Hub's
        names; every other tensor passed over); ValueError naming a missing one."""
        picked = (
            (name.removeprefix("model."), t)
            for name, t in weights
            if name.removeprefix("model.").startswith("vision_embed_tokens.")
        )
        return load_named_weights(self, picked)
