"""BioGPT (`BioGptForCausalLM`: microsoft/biogpt, BioGPT-Large) and the fairseq decoder it shares
with XGLM (models/xglm.py).

Both are fairseq `TransformerDecoder` language models: token embeddings times sqrt(hidden)
(`scale_embedding`, on by default) plus absolute positions read `POSITION_OFFSET` = 2 rows into
their table, then OPT's pre-LayerNorm layers (models/opt.py `OPTDecoderLayer`: biased q / k / v /
out projections, fc2(act(fc1(x))), LayerNorms of eps 1e-5 whatever `layer_norm_eps` says, as HF
builds them), a final LayerNorm and an LM head without bias, tied to the token embedding by
default (tied, it reads the unscaled embedding, as HF's does). Only the position table differs:
BioGPT learns one (`embed_positions.weight`, [max_position_embeddings + 2, D]); XGLM computes a
sinusoidal one.

HF's names map onto ours unchanged (`biogpt.layers.N.self_attn.q_proj` ... ; q / k / v fuse into
`qkv_proj`, which shards by heads under tensor parallelism); BioGPT's head is
`output_projection`.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from paged_engine.distributed.parallel_state import get_parallel_state
from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.norm import LayerNorm
from paged_engine.models.opt import POSITION_OFFSET, OPTDecoderLayer
from paged_engine.models.utils import QKV_PROJ_RULES, CausalLMBase, cfg_get, make_layers


def opt_view(config, ffn_dim: int, act: str):
    """A shallow copy of a BioGPT / XGLM config under the OPT names `OPTDecoderLayer` reads."""
    view = copy.copy(config)
    view.ffn_dim = ffn_dim
    view.activation_function = act
    view.enable_bias = True
    view.do_layer_norm_before = True
    view.layer_norm_elementwise_affine = True
    return view


class ScaledEmbeddingDecoder(nn.Module):
    """sqrt(D)-scaled token embeddings + `embed_positions(positions + 2)`, OPT's pre-LN layers,
    the final `layer_norm`. `embed_positions` maps [T] table rows to [T, D]."""

    def __init__(self, config, view, embed_positions: nn.Module):
        super().__init__()
        d = config.hidden_size
        self.embed_scale = math.sqrt(d) if cfg_get(config, "scale_embedding", True) else 1.0
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, d)
        self.embed_positions = embed_positions
        self.layers, self.stage = make_layers(
            config.num_hidden_layers, lambda i: OPTDecoderLayer(view)
        )
        self.layer_norm = LayerNorm(d)
        self.first = get_parallel_state().is_first_stage

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        # first stage: the token ids, or embeddings given in their place (already scaled: HF
        # scales inside its embedding module, so inputs_embeds go in as they are)
        if hidden is None or self.first:
            x = self.embed_tokens(input_ids) * self.embed_scale if hidden is None else hidden
            hidden = x + self.embed_positions(positions + POSITION_OFFSET)  # [T, D]
        x = hidden
        for layer, kv_cache in zip(self.stage.layers(self.layers), kv_caches, strict=True):
            x = layer(x, kv_cache, md)
        return self.layer_norm(x) if self.stage.is_last else x


class BioGptForCausalLM(CausalLMBase):
    inner_name = "biogpt"
    embed_path = "biogpt.embed_tokens"
    head_name = "output_projection"
    tie_default = True
    stacked_params = QKV_PROJ_RULES

    def __init__(self, config):
        act = config.hidden_act
        get_act_fn(act, "hidden_act")  # refuses an unknown one under its own config name
        view = opt_view(config, config.intermediate_size, act)
        table = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, config.hidden_size)
        super().__init__(config, ScaledEmbeddingDecoder(config, view, table))
