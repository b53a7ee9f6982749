"""Emu3's image path (Emu3ForConditionalGeneration, BAAI's Emu3-Chat; its decoder is Llama's:
models/__init__.py's Emu3ForCausalLM). Text out only.

    image -> the checkpoint's Emu3ImageProcessor: resized (bicubic) to H x W, multiples of its
        spatial_factor (8) with H * W within [min_pixels, max_pixels], aspect kept (smart_resize),
        rescaled and normalized: pixels [3, H, W], image_sizes (H, W)
        -> VQ-VAE encoder and quantizer (multimodal/emu3_vqvae.py): h x w codebook indices
           (h = H / f, w = W / f, f = 2^(levels - 1), 8 in the release)
        -> each index's image token (vocabulary_map's "<|visual tokenNNNNNN|>" names: HF's
           img2bpe), an end-of-line token (<|extra_200|>) after each row of w
        -> those tokens' rows of the text embedding: h * (w + 1) rows
    prompt (HF's Emu3Processor): each "<image>" token becomes <|image start|> (boi), the text
        "{h}*{w}" (tokenized alone: special tokens on both sides), <|image token|> (the
        wrapper), a run of h * (w + 1) "<image>" placeholders, <|extra_201|> (eof),
        <|image end|> (eoi)

As for Chameleon (multimodal/chameleon.py), the embedding lookup happens on the encoder path:
the encoder keeps the text embedding's rows of every code's image token and of the end-of-line
token (`image_rows` [K + 1, hidden], taken from the text model's embed_tokens at load),
so its rows equal HF's `embed_tokens(img2bpe(codes))` bit for bit and the image keeps paged's
image machinery (features cached by pixel hash, chunked prefill, prefix caching).

A prompt with images starts with the tokenizer's bos token, once: HF's Emu3Processor prepends it
(its tokenizer adds none), so paged does unless the prompt starts with it already; one that holds
its images' segments already (an HF processor's ids) is taken as it is. Text-only prompts are
tokenized as written (vLLM has no Emu3 of its own; its processors run only with multi_modal_data).
Where paged differs from HF, and why: HF's image processor pads a batch's images to the largest and
encodes the padding with them (the VQ-VAE's attention sees it); paged encodes each image at its own
size, as HF does an image alone (or images of one size). HF's forward scores the image tokens like
any other (unlike Chameleon's, nothing is masked), and so does paged. Refused by name: image
embeddings (the segment's "{h}*{w}" needs the image's grid), a vocabulary_map without an image
token for every codebook index or without <|extra_200|>, pixels whose sides are not whole codes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.emu3_vqvae import Emu3VQVAE, spatial_factor
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import Layout, Loaded, Run, Size, token_ids

ARCH = "Emu3ForConditionalGeneration"
# the text embedding, as the Hub's and transformers 5's saves name it, and as loaded
_EMBEDS = ("text_model.model.embed_tokens.weight", "model.text_model.embed_tokens.weight")
_VISUAL_PREFIX = "<|visual token"  # vocabulary_map names of the image tokens
_EOL = "<|extra_200|>"  # ends each row of an image's codes (HF's eol_token_id)
_SKIPPED = ("vqmodel.decoder.", "vqmodel.post_quant_conv.")  # the VQ-VAE's decoder half


def code_tokens(config: Any) -> list[int]:
    """Codebook index -> its image token id (a list over vq_config.codebook_size codes), then
    the end-of-line token's id last; ValueError naming vocabulary_map where one is missing.
    A code's name ends in its six digits and "|>" (HF reads name[-8:-2])."""
    vocab = getattr(config, "vocabulary_map", None) or {}
    count = int(config.vq_config.codebook_size)
    mapping = {int(n[-8:-2]): int(t) for n, t in vocab.items() if n.startswith(_VISUAL_PREFIX)}
    missing = [c for c in range(count) if c not in mapping]
    if missing:
        raise ValueError(
            f"vocabulary_map has no image token ({_VISUAL_PREFIX}NNNNNN|>) for {len(missing)} "
            f"of the {count} codebook indices of vq_config.codebook_size (first: {missing[0]})"
        )
    if _EOL not in vocab:
        raise ValueError(f"vocabulary_map has no {_EOL} token (the end of an image's rows)")
    ids = [mapping[c] for c in range(count)] + [int(vocab[_EOL])]
    vocab_size = int(config.text_config.vocab_size)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"vocabulary_map's image token id {bad[0]} is past vocab_size")
    return ids


