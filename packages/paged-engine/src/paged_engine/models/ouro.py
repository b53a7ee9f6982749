"""ByteDance Ouro (`OuroForCausalLM`, model_type "ouro", remote code; vLLM's ouro.py): a looped
transformer. Ouro-1.4B / 2.6B and their Thinking variants.

    loop    the whole layer stack runs `total_ut_steps` times (4 in the releases); each step
            starts from the previous step's output with a fresh residual stream and ends with
            the final norm, so the LM head reads the last step's normed output
    layer   Llama's pre-norm layer with sandwich norms: x += input_layernorm_2(attn(
            input_layernorm(x))); x += post_attention_layernorm_2(mlp(post_attention_
            layernorm(x))); no biases; head_dim hidden_size / num_attention_heads
    KV      every (step, layer) attends over a cache of its own: kv_caches[step * L + layer]
            (`kv_cache_layout`; vLLM's attention index ut_step * L + layer), one paged
            Attention each (OuroAttention: the projections are the layer's, shared by steps)
    exit    the early-exit gate (`model.early_exit_gate`) is not read: vLLM runs every step
            and never evaluates it, and so do we (its weights are skipped at load)

Refused by name: `use_sliding_window` (vLLM attends to the whole context), `head_dim` other
than hidden_size / num_attention_heads (vLLM's), `is_causal` false, dual-chunk attention,
pipeline parallelism (the caches are not one per layer), and an fp8 KV cache (its scales are
one per decoder layer; here a layer attends once per step).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from paged_engine.distributed.parallel_state import get_parallel_state
from paged_engine.layers.attention import Attention
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    add_norm,
    llama_head_dim,
    stage_input,
)
from paged_engine.models.llama_remote import llama_config
from paged_engine.models.remote_aliases import field
from paged_engine.models.utils import CausalLMBase, make_layers

_FLAGS = {"qkv_bias": False, "o_bias": False, "qk_norm": False, "mlp_bias": False}
_FLAGS |= {"sliding": False}


def ouro_config(raw: dict[str, Any]) -> PretrainedConfig:
    """Ouro's config.json: Qwen2's field names without biases, and `total_ut_steps`."""
    if raw.get("use_sliding_window"):
        raise ValueError("config.json field 'use_sliding_window' true is not supported for Ouro")
    if raw.get("is_causal") is False:
        raise ValueError("config.json field 'is_causal' false is not supported for Ouro")
    if raw.get("dual_chunk_attention_config"):
        raise ValueError("config.json field 'dual_chunk_attention_config' is not supported")
    hidden, heads = field(raw, "hidden_size", int), field(raw, "num_attention_heads", int)
    head_dim = raw.get("head_dim")
    if hidden % heads or (head_dim is not None and head_dim != hidden // heads):
        raise ValueError(
            f"config.json field 'head_dim' must be hidden_size / num_attention_heads "
            f"({hidden} / {heads}) for Ouro, got {head_dim!r}"
        )
    return llama_config(raw, total_ut_steps=field(raw, "total_ut_steps", int, 4))


class OuroAttention(LlamaAttention):
    """LlamaAttention with one paged Attention per loop step (`step_attn[s]`: each writes and
    reads the cache the model hands it for step s)."""

    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding, steps: int) -> None:
        super().__init__(config, layer_idx, _FLAGS, rope)
        a = self.attn
        later = [
            Attention(a.num_heads, a.head_dim, a.num_kv_heads, a.scale) for _ in range(1, steps)
        ]
        self.step_attn = nn.ModuleList([a, *later])


class OuroDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding, steps: int) -> None:
        super().__init__()
        eps, d = float(config.rms_norm_eps), config.hidden_size
        self.self_attn = OuroAttention(config, layer_idx, rope, steps)
        self.mlp = LlamaMLP(config, bias=False)
        self.input_layernorm = RMSNorm(d, eps)
        self.input_layernorm_2 = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm_2 = RMSNorm(d, eps)

    def forward(
        self,
        positions: torch.Tensor,
        h: torch.Tensor,  # [T, D]
        residual: torch.Tensor | None,  # the stream is h + residual (h alone when None)
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md,
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's last sandwich-normed output, the stream before it): each residual
        add runs inside the norm after it."""
        if residual is None:
            y, residual = self.input_layernorm(h), h
        else:
            y, residual = add_norm(self.input_layernorm, h, residual)
        a = self.self_attn(positions, y, kv_cache, md, self.self_attn.step_attn[step])
        y, residual = add_norm(self.post_attention_layernorm, self.input_layernorm_2(a), residual)
        return self.post_attention_layernorm_2(self.mlp(y)), residual


class OuroModel(nn.Module):
    embedding_multiplier: float | None = None  # (stage_input reads it)

    def __init__(self, config) -> None:
        super().__init__()
        if get_parallel_state().pp_size > 1:
            raise ValueError(
                "OuroForCausalLM does not support pipeline parallelism (its KV caches are one "
                "per loop step and layer, not one per layer)"
            )
        self.steps = int(config.total_ut_steps)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rope = get_rope(config, llama_head_dim(config))
        self.rotary_emb = rope  # the layers' shared instance: its tables are set per forward
        self.layers, self.stage = make_layers(
            config.num_hidden_layers, lambda i: OuroDecoderLayer(config, i, rope, self.steps)
        )
        self.norm = RMSNorm(config.hidden_size, float(config.rms_norm_eps))

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        x = stage_input(self, input_ids, hidden)  # [T, D]
        self.rotary_emb.begin_forward(positions)
        n = len(self.layers)
        assert len(kv_caches) == n * self.steps, "one KV cache per (loop step, layer)"
        for step in range(self.steps):
            h, residual = x, None  # each step starts a fresh residual stream from x
            for i, layer in enumerate(self.layers):
                h, residual = layer(positions, h, residual, kv_caches[step * n + i], md, step)
            assert residual is not None
            x = add_norm(self.norm, h, residual)[0]
        return x


class OuroForCausalLM(LlamaForCausalLM):
    fp8_kv_cache = False
    fp8_kv_refusal = "its layers attend once per loop step, each step over a cache of its own"

    def __init__(self, config) -> None:
        CausalLMBase.__init__(self, config, OuroModel(config))

    @staticmethod
    def kv_cache_layout(config) -> list[tuple[int, int]]:
        """(num_kv_heads, head_dim) of each cache: step 0's layers, then step 1's, ..."""
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        count = int(config.num_hidden_layers) * int(config.total_ut_steps)
        return [(kv_heads, config.hidden_size // heads)] * count

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.startswith("model.early_exit_gate."):  # never evaluated (module docstring)
            return ()
        return ((name, w),)
