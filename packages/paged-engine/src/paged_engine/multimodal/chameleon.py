"""Chameleon's image path (ChameleonForConditionalGeneration; its decoder: models/chameleon.py).

    image -> the checkpoint's ChameleonImageProcessor: shortest side resized to S, centre crop
        S x S, rescaled and normalized: pixels [3, S, S] (S = vq_config.resolution, 512)
        -> VQ-VAE encoder and quantizer (multimodal/chameleon_vqvae.py): (S / 16)^2 codebook
           indices (1024 at 512 pixels), row-major
        -> each index's image token (vocabulary_map's "IMGIMG*" names: HF's img2bpe mapping)
        -> that token's row of the text embedding: (S / 16)^2 rows of the text hidden size
    prompt: each "<image>" token becomes <racm3:break> (boi), a run of (S / 16)^2 "<image>"
        placeholders, <eoss> (eoi): HF's ChameleonProcessor and vLLM's prompt replacement

Where the embedding lookup happens: the encoder, on the device, as one more image feature.
HF and vLLM compute the image's token ids and embed them with the text model's table; paged's
encoder path hands the runner feature rows per image (worker/image_embeds.py) and is built
apart from the decoder, so the encoder keeps its own copy of the rows it can give: for each
codebook index c, the text embedding's row of c's image token (`image_rows` [K, hidden], taken
from `model.embed_tokens.weight` at load: 8192 rows, 64 MiB in bf16 at 7B). Row lookups are
exact, so these rows equal HF's `embed_tokens(img2bpe(codes))` bit for bit, and the image keeps
paged's whole image machinery (features cached by pixel hash, chunked prefill through the run,
prefix caching keyed by that hash). Computing the tokens on the host instead would put the
VQ-VAE (convolutions at 512 x 512) on the CPU of the serving process.

A prompt with images ends in the tokenizer's sep token (<reserved08706>), once, after the whole
prompt (not after each image): HF's ChameleonProcessor appends it in its default chat mode, and
vLLM (which calls that processor, and appends it to token-id prompts itself) does too; a prompt
ending in it already keeps just the one, and one that holds its images' segments already (an HF
processor's ids, completion mode's too) is taken as it is. Text-only prompts are tokenized as
written (as vLLM does: its processor runs only with multi_modal_data). Refused by name: image
embeddings (vLLM takes pixels only for Chameleon), a vocabulary_map without an image token for
every codebook index, pixels of another size; mm_processor_kwargs' return_for_text_completion
(the image processor does not take it: give the ids of HF's completion mode instead).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from paged_engine.models.chameleon import image_token_ids
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.chameleon_vqvae import ChameleonVQVAE, tokens_per_image
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import Layout, Loaded, Size, token_ids

ARCH = "ChameleonForConditionalGeneration"
_EMBED = "model.embed_tokens.weight"


def code_tokens(config: Any) -> list[int]:
    """Codebook index -> its image token id (a list over all vq_config.num_embeddings codes);
    ValueError naming vocabulary_map where a code has none."""
    count = int(config.vq_config.num_embeddings)
    mapping = image_token_ids(getattr(config, "vocabulary_map", None))
    missing = [c for c in range(count) if c not in mapping]
    if missing:
        raise ValueError(
            f"vocabulary_map has no image token (IMGIMG...) for {len(missing)} of the "
            f"{count} codebook indices of vq_config.num_embeddings (first: {missing[0]})"
        )
    bad = [t for t in mapping.values() if not 0 <= t < int(config.vocab_size)]
    if bad:
        raise ValueError(f"vocabulary_map's image token id {bad[0]} is past vocab_size")
    return [mapping[c] for c in range(count)]


class ChameleonImageEncoder(nn.Module):
    """Images -> rows of the text embedding (one per placeholder, see the module)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.vqmodel = ChameleonVQVAE(config.vq_config)
        codes = torch.tensor(code_tokens(config), dtype=torch.long)
        self.register_buffer("code_tokens", codes, persistent=False)  # [K] token ids
        # the text embedding's row of each code's image token: [K, hidden]
        self.image_rows = nn.Parameter(torch.empty(len(codes), int(config.hidden_size)))
        self.image_rows.weight_loader = self._load_rows

    def _load_rows(self, param: nn.Parameter, table: torch.Tensor) -> None:
        """Takes the whole text embedding [vocab, hidden] and keeps its image tokens' rows."""
        if table.dim() != 2 or table.shape[1] != param.shape[1]:
            raise ValueError(f"embedding {tuple(table.shape)}, expected [vocab, {param.shape[1]}]")
        param.data.copy_(table[self.code_tokens.cpu()])

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, s * s, D]
        return self.image_rows[self.vqmodel(pixels)]

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        weight = self.vqmodel.quant_conv.weight
        pixels = torch.stack([m.pixel_values for m in images])  # type: ignore[misc]
        return list(self(pixels.to(weight.device, weight.dtype)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `model.vqmodel.*` encoder-side tensors and its token embedding (the
        image tokens' rows kept); the decoder half and every other name passed over; ValueError
        naming a missing or unexpected one."""

        def ours(name: str) -> str | None:
            if name == _EMBED:
                return "image_rows"
            name = name.removeprefix("model.")
            if not name.startswith("vqmodel.") or name.startswith("vqmodel.post_quant_conv."):
                return None
            return name

        picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)


class ChameleonLayout(Layout):
    """Each <image> -> boi, a fixed run of placeholders, eoi; pixels [3, S, S]."""

    takes_embeds = False  # vLLM's Chameleon reads pixel values only

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        self.config = config
        self.placeholder = placeholder
        self.fixed = tokens_per_image(config.vq_config)
        self.side = int(config.vq_config.resolution)
        self.bounds = token_ids(
            tokenizer,
            getattr(tokenizer, "boi_token", None) or "<racm3:break>",
            getattr(tokenizer, "eoi_token", None) or "<eoss>",
        )
        sep = getattr(tokenizer, "sep_token_id", None)
        self.sep: int | None = None if sep is None else int(sep)  # None: no sep token to add

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        return (3, self.side, self.side)

    def segment(self, loaded: Loaded) -> list[int]:
        start, end = self.bounds
        return [start, *([self.placeholder] * self.fixed), end]

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        return super().place(loaded, at + 1, segment)  # after boi

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """The segments in place, then HF's chat-mode sep token at the end (see the module);
        the segments' starts are unmoved (the sep comes after them all)."""
        out, starts = super().splice(ids, segments)
        if self.sep is not None and out[-1:] != [self.sep]:
            out = [*out, self.sep]
        return out, starts

    def span(self, m: ImageInput) -> list[int]:
        return [self.placeholder] * m.length
