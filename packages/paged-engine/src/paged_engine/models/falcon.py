"""Falcon (`FalconForCausalLM`: Falcon-7B / 40B / 180B, Falcon-11B, Falcon-RW-1B / 7B).

A GPT-style decoder on Llama's attention: LayerNorms (weight and bias), a non-gated MLP
dense_4h_to_h(gelu(dense_h_to_4h(x))) (`ffn_hidden_size`, `activation`), biases on every linear
layer only when `bias` (Falcon-RW), full NeoX RoPE, and an LM head tied by default. The config
picks the layer:
- `new_decoder_architecture` (40B / 180B / 11B): grouped KV heads (`num_kv_heads`) and a parallel
  layer x += attn(ln_attn(x)) + mlp(ln_mlp(x)), two LayerNorms (one, `input_layernorm`, when
  `num_ln_in_parallel_attn` is 1: Falcon-11B);
- else (7B, RW): multi-query attention (one KV head) when `multi_query`, else multi-head; with
  `parallel_attn` (7B) x += attn(ln(x)) + mlp(ln(x)) on one `input_layernorm`, without it (RW)
  the sequential pre-norm layer;
- `alibi` (Falcon-RW): no RoPE; ALiBi biases added to the scores before HF scales them by
  1 / sqrt(head_dim), so our slopes carry that factor, and HF's bfloat16-rounded slopes.

The fused `query_key_value` rows are per KV group [Hkv, H/Hkv q heads | k | v, D] in the new
architecture, per head [H, q|k|v, D] in multi-head, and q heads | k | v in multi-query;
`convert_weight` splits them into q / k / v for `QKVParallelLinear`, which shards heads (and
replicates a lone KV head) under tensor parallelism.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.layers.norm import LayerNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.bloom import alibi_slopes, per_head_qkv, use_alibi
from paged_engine.models.llama import LlamaAttention
from paged_engine.models.starcoder2 import (
    LayerNormDecoderLayer,
    LayerNormLlamaModel,
    Starcoder2MLP,
)
from paged_engine.models.utils import QKV_PROJ_RULES, CausalLMBase, cfg_get

# (HF's name fragment, ours), applied in order
_RENAMES = (
    ("transformer.word_embeddings.", "model.embed_tokens."),
    ("transformer.h.", "model.layers."),
    ("transformer.ln_f.", "model.norm."),
    (".self_attention.dense.", ".self_attn.o_proj."),
    (".self_attention.", ".self_attn."),
    (".mlp.dense_h_to_4h.", ".mlp.c_fc."),
    (".mlp.dense_4h_to_h.", ".mlp.c_proj."),
)


def falcon_kv_heads(config) -> int:
    heads = config.num_attention_heads
    given = cfg_get(config, "num_kv_heads", None)
    kv_heads = given or heads
    if cfg_get(config, "new_decoder_architecture", False):
        if given is not None and given <= 0:  # (`or heads`: KV heads the weights lack)
            raise ValueError(f"num_kv_heads={given} must be positive")
        return kv_heads
    if cfg_get(config, "multi_query", True):
        return 1
    if kv_heads != heads:  # per-head q|k|v rows hold H KV heads; HF's attention fails on it
        raise ValueError(
            f"Falcon with num_kv_heads={kv_heads} != num_attention_heads={heads} needs "
            "new_decoder_architecture=True (multi-head rows carry a KV head per head)"
        )
    return heads


def llama_view(config):
    """A shallow copy of a Falcon config under the Llama names the shared modules read."""
    view = copy.copy(config)
    view.num_key_value_heads = falcon_kv_heads(config)
    view.intermediate_size = cfg_get(config, "ffn_hidden_size", 4 * config.hidden_size)
    view.hidden_act = cfg_get(config, "activation", "gelu")
    return view


def falcon_alibi_slopes(num_heads: int, head_dim: int) -> torch.Tensor:
    """HF's Falcon ALiBi slopes (bfloat16-rounded, as HF builds them) times the 1 / sqrt(head_dim)
    HF applies to the biased scores: [num_heads] float32."""
    return alibi_slopes(num_heads).bfloat16().float() * head_dim**-0.5


class FalconParallelLayer(nn.Module):
    """x += attn(ln_attn(x)) + mlp(ln_mlp(x)): the new decoder architecture's two norms."""

    def __init__(self, hidden: int, eps: float, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.ln_attn = LayerNorm(hidden, eps=eps)
        self.ln_mlp = LayerNorm(hidden, eps=eps)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        attn = self.self_attn(positions, self.ln_attn(x), kv_cache, md)
        return x + attn + self.mlp(self.ln_mlp(x))


class FalconForCausalLM(CausalLMBase):
    renames = _RENAMES
    tie_default = True
    stacked_params = QKV_PROJ_RULES
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config):
        view = llama_view(config)
        eps = float(cfg_get(config, "layer_norm_epsilon", 1e-5))
        bias = bool(cfg_get(config, "bias", False))
        flags = {"qkv_bias": bias, "o_bias": bias, "qk_norm": False, "sliding": False}
        alibi = bool(cfg_get(config, "alibi", False))
        new_arch = bool(cfg_get(config, "new_decoder_architecture", False))
        norms = cfg_get(config, "num_ln_in_parallel_attn", 2 if new_arch else 1)
        parallel = new_arch or bool(cfg_get(config, "parallel_attn", True))

        def build(i: int, rope: RotaryEmbedding) -> nn.Module:
            attn = LlamaAttention(view, i, flags, None if alibi else rope)
            if alibi:
                head_dim = attn.head_dim
                attn = use_alibi(attn, falcon_alibi_slopes(config.num_attention_heads, head_dim))
            mlp = Starcoder2MLP(view, bias)
            if new_arch and norms == 2:
                return FalconParallelLayer(config.hidden_size, eps, attn, mlp)
            return LayerNormDecoderLayer(config.hidden_size, eps, attn, mlp, parallel)

        super().__init__(config, LayerNormLlamaModel(view, eps, build))

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if ".self_attn.query_key_value." not in name:
            yield name, w
            return
        heads = self.config.num_attention_heads
        kv_heads = falcon_kv_heads(self.config)
        d = self.config.hidden_size // heads
        rest = w.shape[1:]
        if cfg_get(self.config, "new_decoder_architecture", False):
            group = heads // kv_heads  # rows [Hkv, group q heads | k | v, D]
            rows = w.reshape(kv_heads, group + 2, d, *rest)
            q, k, v = rows[:, :group], rows[:, group], rows[:, group + 1]
        elif kv_heads == heads:  # rows [H, q|k|v, D]
            q, k, v = per_head_qkv(w, heads)
        else:  # multi-query: q heads, then the one k and v head
            q, k, v = w.split([heads * d, d, d])
        for shard, part in zip("qkv", (q, k, v), strict=True):
            yield name.replace(".query_key_value.", f".{shard}_proj."), part.reshape(-1, *rest)
