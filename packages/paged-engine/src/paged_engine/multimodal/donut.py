"""Donut (transformers' VisionEncoderDecoderModel of a "donut-swin" encoder and an "mbart"
decoder, MBartForCausalLM; vLLM 0.10's `DonutForConditionalGeneration`): the Swin tower's rows
are the encoder hidden states an mBART decoder cross-attends to. There is no text encoder.

    pixels [3, H, W] -> DonutSwin (multimodal/donut_swin.py) -> [h * w, C_last]
        -> enc_to_dec_proj (Linear C_last -> d_model) where the checkpoint has it (transformers
        adds it where encoder.hidden_size != decoder.hidden_size and the decoder sets no
        cross_attention_hidden_size; the released Donut checkpoints have none) -> [h * w, D]
    decoder token t at position p: embed_tokens(t) * embed_scale + learned position (p + 2)
        -> layernorm_embedding -> per layer (pre-norm): self-attention (paged KV cache),
        cross-attention to the h * w rows, MLP -> layer_norm -> lm_head

The decoder is models/bart.py's mBART decoder (its layers and stack, pre-norm); the head is
tied to embed_tokens where config.decoder.tie_word_embeddings (transformers' MBartForCausalLM
rule; the wrapper's own tie_word_embeddings is always False), else the checkpoint's
decoder.lm_head. Checkpoint names: `encoder.*` (the tower, donut_swin.SWIN_RENAMES),
`enc_to_dec_proj.*`, `decoder.model.decoder.*` -> `model.*`, `decoder.lm_head.*` -> `lm_head.*`.
vLLM 0.10 ran the same math (its SwinModel has no final norm, no projection) with the
architecture overridden to DonutForConditionalGeneration; both names are served here.

Served as Florence-2 is (the cross-attention slots of worker/cross_attention.py): a sequence's
one item, the image's pixels (multimodal/donut_prompt.py), is a slot's content, encoded once
(`encode_cross`); a slot holds the rows of config.encoder.image_size. The tower runs whole on
every tensor-parallel rank; the decoder's heads are split as BART's. Refused by name
(`donut_engine_config`): a VisionEncoderDecoderModel of another encoder / decoder pairing,
limit_mm_per_prompt's image count other than 1, a max_model_len over the decoder's position
table, tensor_parallel_size not dividing its heads, what donut_swin.check_swin refuses.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.models.bart import BartDecoderLayer, BartStack
from paged_engine.models.encoder_decoder import (
    CrossPlan,
    fit_decoder_length,
    lift_fields,
    one_image_a_prompt,
    tp_divides_heads,
)
from paged_engine.models.utils import CausalLMBase
from paged_engine.multimodal.donut_swin import SWIN_RENAMES, DonutSwin, check_swin, swin_grid
from paged_engine.multimodal.inputs import ImageInput

ARCH = "DonutForConditionalGeneration"
VED = "VisionEncoderDecoderModel"
PAIRING = ("donut-swin", "mbart")  # (encoder.model_type, decoder.model_type)
# the decoder's fields the engine reads at the top level of the wrapper's config (MBartConfig's
# num_hidden_layers / num_attention_heads name its encoder's: set from the decoder's below)
_DECODER_FIELDS = (
    "vocab_size",
    "d_model",
    "hidden_size",
    "max_position_embeddings",
    "decoder_layers",
    "decoder_attention_heads",
    "decoder_ffn_dim",
    "activation_function",
    "scale_embedding",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "decoder_start_token_id",
)


def is_donut(hf_config: Any) -> bool:
    """A Donut checkpoint by its architecture; a VisionEncoderDecoderModel of any pairing
    counts (donut_engine_config refuses the others by name)."""
    archs = getattr(hf_config, "architectures", None) or ()
    return ARCH in archs or VED in archs


def donut_engine_config(config: Any, hf_config: Any) -> None:
    """Refuse (ValueError naming the field) what Donut cannot run; put the decoder's fields at
    the top level; set max_model_len to the decoder's position table."""
    enc, dec = getattr(hf_config, "encoder", None), getattr(hf_config, "decoder", None)
    pairing = (getattr(enc, "model_type", None), getattr(dec, "model_type", None))
    if pairing != PAIRING:
        raise ValueError(
            f"{VED} with encoder.model_type={pairing[0]!r} and decoder.model_type="
            f"{pairing[1]!r} is not supported: only Donut's pairing (encoder 'donut-swin', "
            "decoder 'mbart') is served"
        )
    check_swin(enc)
    one_image_a_prompt(config, "Donut")
    lift_fields(hf_config, dec, _DECODER_FIELDS)
    hf_config.num_hidden_layers = int(dec.decoder_layers)
    hf_config.num_attention_heads = int(dec.decoder_attention_heads)
    fit_decoder_length(config, int(dec.max_position_embeddings), "decoder.max_position_embeddings")
    tp_divides_heads(config, int(dec.decoder_attention_heads), "decoder.decoder_attention_heads")


