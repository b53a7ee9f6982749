"""GPT-BigCode (`GPTBigCodeForCausalLM`: SantaCoder, StarCoder / StarCoderBase, WizardCoder,
Octocoder).

GPT-2's decoder (models/gpt2.py: learned absolute positions, pre-LayerNorm, GELU MLP `c_fc` /
`c_proj` with biases, fused `c_attn`, LM head tied by default) with multi-query attention: when
`multi_query` (the default) every query head shares one KV head, replicated on every rank under
tensor parallelism. Unlike GPT-2 the projections are nn.Linear ([out, in], no Conv1D transpose)
and `c_attn`'s rows are q heads | k | v under multi-query, per head [H, q|k|v, D] without it;
`convert_weight` splits them into q / k / v for `QKVParallelLinear`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.layers.attention import Attention
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.linear import QKVParallelLinear, RowParallelLinear
from paged_engine.layers.norm import LayerNorm
from paged_engine.models.gpt2 import GPT2MLP, GPT2Block, GPT2LMHeadModel, GPT2Model
from paged_engine.models.utils import CausalLMBase, cfg_get, make_layers


def bigcode_kv_heads(config) -> int:
    return 1 if cfg_get(config, "multi_query", True) else config.num_attention_heads


class GPTBigCodeAttention(nn.Module):
    """GPT-2's attention with `bigcode_kv_heads` KV heads."""

    def __init__(self, config):
        super().__init__()
        d, heads = config.hidden_size, config.num_attention_heads
        head_dim = d // heads
        scale = head_dim**-0.5 if cfg_get(config, "scale_attn_weights", True) else 1.0
        self.c_attn = QKVParallelLinear(d, head_dim, heads, bigcode_kv_heads(config), bias=True)
        self.c_proj = RowParallelLinear(d, d, bias=True)
        local_heads, local_kv_heads = self.c_attn.num_heads, self.c_attn.num_kv_heads
        self.sizes = [local_heads * head_dim, local_kv_heads * head_dim, local_kv_heads * head_dim]
        self.attn = Attention(local_heads, head_dim, local_kv_heads, scale)

    def forward(self, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        q, k, v = self.c_attn(x).split(self.sizes, dim=-1)
        return self.c_proj(self.attn(q, k, v, kv_cache, md))


class GPTBigCodeBlock(GPT2Block):
    """GPT-2's block (and forward) around the multi-query attention."""

    def __init__(self, config):
        nn.Module.__init__(self)
        eps = cfg_get(config, "layer_norm_epsilon", 1e-5)
        self.ln_1 = LayerNorm(config.hidden_size, eps=eps)
        self.attn = GPTBigCodeAttention(config)
        self.ln_2 = LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(config)


class GPTBigCodeModel(GPT2Model):
    """GPT-2's stack (and forward) of GPTBigCodeBlocks."""

    def __init__(self, config):
        nn.Module.__init__(self)
        d = config.hidden_size
        self.wte = VocabParallelEmbedding(config.vocab_size, d)
        self.wpe = nn.Embedding(config.max_position_embeddings, d)
        self.h, self.stage = make_layers(
            config.num_hidden_layers, lambda i: GPTBigCodeBlock(config)
        )
        self.ln_f = LayerNorm(d, eps=cfg_get(config, "layer_norm_epsilon", 1e-5))


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    # GPT-2's causal-mask buffers, and GPT-BigCode's one (`transformer.bias`) in old checkpoints
    ignored_weights = (*GPT2LMHeadModel.ignored_weights, "transformer.bias")

    def __init__(self, config):
        CausalLMBase.__init__(self, config, GPTBigCodeModel(config))

    # nn.Linear weights: a LoRA B splits as the weight does
    convert_lora_b = CausalLMBase.convert_lora_b

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if ".attn.c_attn." not in name:
            yield name, w
            return
        heads = self.config.num_attention_heads
        d = self.config.hidden_size // heads
        rest = w.shape[1:]
        if bigcode_kv_heads(self.config) == 1:  # q heads | k | v
            parts = w.split([heads * d, d, d])
        else:  # rows [H, q|k|v, D]
            rows = w.reshape(heads, 3, d, *rest)
            parts = tuple(rows[:, i].reshape(heads * d, *rest) for i in range(3))
        for shard, part in zip("qkv", parts, strict=True):
            yield name.replace(".c_attn.", f".c_attn_{shard}."), part
