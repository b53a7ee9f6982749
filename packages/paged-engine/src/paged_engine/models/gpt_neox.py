"""GPT-NeoX / Pythia: partial rotary (NeoX style), optional parallel residual, untied head.

HF's fused `query_key_value` interleaves per head: its output rows are [H, 3 (q|k|v), D].
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.attention import Attention
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from paged_engine.layers.norm import LayerNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.bloom import per_head_qkv
from paged_engine.models.utils import CausalLMBase, cfg_get, check_heads_span_hidden, make_layers


class GPTNeoXAttention(nn.Module):
    def __init__(self, config, rope: RotaryEmbedding):
        super().__init__()
        d, heads = config.hidden_size, config.num_attention_heads
        bias = cfg_get(config, "attention_bias", True)
        self.head_dim = d // heads
        self.query_key_value = QKVParallelLinear(d, self.head_dim, heads, heads, bias=bias)
        self.dense = RowParallelLinear(d, d, bias=bias)
        self.rotary_emb = rope  # shared by all layers
        local = self.query_key_value.num_heads  # this rank's heads
        self.attn = Attention(local, self.head_dim, local, self.head_dim**-0.5)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        q, k, v = self.query_key_value(x).chunk(3, dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.dense(self.attn(q, k, v, kv_cache, md))


class GPTNeoXMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(config.hidden_size, config.intermediate_size)
        self.dense_4h_to_h = RowParallelLinear(config.intermediate_size, config.hidden_size)
        self.act = get_act_fn(cfg_get(config, "hidden_act", "gelu"), "hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class GPTNeoXLayer(nn.Module):
    def __init__(self, config, rope: RotaryEmbedding):
        super().__init__()
        eps = cfg_get(config, "layer_norm_eps", 1e-5)
        self.use_parallel_residual = bool(cfg_get(config, "use_parallel_residual", True))
        self.input_layernorm = LayerNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, eps=eps)
        self.attention = GPTNeoXAttention(config, rope)
        self.mlp = GPTNeoXMLP(config)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:
        attn = self.attention(positions, self.input_layernorm(x), kv_cache, md)
        if self.use_parallel_residual:  # x + attn(ln1(x)) + mlp(ln2(x))
            return x + attn + self.mlp(self.post_attention_layernorm(x))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class GPTNeoXModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_in = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        head_dim = config.hidden_size // config.num_attention_heads
        rope = get_rope(config, head_dim, is_neox_style=True)
        self.layers, self.stage = make_layers(
            config.num_hidden_layers, lambda i: GPTNeoXLayer(config, rope)
        )
        self.final_layer_norm = LayerNorm(
            config.hidden_size, eps=cfg_get(config, "layer_norm_eps", 1e-5)
        )

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        x = self.embed_in(input_ids) if hidden is None else hidden  # [T, D]
        for layer, kv_cache in zip(self.stage.layers(self.layers), kv_caches, strict=True):
            x = layer(positions, x, kv_cache, md)
        return self.final_layer_norm(x) if self.stage.is_last else x


class GPTNeoXForCausalLM(CausalLMBase):
    inner_name = "gpt_neox"
    embed_path = "gpt_neox.embed_in"
    head_name = "embed_out"
    stacked_params = (
        (".query_key_value.", ".qkv_q.", "q"),
        (".query_key_value.", ".qkv_k.", "k"),
        (".query_key_value.", ".qkv_v.", "v"),
    )
    # HF's causal-mask buffers and RoPE frequencies, which we rebuild
    ignored_weights = (".attention.bias", ".attention.masked_bias", ".inv_freq")

    def __init__(self, config):
        # HF's heads are hidden_size / num_attention_heads wide whatever head_dim says
        check_heads_span_hidden(config, "GPT-NeoX")
        super().__init__(config, GPTNeoXModel(config))

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if ".query_key_value." not in name:
            yield name, w
            return
        q, k, v = per_head_qkv(w, self.config.num_attention_heads)  # rows [H, q|k|v, D]
        for shard, part in zip("qkv", (q, k, v), strict=True):
            yield name.replace(".query_key_value.", f".qkv_{shard}."), part
