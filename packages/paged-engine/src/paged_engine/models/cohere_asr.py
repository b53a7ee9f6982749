"""Cohere ASR (`CohereAsrForConditionalGeneration`, transformers' layout): a Parakeet
(FastConformer) encoder and a pre-LN Transformer decoder with learned absolute positions.

    clip -> log-mel [valid, mels] (multimodal/cohere_asr.py) -> ParakeetEncoder
        (multimodal/nemotron_h_omni_audio.py's, transformers' `ParakeetEncoder` names)
        -> [L, E], L = subsample(valid) -> decoder.proj (E -> D) -> each layer's cross K / V
    decoder token t at position p: LN(embed(t) + pos_emb(p)) -> per layer:
        x += self_attn(LN(x)) (causal, paged KV cache, no rotary); x += cross_attn(LN(x)) over
        the clip's L rows; x += fc2(act(fc1(LN(x)))) -> norm -> proj_out (with a bias)

Served as Moonshine is (models/moonshine.py): the encoder runs once per clip when a sequence
holding it first runs, its cross K / V go to a slot of the cross-attention pool
(worker/cross_attention.py) through `cross_plan` / `encode_cross` / `cross_dims`. A slot holds
the rows of a WINDOW_SECONDS clip; transformers' extractor splits clips longer than
max_audio_clip_s - overlap_chunk_second (30 s by default) itself, the routes split them here.
HF's encoder rows past subsample(valid) are masked out of the cross-attention: the host keeps
only the valid frames, which gives the same kept rows (the convolutions' zero padding equals
HF's zeroed padding rows; relative positions depend on offsets only).

vLLM reads the Hub's NeMo-style config fields (`transf_decoder`, `encoder`, `head`); this file
reads transformers' (CohereAsrConfig, `encoder_config`), the reference the tests compare with.
Refused by name (`cohere_asr_engine_config`): a config whose `transf_decoder` disagrees with
transformers' fields (a NeMo-only config read with CohereAsrConfig's defaults), max_model_len over
config.max_position_embeddings, grouped KV heads (config.num_key_value_heads),
tensor_parallel_size not dividing config.num_attention_heads.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.attention import Attention
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from paged_engine.layers.norm import LayerNorm
from paged_engine.models.encoder_decoder import CrossPlan, fit_decoder_length, tp_divides_heads
from paged_engine.models.utils import CausalLMBase
from paged_engine.multimodal.inputs import ImageInput

if TYPE_CHECKING:
    from paged_engine.worker.cross_attention import CrossBatch

ARCH = "CohereAsrForConditionalGeneration"
SAMPLE_RATE = 16000
HOP = 160  # feature frames a second: SAMPLE_RATE / HOP (the host refuses other extractors)
WINDOW_SECONDS = 30  # the longest clip a request takes (a slot's rows); the routes split

# the checkpoint's names (transformers' conversion_mapping.py "cohere_asr", reversed on save) ->
# ours, applied in order as substring replacements; transformers' own names pass unchanged
_RENAMES = (
    ("encoder.pre_encode.conv.", "encoder.subsampling.layers."),
    ("encoder.pre_encode.out.", "encoder.subsampling.linear."),
    (".self_attn.linear_q.", ".self_attn.q_proj."),
    (".self_attn.linear_k.", ".self_attn.k_proj."),
    (".self_attn.linear_v.", ".self_attn.v_proj."),
    (".self_attn.linear_out.", ".self_attn.o_proj."),
    (".self_attn.linear_pos.", ".self_attn.relative_k_proj."),
    (".self_attn.pos_bias_u", ".self_attn.bias_u"),
    (".self_attn.pos_bias_v", ".self_attn.bias_v"),
    (".conv.batch_norm.", ".conv.norm."),
    ("transf_decoder._embedding.position_embedding.pos_enc", "decoder.pos_emb.weight"),
    ("transf_decoder._embedding.token_embedding.", "decoder.embed_tokens."),
    ("transf_decoder._embedding.layer_norm.", "decoder.embedding_layernorm."),
    ("transf_decoder._decoder.final_layer_norm.", "decoder.norm."),
    ("transf_decoder._decoder.layers.", "decoder.layers."),
    ("encoder_decoder_proj.", "decoder.proj."),
    (".first_sub_layer.", ".self_attn."),
    (".second_sub_layer.", ".encoder_attn."),
    (".query_net.", ".q_proj."),
    (".key_net.", ".k_proj."),
    (".value_net.", ".v_proj."),
    (".out_projection.", ".o_proj."),
    (".third_sub_layer.dense_in.", ".fc1."),
    (".third_sub_layer.dense_out.", ".fc2."),
    (".mlp.fc", ".fc"),  # transformers' names: the MLP's fc1 / fc2 sit on our layer
    (".layer_norm_1.", ".input_layernorm."),
    (".layer_norm_2.", ".post_attention_layernorm."),
    (".layer_norm_3.", ".final_layernorm."),
    ("log_softmax.mlp.layer0.", "proj_out."),
)


def subsample(frames: int, encoder_config: Any) -> int:
    """Encoder rows of `frames` feature frames (imported here: multimodal/ imports models/)."""
    from paged_engine.multimodal.nemotron_h_omni_audio import subsample as parakeet_rows

    return parakeet_rows(frames, encoder_config)


def slot_rows(hf_config: Any) -> int:
    """A cross-attention slot's rows: the encoder rows of a WINDOW_SECONDS clip."""
    return subsample(WINDOW_SECONDS * SAMPLE_RATE // HOP, hf_config.encoder_config)


def cohere_asr_engine_config(config: Any, hf_config: Any) -> None:
    """Refuse (ValueError naming the field) what this path cannot run; set max_model_len."""
    # the Hub's NeMo fields (vLLM reads them) must describe the decoder transformers' fields do:
    # a config holding only them loads here with CohereAsrConfig's defaults
    nemo = (getattr(hf_config, "transf_decoder", None) or {}).get("config_dict", {})
    for field, ours in (("hidden_size", "hidden_size"), ("num_layers", "num_hidden_layers")):
        if field in nemo and int(nemo[field]) != int(getattr(hf_config, ours)):
            raise ValueError(
                f"config.transf_decoder's {field}={nemo[field]} differs from config.{ours}="
                f"{getattr(hf_config, ours)}: a NeMo-style {ARCH} config without transformers' "
                "fields (CohereAsrConfig with encoder_config) is not supported"
            )
    fit_decoder_length(
        config, int(hf_config.max_position_embeddings), "config.max_position_embeddings"
    )
    heads = int(hf_config.num_attention_heads)
    kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    if kv != heads:
        raise ValueError(
            f"config.num_key_value_heads={kv} != {heads} heads: not supported for {ARCH}"
        )
    tp_divides_heads(config, heads, "config.num_attention_heads")


def _head_dim(config: Any) -> int:
    return int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )


class CohereAsrProjections(nn.Module):
    """q / k / v / o of one decoder attention (biases per config.attention_bias), heads split
    over TP ranks."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        d, heads, bias = (
            int(config.hidden_size),
            int(config.num_attention_heads),
            bool(config.attention_bias),
        )
        self.head_dim = _head_dim(config)
        inner = heads * self.head_dim
        self.q_proj = ColumnParallelLinear(d, inner, bias=bias)
        self.k_proj = ColumnParallelLinear(d, inner, bias=bias)
        self.v_proj = ColumnParallelLinear(d, inner, bias=bias)
        self.o_proj = RowParallelLinear(inner, d, bias=bias)
        self.num_heads = self.q_proj.out_local // self.head_dim  # this rank's heads
        self.scale = self.head_dim**-0.5

    def kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[L, D] projected encoder rows -> (k, v) each [L, H, Dh]."""
        shape = (x.shape[0], self.num_heads, self.head_dim)
        return self.k_proj(x).view(shape), self.v_proj(x).view(shape)


class CohereAsrDecoderLayer(nn.Module):
    def __init__(self, config: Any, index: int) -> None:
        super().__init__()
        d = int(config.hidden_size)
        self.index = index  # its cross K / V in a CrossBatch
        self.self_attn = CohereAsrProjections(config)
        local, hd = self.self_attn.num_heads, self.self_attn.head_dim
        self.attn = Attention(local, hd, local, self.self_attn.scale)
        self.encoder_attn = CohereAsrProjections(config)
        ffn = int(config.intermediate_size)
        self.fc1 = ColumnParallelLinear(d, ffn, bias=True)
        self.fc2 = RowParallelLinear(ffn, d, bias=True)
        self.act = get_act_fn(config.hidden_act, "hidden_act")
        self.input_layernorm = LayerNorm(d)
        self.post_attention_layernorm = LayerNorm(d)
        self.final_layernorm = LayerNorm(d)

    def forward(self, x, kv_cache, md, cross: CrossBatch | None) -> torch.Tensor:
        a = self.self_attn  # x: [T, D]
        h = self.input_layernorm(x)
        x = x + a.o_proj(self.attn(a.q_proj(h), a.k_proj(h), a.v_proj(h), kv_cache, md))
        if cross is not None:  # None only in the memory profiler's forward
            c = self.encoder_attn
            q = c.q_proj(self.post_attention_layernorm(x))
            x = x + c.o_proj(cross.attend(self.index, q, c.scale))
        return x + self.fc2(self.act(self.fc1(self.final_layernorm(x))))


class CohereAsrDecoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        d = int(config.hidden_size)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, d)
        self.pos_emb = nn.Embedding(int(config.max_position_embeddings), d)  # the sinusoid table
        self.embedding_layernorm = LayerNorm(d)
        self.proj = nn.Linear(int(config.encoder_config.hidden_size), d)  # encoder rows -> D
        self.layers = nn.ModuleList(
            CohereAsrDecoderLayer(config, i) for i in range(int(config.num_hidden_layers))
        )
        self.norm = LayerNorm(d)

    def forward(self, input_ids, positions, kv_caches, md, cross) -> torch.Tensor:
        x = self.embedding_layernorm(self.embed_tokens(input_ids) + self.pos_emb(positions))
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, kv_cache, md, cross)
        return self.norm(x)


class CohereAsrModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        from paged_engine.multimodal.nemotron_h_omni_audio import ParakeetEncoder

        self.encoder = ParakeetEncoder(config.encoder_config)
        self.decoder = CohereAsrDecoder(config)
        self.cross: CrossBatch | None = None  # bound by the runner for one forward

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        assert hidden is None, "Cohere ASR runs in one pipeline stage"
        return self.decoder(input_ids, positions, kv_caches, md, self.cross)


class CohereAsrForConditionalGeneration(CausalLMBase):
    embed_path = "model.decoder.embed_tokens"
    head_name = "proj_out"
    head_bias = True
    ignored_weights = ("num_batches_tracked",)

    def __init__(self, config: Any) -> None:
        super().__init__(config, CohereAsrModel(config))

    @staticmethod
    def kv_cache_layout(config: Any) -> list[tuple[int, int]]:
        """The decoder's self-attention layers."""
        return [(int(config.num_attention_heads), _head_dim(config))] * int(
            config.num_hidden_layers
        )

    def num_decoder_layers(self) -> int:
        # weight names index the encoder's convolutions and both stacks' layers; one pipeline
        # stage holds them all
        stacks = (
            self.model.encoder.subsampling.layers,
            self.model.encoder.layers,
            self.model.decoder.layers,
        )
        return max(len(s) for s in stacks)

    def rename_weight(self, name: str) -> str:
        """The Hub's NeMo-derived names (what transformers reads and writes) -> ours."""
        for hub, ours in _RENAMES:
            name = name.replace(hub, ours)
        return name

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        """BatchNorm running statistics are buffers: copied here, the rest by CausalLMBase."""
        buffers = {n: b for n, b in self.named_buffers() if ".running_" in n}

        def params() -> Iterator[tuple[str, torch.Tensor]]:
            for name, w in weights:
                if self.rename_weight(name) in buffers:
                    with torch.no_grad():
                        buffers.pop(self.rename_weight(name)).copy_(w)
                else:
                    yield name, w

        loaded = super().load_weights(params(), strict)
        if strict and buffers:
            raise ValueError(f"the checkpoint has no {next(iter(buffers))} for the encoder")
        return loaded

    def cross_dims(self) -> tuple[int, int, int, int]:
        """(cross-attention layers, this rank's query heads and K / V heads, head_dim)."""
        layers = self.model.decoder.layers
        a = layers[0].encoder_attn
        return len(layers), a.num_heads, a.num_heads, a.head_dim

    def cross_plan(self, items: Sequence[ImageInput]) -> CrossPlan:
        """A sequence's clip (its valid log-mel frames) as a slot's content: its encoder rows,
        all seen by every decoder row."""
        audio = [m for m in items if m.pixel_values is not None]
        if len(audio) != 1:
            raise RuntimeError(f"a sequence reached the worker with {len(audio)} audios")
        m = audio[0]
        rows = subsample(int(m.pixel_values.shape[0]), self.config.encoder_config)  # type: ignore[union-attr]
        return CrossPlan(m.mm_hash, rows, (rows,), 0, rows, m.pixel_values)

    def encode_cross(self, payloads: list[torch.Tensor]) -> Iterator[tuple[torch.Tensor, ...]]:
        """Clips' features [valid, mels] -> per decoder layer (k, v) [their rows, H, Dh], the
        clips' rows one after another; one clip an encoder call."""
        dec = self.model.decoder
        w = dec.proj.weight
        rows = [self.model.encoder(p.to(w.device, w.dtype), int(p.shape[0])) for p in payloads]
        frames = dec.proj(torch.cat(rows))
        for layer in dec.layers:
            yield layer.encoder_attn.kv(frames)
