"""Moonshine (`MoonshineForConditionalGeneration`): a raw-waveform encoder and a rotary decoder.

    wave [N] (16 kHz, any length up to WINDOW_SECONDS) -> the encoder
        (multimodal/moonshine_encoder.py: three convolutions, rotary pre-LN layers) -> [L, D]
    decoder token t at position p: embed(t) -> per layer:
        self-attention (causal, rotary at p, paged KV cache) -> cross-attention to the clip's
        L frames (no positions) -> gated MLP (fc1 -> [h | g], act(g) * h -> fc2), each pre-LN
        (LayerNorm without bias) with a residual -> final LN -> proj_out (tied to the embedding)

The rotary embedding turns interleaved pairs (x0, x1), (x2, x3), ... over the first
head_dim * partial_rotary_factor dims (transformers' `rotate_half` here is GPT-J's).
config.pad_head_dim_to_multiple_of is not applied: transformers pads q / k / v with zero dims
(the scale stays head_dim ** -0.5) and drops them after, the same products.

Served as Whisper is (models/whisper.py): the encoder runs once per clip, when a sequence
holding it first runs a step, and each decoder layer's cross K / V go to a slot of the
cross-attention pool (worker/cross_attention.py) through this model's `cross_plan` /
`encode_cross` / `cross_dims` hooks (Mllama's, models/mllama.py). Unlike Whisper's fixed 30 s
window a clip's frames vary with its length: a slot holds the frames of a WINDOW_SECONDS clip
and a sequence's plan names its own L rows (its decoder rows see all L). The decoder's heads
are split over TP ranks; the encoder runs whole on every rank.

Refused by name (`moonshine_engine_config`, beside worker/cross_attention.py's refusals):
a max_model_len over config.max_position_embeddings, tensor_parallel_size not dividing the
decoder heads, encoder and decoder head counts that differ, grouped KV heads (transformers'
attention views its queries with the KV head count: only num_key_value_heads = heads runs
there), a rope scaling.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.attention import Attention
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from paged_engine.layers.norm import LayerNorm
from paged_engine.layers.rotary import RotaryEmbedding, rope_config
from paged_engine.models.encoder_decoder import CrossPlan, fit_decoder_length, tp_divides_heads
from paged_engine.models.utils import CausalLMBase
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.moonshine_encoder import MoonshineEncoder, encoder_frames

if TYPE_CHECKING:
    from paged_engine.worker.cross_attention import CrossBatch

ARCH = "MoonshineForConditionalGeneration"
SAMPLE_RATE = 16000  # the convolutions' strides are set for 16 kHz
WINDOW_SECONDS = 30  # the longest clip a request takes (a slot's frames); the routes split


def slot_rows(hf_config: Any) -> int:
    """A cross-attention slot's rows: the frames of a WINDOW_SECONDS clip."""
    return encoder_frames(WINDOW_SECONDS * SAMPLE_RATE)


def moonshine_engine_config(config: Any, hf_config: Any) -> None:
    """Refuse (ValueError naming the field) what Moonshine cannot run; set max_model_len."""
    limit = int(hf_config.max_position_embeddings)
    fit_decoder_length(config, limit, "config.max_position_embeddings", "rotary")
    heads = int(hf_config.decoder_num_attention_heads)
    fields = {
        "encoder_num_attention_heads": int(hf_config.encoder_num_attention_heads),
        "encoder_num_key_value_heads": int(hf_config.encoder_num_key_value_heads),
        "decoder_num_key_value_heads": int(hf_config.decoder_num_key_value_heads),
    }
    for name, value in fields.items():
        if value != heads:
            raise ValueError(
                f"config.{name}={value} differs from decoder_num_attention_heads={heads}: "
                f"not supported for {ARCH} (transformers' Moonshine attention runs one head "
                "count for queries, keys and values in both stacks)"
            )
    tp_divides_heads(config, heads, "config.decoder_num_attention_heads")
    if rope_config(hf_config)[1] is not None:
        raise ValueError(f"config.rope_parameters: a rope scaling is not supported for {ARCH}")