class Emu3ImageEncoder(nn.Module):
    """Images -> rows of the text embedding (one per placeholder, see the module)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.vqmodel = Emu3VQVAE(config.vq_config)
        tokens = torch.tensor(code_tokens(config), dtype=torch.long)
        self.register_buffer("code_tokens", tokens, persistent=False)  # [K + 1] token ids
        self.eol = len(tokens) - 1  # image_rows' index of the end-of-line row
        # the text embedding's row of each code's image token, then the end-of-line token's
        hidden = int(config.text_config.hidden_size)
        self.image_rows = nn.Parameter(torch.empty(len(tokens), hidden))
        self.image_rows.weight_loader = self._load_rows

    def _load_rows(self, param: nn.Parameter, table: torch.Tensor) -> None:
        """Takes the whole text embedding [vocab, hidden] and keeps the image rows."""
        if table.dim() != 2 or table.shape[1] != param.shape[1]:
            raise ValueError(f"embedding {tuple(table.shape)}, expected [vocab, {param.shape[1]}]")
        param.data.copy_(table[self.code_tokens.cpu()])

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, H, W] -> [N, h(w+1), D]
        codes = self.vqmodel(pixels)  # [N, h, w]
        eol = codes.new_full((*codes.shape[:2], 1), self.eol)
        return self.image_rows[torch.cat([codes, eol], dim=2).flatten(1)]

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each image's rows; images of one size in one batch."""
        weight = self.image_rows
        out: list[torch.Tensor | None] = [None] * len(images)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, m in enumerate(images):
            assert m.pixel_values is not None  # (no embeds: Emu3Layout.takes_embeds is False)
            by_shape.setdefault(tuple(m.pixel_values.shape), []).append(i)
        for group in by_shape.values():
            pixels = torch.stack([images[i].pixel_values for i in group])  # type: ignore[misc]
            for i, rows in zip(group, self(pixels.to(weight.device, weight.dtype)), strict=True):
                out[i] = rows
        return out  # type: ignore[return-value]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `[model.]vqmodel.*` encoder-side tensors and its token embedding (the
        image rows kept); the decoder half, BatchNorm counters and every other name passed
        over; ValueError naming a missing or unexpected one."""

        def ours(name: str) -> str | None:
            if name in _EMBEDS:
                return "image_rows"
            name = name.removeprefix("model.")
            if not name.startswith("vqmodel.") or name.startswith(_SKIPPED):
                return None
            return None if name.endswith(".num_batches_tracked") else name

        picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)


class Emu3Layout(Layout):
    """Each <image> -> boi, "{h}*{w}", the wrapper token, h * (w + 1) placeholders, eof, eoi;
    size = (H, W) pixels, pixels [3, H, W]."""

    takes_embeds = False  # the segment's "{h}*{w}" needs the grid, which rows do not give

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        self.config = config
        self.placeholder = placeholder
        self.fixed = None
        self.factor = spatial_factor(config.vq_config)
        self.tokenizer = tokenizer
        bos = getattr(tokenizer, "bos_token_id", None)
        self.bos: int | None = None if bos is None else int(bos)  # None: no bos to add

        def name(attr: str, default: str) -> str:
            return getattr(tokenizer, attr, None) or default

        self.boi, self.wrapper, self.eof, self.eoi = token_ids(
            tokenizer,
            name("boi_token", "<|image start|>"),
            name("image_wrapper_token", "<|image token|>"),
            name("eof_token", "<|extra_201|>"),
            name("eoi_token", "<|image end|>"),
        )

    def grid(self, size: Size) -> tuple[int, int]:
        """(h, w) codes of an image of `size` (H, W) pixels; ValueError unless whole codes."""
        f = self.factor
        if size is None or len(size) != 2 or min(size) < f or size[0] % f or size[1] % f:
            raise ValueError(
                f"multi_modal_data['image']: image size {size} is not whole {f} x {f}-pixel "
                "codes (the VQ-VAE's spatial factor): check the image processor's "
                "spatial_factor / min_pixels / max_pixels"
            )
        return size[0] // f, size[1] // f

    def length(self, size: Size) -> int:
        h, w = self.grid(size)
        return h * (w + 1)

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        assert size is not None and len(size) == 2
        return (3, size[0], size[1])

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])
        height, width = (int(x) for x in out["image_sizes"][0])
        pixels = out["pixel_values"][0].float()[:, :height, :width]  # (one image: no padding)
        size = (height, width)
        self.grid(size)
        if tuple(pixels.shape) != self.pixel_shape(size):
            raise ValueError(
                f"multi_modal_data['image']: the image processor gave pixel values of shape "
                f"{tuple(pixels.shape)} for an image of {size}, not {self.pixel_shape(size)}"
            )
        return pixels.contiguous(), size

    def header(self, size: Size) -> list[int]:
        """boi, "{h}*{w}" (tokenized alone, as between HF's special tokens), the wrapper."""
        h, w = self.grid(size)
        text = self.tokenizer.encode(f"{h}*{w}", add_special_tokens=False)
        return [self.boi, *text, self.wrapper]

    def segment(self, loaded: Loaded) -> list[int]:
        size = loaded[1]
        run = [self.placeholder] * self.length(size)
        return [*self.header(size), *run, self.eof, self.eoi]

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        return super().place(loaded, at + len(self.header(loaded[1])), segment)

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """The segments in place, after HF's bos (added unless the prompt starts with it)."""
        if self.bos is not None and ids[:1] != [self.bos]:
            ids = [self.bos, *ids]
        return super().splice(ids, segments)
