"""OPT: learned positions (offset 2), pre- or post-LayerNorm, optional project_in / project_out.

HF checkpoints name weights `model.decoder.*` (older ones `decoder.*`); the LM head is tied to
the token embedding, whose width is `word_embed_proj_dim` (may differ from hidden_size).
"""

from __future__ import annotations

import torch
from torch import nn

from paged_engine.checkpoint_checks import check_heads_divide
from paged_engine.distributed.parallel_state import get_parallel_state
from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.attention import Attention
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from paged_engine.layers.norm import LayerNorm
from paged_engine.models.utils import QKV_PROJ_RULES, CausalLMBase, cfg_get, make_layers

POSITION_OFFSET = 2  # OPT's learned position table reserves two leading rows


class OPTAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        bias = cfg_get(config, "enable_bias", True)
        self.head_dim = check_heads_divide(hidden, heads, "hidden_size", "num_attention_heads")
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, heads, heads, bias=bias)
        self.out_proj = RowParallelLinear(hidden, hidden, bias=bias)
        local = self.qkv_proj.num_heads  # this rank's heads
        self.attn = Attention(local, self.head_dim, local, self.head_dim**-0.5)

    def forward(self, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        return self.out_proj(self.attn(q, k, v, kv_cache, md))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, affine = config.hidden_size, cfg_get(config, "layer_norm_elementwise_affine", True)
        bias = cfg_get(config, "enable_bias", True)
        self.pre_ln = bool(cfg_get(config, "do_layer_norm_before", True))
        self.self_attn = OPTAttention(config)
        self.self_attn_layer_norm = LayerNorm(d, elementwise_affine=affine)
        self.fc1 = ColumnParallelLinear(d, config.ffn_dim, bias=bias)
        self.fc2 = RowParallelLinear(config.ffn_dim, d, bias=bias)
        self.act = get_act_fn(cfg_get(config, "activation_function", "relu"), "activation_function")
        self.final_layer_norm = LayerNorm(d, elementwise_affine=affine)

    def forward(self, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        h = self.self_attn_layer_norm(x) if self.pre_ln else x
        x = x + self.self_attn(h, kv_cache, md)
        if not self.pre_ln:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_ln else x
        x = x + self.fc2(self.act(self.fc1(h)))
        return x if self.pre_ln else self.final_layer_norm(x)


class OPTDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        proj = cfg_get(config, "word_embed_proj_dim", d)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, proj)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, d)
        self.project_in = nn.Linear(proj, d, bias=False) if proj != d else None
        self.project_out = nn.Linear(d, proj, bias=False) if proj != d else None
        final_ln = cfg_get(config, "do_layer_norm_before", True) and not getattr(
            config, "_remove_final_layer_norm", False
        )
        affine = cfg_get(config, "layer_norm_elementwise_affine", True)
        self.final_layer_norm = LayerNorm(d, elementwise_affine=affine) if final_ln else None
        self.layers, self.stage = make_layers(
            config.num_hidden_layers, lambda i: OPTDecoderLayer(config)
        )
        self.first = get_parallel_state().is_first_stage

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        # first stage: the token ids, or their embeddings with image rows in (BLIP-2: HF puts
        # them into the token embedding's output, before project_in and the positions)
        if hidden is None or self.first:
            x = self.embed_tokens(input_ids) if hidden is None else hidden  # [T, proj]
            if self.project_in is not None:
                x = self.project_in(x)
            hidden = x + self.embed_positions(positions + POSITION_OFFSET)  # [T, D]
        x = hidden
        for layer, kv_cache in zip(self.stage.layers(self.layers), kv_caches, strict=True):
            x = layer(x, kv_cache, md)
        if not self.stage.is_last:
            return x
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x  # [T, proj]


class OPTModel(nn.Module):
    """Only a name level: HF checkpoints keep the decoder under `model.decoder.*`."""

    def __init__(self, config):
        super().__init__()
        self.decoder = OPTDecoder(config)

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        return self.decoder(input_ids, positions, kv_caches, md, hidden)


class OPTForCausalLM(CausalLMBase):
    embed_path = "model.decoder.embed_tokens"
    tie_default = True
    stacked_params = QKV_PROJ_RULES

    def __init__(self, config):
        super().__init__(config, OPTModel(config))

    def rename_weight(self, name: str) -> str:
        return "model." + name if name.startswith("decoder.") else name