def slot_rows(hf_config: Any) -> int:
    """A slot's rows: the tower's map for config.encoder.image_size (the processor's size)."""
    h, w = swin_grid(*_image_size(hf_config.encoder), hf_config.encoder)
    return h * w


def _image_size(enc: Any) -> tuple[int, int]:
    size = enc.image_size
    return (int(size[0]), int(size[1])) if isinstance(size, (list, tuple)) else (size, size)


def projects(hf_config: Any) -> bool:
    """transformers' rule for enc_to_dec_proj."""
    enc, dec = hf_config.encoder, hf_config.decoder
    return int(enc.hidden_size) != int(dec.hidden_size) and (
        getattr(dec, "cross_attention_hidden_size", None) is None
    )


class MBartDecoder(BartStack):
    """transformers' MBartDecoder (decoder.model.decoder.*): models/bart.py's pre-norm decoder
    layers with its own token embedding."""

    def __init__(self, dec: Any) -> None:
        layers = [BartDecoderLayer(dec, i, pre_norm=True) for i in range(int(dec.decoder_layers))]
        super().__init__(dec, layers, pre_norm=True)
        d = int(dec.d_model)
        self.embed_tokens = VocabParallelEmbedding(int(dec.vocab_size), d)
        self.embed_scale = math.sqrt(d) if getattr(dec, "scale_embedding", False) else 1.0
        self.cross: Any = None  # the step's CrossBatch, bound by the runner for one forward

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        assert hidden is None, "Donut runs in one pipeline stage"
        x = self.embed(self.embed_tokens(input_ids) * self.embed_scale, positions)  # [T, D]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, kv_cache, md, self.cross)
        return self.finish(x)


class DonutForConditionalGeneration(CausalLMBase):
    """The mBART decoder (`model`, its head) with the Swin tower and projection beside it."""

    embed_path = "model.embed_tokens"
    tie_default = True  # MBartConfig's default
    # the tower's recomputed buffer (donut_swin._relative_index)
    ignored_weights = ("relative_position_index",)

    def __init__(self, config: Any) -> None:
        dec = config.decoder
        CausalLMBase.__init__(self, dec, MBartDecoder(dec))
        self.wrapper_config = config
        self.encoder = DonutSwin(config.encoder)
        width, d = int(config.encoder.hidden_size), int(dec.d_model)
        self.enc_to_dec_proj = nn.Linear(width, d) if projects(config) else None

    @staticmethod
    def kv_cache_layout(config: Any) -> list[tuple[int, int]]:
        """The decoder's self-attention layers."""
        dec = getattr(config, "decoder", config)
        heads = int(dec.decoder_attention_heads)
        return [(heads, int(dec.d_model) // heads)] * int(dec.decoder_layers)

    def num_decoder_layers(self) -> int:
        # weight names index Swin stages and decoder layers; one pipeline stage holds both
        return max(len(self.wrapper_config.encoder.depths), int(self.config.decoder_layers))

    def rename_weight(self, name: str) -> str:
        if name.startswith("decoder.model.decoder."):
            return "model." + name[len("decoder.model.decoder.") :]
        if name.startswith("decoder.lm_head."):
            return name[len("decoder.") :]
        if name.startswith("encoder."):
            for theirs, ours in SWIN_RENAMES:
                name = name.replace(theirs, ours)
        return name

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """One image's pixels [3, H, W] -> the rows the decoder cross-attends to [h * w, D]."""
        dtype = self.encoder.embeddings.norm.weight.dtype
        rows = self.encoder(pixels[None].to(dtype))[0]
        return rows if self.enc_to_dec_proj is None else self.enc_to_dec_proj(rows)

    def cross_dims(self) -> tuple[int, int, int, int]:
        """(cross-attention layers, this rank's query heads and K / V heads, head_dim)."""
        layers = self.model.layers
        a = layers[0].encoder_attn
        return len(layers), a.num_heads, a.num_heads, a.head_dim

    def cross_plan(self, items: Sequence[ImageInput]) -> CrossPlan:
        """A sequence's image as a slot's content: its map's rows, all seen by every row."""
        if len(items) != 1 or items[0].modality != "image":
            raise RuntimeError(f"a Donut sequence reached the worker with {len(items)} items")
        image = items[0]
        pixels = image.pixel_values
        assert pixels is not None
        h, w = swin_grid(int(pixels.shape[-2]), int(pixels.shape[-1]), self.wrapper_config.encoder)
        return CrossPlan(image.mm_hash, h * w, (h * w,), 0, h * w, pixels)

    def encode_cross(self, payloads: list) -> Iterator[tuple[torch.Tensor, ...]]:
        """Images' pixels -> per decoder layer (k, v) [their rows, H, Dh], one image a tower
        call."""
        dev = self.model.embed_tokens.weight.device
        rows = torch.cat([self.encode_image(px.to(dev)) for px in payloads])
        for layer in self.model.layers:
            yield layer.encoder_attn.kv(rows)
