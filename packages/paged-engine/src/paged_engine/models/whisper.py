"""Whisper (`WhisperForConditionalGeneration`): an audio encoder and a text decoder that reads it.

    log-mel [n_mels, 2S] -> the encoder (multimodal/whisper_encoder.py, the tower the audio
        LLMs share: convs, the checkpoint's position table, pre-LN layers, final LN) -> [S, D]
    decoder token t at position p: embed(t) + learned position p -> per layer:
        self-attention (causal, paged KV cache) -> cross-attention to the encoder's S frames
        -> MLP, each pre-LN with a residual -> final LN -> proj_out (tied to the embedding)

What differs from transformers' run: the encoder runs once per audio, when a sequence holding it
first runs a step, and writes each decoder layer's cross K / V into a slot of a pool counted in
the KV cache's memory (worker/cross_attention.py: one slot a clip, shared by forks and beams by
the audio's hash); the decoder's self-attention K / V live in paged's block cache, and the
cross-attention reads its slot's blocks in place through the same paged attention (every query
sees all S frames). The decoder's heads are split over TP ranks; the encoder runs whole on
every rank. transformers scales decoder queries before the product and attends with scale 1;
here the attention applies head_dim ** -0.5 itself (the same up to rounding). `scale_embedding`
is read by neither (transformers 5 computes the scale and never applies it). The memory
profiler's forward has no audio: the cross-attention is skipped there.

Refused by name (worker/cross_attention.py `encoder_decoder_engine_config`):
speculative_config, pipeline_parallel_size > 1, enable_prompt_embeds, enable_lora,
compilation_config, a max_model_len over config.max_target_positions; CUDA graphs are turned
off (enforce_eager). A KV cache too small for one clip's cross K / V and a max_model_len
sequence is refused naming gpu_memory_utilization / cpu_kv_cache_gib / kv_cache_memory_bytes
(`fit_cross_slots`); where it holds fewer such seats than max_num_seqs, max_num_seqs is lowered.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.attention import Attention
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from paged_engine.layers.norm import LayerNorm
from paged_engine.models.utils import CausalLMBase, cfg_get
from paged_engine.multimodal.whisper_encoder import WhisperEncoder

if TYPE_CHECKING:
    from paged_engine.worker.cross_attention import CrossBatch

ARCHITECTURES = ("WhisperForConditionalGeneration",)


class WhisperProjections(nn.Module):
    """q / k / v / out of one decoder attention, heads split over TP ranks; k has no bias."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.head_dim = d // heads
        self.q_proj = ColumnParallelLinear(d, d, bias=True)
        self.k_proj = ColumnParallelLinear(d, d, bias=False)
        self.v_proj = ColumnParallelLinear(d, d, bias=True)
        self.out_proj = RowParallelLinear(d, d, bias=True)
        self.num_heads = self.q_proj.out_local // self.head_dim  # this rank's heads
        self.scale = self.head_dim**-0.5

    def kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, S, D] -> (k, v) each [B, S, H, Dh] (the cache's token-major rows)."""
        b, s, _ = x.shape
        k = self.k_proj(x).view(b, s, self.num_heads, self.head_dim)
        return k, self.v_proj(x).view(b, s, self.num_heads, self.head_dim)


class WhisperDecoderLayer(nn.Module):
    def __init__(self, config, index: int) -> None:
        super().__init__()
        d, heads = config.d_model, config.decoder_attention_heads
        self.index = index  # its cross K / V in a CrossBatch
        self.self_attn = WhisperProjections(d, heads)
        local = self.self_attn.num_heads
        self.attn = Attention(local, self.self_attn.head_dim, local, self.self_attn.scale)
        self.self_attn_layer_norm = LayerNorm(d)
        self.encoder_attn = WhisperProjections(d, heads)
        self.encoder_attn_layer_norm = LayerNorm(d)
        ffn = config.decoder_ffn_dim
        self.fc1 = ColumnParallelLinear(d, ffn, bias=True)
        self.fc2 = RowParallelLinear(ffn, d, bias=True)
        act = cfg_get(config, "activation_function", "gelu")
        self.act = get_act_fn(act, "activation_function")
        self.final_layer_norm = LayerNorm(d)

    def forward(self, x, kv_cache, md, cross: CrossBatch | None) -> torch.Tensor:  # x: [T, D]
        a = self.self_attn
        h = self.self_attn_layer_norm(x)
        x = x + a.out_proj(self.attn(a.q_proj(h), a.k_proj(h), a.v_proj(h), kv_cache, md))
        if cross is not None:  # None only in the memory profiler's forward
            c = self.encoder_attn
            q = c.q_proj(self.encoder_attn_layer_norm(x))
            x = x + c.out_proj(cross.attend(self.index, q, c.scale))
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class WhisperDecoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d = config.d_model
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, d)
        self.embed_positions = nn.Embedding(config.max_target_positions, d)
        self.layers = nn.ModuleList(
            WhisperDecoderLayer(config, i) for i in range(config.decoder_layers)
        )
        self.layer_norm = LayerNorm(d)

    def forward(self, input_ids, positions, kv_caches, md, cross) -> torch.Tensor:
        x = self.embed_tokens(input_ids) + self.embed_positions(positions)  # [T, D]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, kv_cache, md, cross)
        return self.layer_norm(x)


class WhisperModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.encoder = WhisperEncoder(config)
        self.decoder = WhisperDecoder(config)
        # the step's cross-attention inputs, bound by the runner for one forward
        self.cross: CrossBatch | None = None

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        assert hidden is None, "Whisper runs in one pipeline stage"
        return self.decoder(input_ids, positions, kv_caches, md, self.cross)


class WhisperForConditionalGeneration(CausalLMBase):
    embed_path = "model.decoder.embed_tokens"
    head_name = "proj_out"
    tie_default = True

    def __init__(self, config) -> None:
        super().__init__(config, WhisperModel(config))

    @staticmethod
    def kv_cache_layout(config) -> list[tuple[int, int]]:
        """The decoder's self-attention layers (config.num_hidden_layers names the encoder's)."""
        heads = int(config.decoder_attention_heads)
        return [(heads, int(config.d_model) // heads)] * int(config.decoder_layers)

    def num_decoder_layers(self) -> int:
        # weight names index encoder and decoder layers; one pipeline stage holds both
        return max(int(self.config.encoder_layers), int(self.config.decoder_layers))

    def encode(self, features: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """[B, n_mels, 2S] log-mel -> each decoder layer's cross (k, v) in turn, each
        [B, S, H, Dh] (this rank's heads): one layer's at a time is alive while the caller
        stores them."""
        enc = self.model.encoder(features, [features.shape[-1] // 2] * features.shape[0])
        for layer in self.model.decoder.layers:
            yield layer.encoder_attn.kv(enc)