class MoonshineProjections(nn.Module):
    """q / k / v / o of one decoder attention, heads split over TP ranks; o has no bias."""

    def __init__(self, d: int, heads: int, bias: bool) -> None:
        super().__init__()
        self.head_dim = d // heads
        self.q_proj = ColumnParallelLinear(d, d, bias=bias)
        self.k_proj = ColumnParallelLinear(d, d, bias=bias)
        self.v_proj = ColumnParallelLinear(d, d, bias=bias)
        self.o_proj = RowParallelLinear(d, d, bias=False)
        self.num_heads = self.q_proj.out_local // self.head_dim  # this rank's heads
        self.scale = self.head_dim**-0.5

    def kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[L, D] encoder frames -> (k, v) each [L, H, Dh] (the cache's token-major rows)."""
        shape = (x.shape[0], self.num_heads, self.head_dim)
        return self.k_proj(x).view(shape), self.v_proj(x).view(shape)


class MoonshineDecoderMLP(nn.Module):
    """fc1 -> [h | g] (the checkpoint's one fc1, loaded as two shards so TP splits each half)
    -> act(g) * h -> fc2."""

    def __init__(self, d: int, ffn: int, act: str) -> None:
        super().__init__()
        self.fc1 = MergedColumnParallelLinear(d, [ffn, ffn], bias=True)
        self.fc2 = RowParallelLinear(ffn, d, bias=True)
        self.act = get_act_fn(act, "decoder_hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, g = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(self.act(g) * h)


class MoonshineDecoderLayer(nn.Module):
    def __init__(self, config: Any, index: int) -> None:
        super().__init__()
        d, heads = int(config.hidden_size), int(config.decoder_num_attention_heads)
        bias = bool(config.attention_bias)
        self.index = index  # its cross K / V in a CrossBatch
        self.self_attn = MoonshineProjections(d, heads, bias)
        local = self.self_attn.num_heads
        self.attn = Attention(local, self.self_attn.head_dim, local, self.self_attn.scale)
        self.encoder_attn = MoonshineProjections(d, heads, bias)
        self.mlp = MoonshineDecoderMLP(d, int(config.intermediate_size), config.decoder_hidden_act)
        self.input_layernorm = LayerNorm(d, bias=False)
        self.post_attention_layernorm = LayerNorm(d, bias=False)
        self.final_layernorm = LayerNorm(d, bias=False)

    def forward(self, x, positions, rope, kv_cache, md, cross: CrossBatch | None) -> torch.Tensor:
        a = self.self_attn  # x: [T, D]
        h = self.input_layernorm(x)
        q, k = rope(positions, a.q_proj(h), a.k_proj(h))
        x = x + a.o_proj(self.attn(q, k, a.v_proj(h), kv_cache, md))
        if cross is not None:  # None only in the memory profiler's forward
            c = self.encoder_attn
            q = c.q_proj(self.post_attention_layernorm(x))
            x = x + c.o_proj(cross.attend(self.index, q, c.scale))
        return x + self.mlp(self.final_layernorm(x))


class MoonshineDecoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        d = int(config.hidden_size)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, d)
        self.layers = nn.ModuleList(
            MoonshineDecoderLayer(config, i) for i in range(int(config.decoder_num_hidden_layers))
        )
        self.norm = LayerNorm(d, bias=False)

    def forward(self, input_ids, positions, rope, kv_caches, md, cross) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, D]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, rope, kv_cache, md, cross)
        return self.norm(x)


class MoonshineModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        head_dim = int(config.hidden_size) // int(config.decoder_num_attention_heads)
        theta, _, partial = rope_config(config)
        # one table for both stacks: decoder positions and a full slot's encoder frames
        limit = int(config.max_position_embeddings)
        self.rotary_emb = RotaryEmbedding(
            head_dim,
            int(head_dim * partial),
            limit,
            theta,
            is_neox_style=False,
            num_positions=max(limit, slot_rows(config)),
        )
        self.encoder = MoonshineEncoder(config, self.rotary_emb)
        self.decoder = MoonshineDecoder(config)
        # the step's cross-attention inputs, bound by the runner for one forward
        self.cross: CrossBatch | None = None

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        assert hidden is None, "Moonshine runs in one pipeline stage"
        return self.decoder(input_ids, positions, self.rotary_emb, kv_caches, md, self.cross)


class MoonshineForConditionalGeneration(CausalLMBase):
    embed_path = "model.decoder.embed_tokens"
    head_name = "proj_out"
    tie_default = True
    # the checkpoint's fc1 [2 * ffn, D], split in `convert_weight`, into our merged halves
    stacked_params = ((".mlp.fc1", ".mlp.fc1_h", 0), (".mlp.fc1", ".mlp.fc1_g", 1))

    def __init__(self, config: Any) -> None:
        super().__init__(config, MoonshineModel(config))

    @staticmethod
    def kv_cache_layout(config: Any) -> list[tuple[int, int]]:
        """The decoder's self-attention layers."""
        heads = int(config.decoder_num_attention_heads)
        return [(heads, int(config.hidden_size) // heads)] * int(config.decoder_num_hidden_layers)

    def num_decoder_layers(self) -> int:
        # weight names index encoder and decoder layers; one pipeline stage holds both
        c = self.config
        return max(int(c.encoder_num_hidden_layers), int(c.decoder_num_hidden_layers))

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.startswith("model.decoder.") and ".mlp.fc1." in name:
            h, g = w.chunk(2, dim=0)
            return (name.replace(".fc1.", ".fc1_h."), h), (name.replace(".fc1.", ".fc1_g."), g)
        return ((name, w),)

    def cross_dims(self) -> tuple[int, int, int, int]:
        """(cross-attention layers, this rank's query heads and K / V heads, head_dim)."""
        layers = self.model.decoder.layers
        a = layers[0].encoder_attn
        return len(layers), a.num_heads, a.num_heads, a.head_dim

    def cross_plan(self, items: Sequence[ImageInput]) -> CrossPlan:
        """A sequence's clip (its samples) as a slot's content: its frames, all seen by every
        decoder row."""
        audio = [m for m in items if m.pixel_values is not None]
        if len(audio) != 1:
            raise RuntimeError(f"a sequence reached the worker with {len(audio)} audios")
        m = audio[0]
        rows = encoder_frames(int(m.pixel_values.numel()))  # type: ignore[union-attr]
        return CrossPlan(m.mm_hash, rows, (rows,), 0, rows, m.pixel_values)

    def encode_cross(self, payloads: list[torch.Tensor]) -> Iterator[tuple[torch.Tensor, ...]]:
        """Clips' samples -> per decoder layer (k, v) [their frames, H, Dh], the clips' rows
        one after another; one clip an encoder call (see moonshine_encoder.py)."""
        w = self.model.encoder.conv1.weight
        frames = torch.cat([self.model.encoder(p.to(w.device, w.dtype)) for p in payloads])
        for layer in self.model.decoder.layers:
            yield layer.encoder_attn.kv(frames)
