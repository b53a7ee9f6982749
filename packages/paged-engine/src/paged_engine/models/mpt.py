"""MPT (`MptForCausalLM`: MPT-7B / 7B-Instruct / 7B-Chat / 7B-8k, MPT-30B).

A GPT-style decoder as transformers runs it: multi-head attention on one fused `Wqkv` [q | k | v]
(clamped to +-`attn_config.clip_qkv` when set), ALiBi instead of positions, LayerNorms without a
bias, an exact-GELU MLP up_proj / down_proj of 4 x hidden, no biases anywhere, a sequential
pre-norm layer and a tied LM head. MPT's ALiBi slopes are the paper's with `alibi_bias_max` 8,
but for a head count that is not a power of two they come from the next power of two's sequence,
its odd then its even entries (not BLOOM's order); the bias is added after the scores are
scaled by `attn_config.softmax_scale` (1 / sqrt(head_dim) when unset).

transformers always runs ALiBi with alibi_bias_max 8 and multi-head attention and never reads
`qk_ln`; configs that ask for anything else (learned positions, another alibi_bias_max, grouped
or multi-query attention, q / k LayerNorms) are refused by name.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch

from paged_engine.checkpoint_checks import check_heads_divide
from paged_engine.layers.norm import LayerNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.bloom import BloomModel, use_alibi
from paged_engine.models.dbrx import ClipQKVAttention
from paged_engine.models.starcoder2 import LayerNormDecoderLayer, Starcoder2MLP
from paged_engine.models.utils import QKV_PROJ_RULES, CausalLMBase, cfg_get, sub_cfg_get

_RENAMES = (
    ("transformer.wte.", "model.embed_tokens."),
    ("transformer.blocks.", "model.layers."),
    ("transformer.norm_f.", "model.norm."),
    (".norm_1.", ".input_layernorm."),
    (".norm_2.", ".post_attention_layernorm."),
    (".attn.Wqkv.", ".self_attn.qkv."),
    (".attn.out_proj.", ".self_attn.o_proj."),
    (".ffn.up_proj.", ".mlp.c_fc."),
    (".ffn.down_proj.", ".mlp.c_proj."),
)


def mpt_alibi_slopes(num_heads: int, bias_max: float) -> torch.Tensor:
    """MPT's head slopes, as transformers builds them: 2^(-i * bias_max / n), i = 1..n, for n the
    next power of two; for fewer heads, its odd entries, then its even ones, the first
    num_heads of them. [num_heads] float32."""
    n = 1 << (num_heads - 1).bit_length()
    slopes = [2.0 ** (-(i + 1) * bias_max / n) for i in range(n)]
    if n != num_heads:
        slopes = (slopes[1::2] + slopes[::2])[:num_heads]
    return torch.tensor(slopes, dtype=torch.float32)


def _check(config) -> None:
    refused = {
        "alibi": (sub_cfg_get(config, "attn_config", "alibi", True), True),
        "attn_type": (
            sub_cfg_get(config, "attn_config", "attn_type", "multihead_attention"),
            "multihead_attention",
        ),
        "qk_ln": (sub_cfg_get(config, "attn_config", "qk_ln", False), False),
        "prefix_lm": (sub_cfg_get(config, "attn_config", "prefix_lm", False), False),
        # transformers builds the slopes with 8 whatever the config says
        "alibi_bias_max": (sub_cfg_get(config, "attn_config", "alibi_bias_max", 8), 8),
    }
    for key, (got, want) in refused.items():
        if got != want:
            raise ValueError(
                f"MPT with attn_config.{key}={got!r} is not supported (transformers runs "
                f"{key}={want!r} only)"
            )


class MptForCausalLM(CausalLMBase):
    renames = _RENAMES
    tie_default = True
    stacked_params = QKV_PROJ_RULES

    def __init__(self, config):
        _check(config)
        heads, d = config.num_attention_heads, config.hidden_size
        check_heads_divide(d, heads, "d_model", "n_heads")
        view = copy.copy(config)  # Llama's names for the shared modules
        view.num_key_value_heads = heads
        view.intermediate_size = 4 * d  # transformers' MLP ignores expansion_ratio
        view.hidden_act = "gelu"
        view.max_position_embeddings = 2048  # sizes the unused rotary table only
        eps = float(cfg_get(config, "layer_norm_epsilon", 1e-5))
        flags = {"qkv_bias": False, "o_bias": False, "qk_norm": False, "sliding": False}
        slopes = mpt_alibi_slopes(heads, 8.0)
        scale = sub_cfg_get(config, "attn_config", "softmax_scale")
        clip = sub_cfg_get(config, "attn_config", "clip_qkv")

        def build(i: int, rope: RotaryEmbedding) -> LayerNormDecoderLayer:
            attn = use_alibi(ClipQKVAttention(view, i, flags, None, clip), slopes, scale)
            layer = LayerNormDecoderLayer(d, eps, attn, Starcoder2MLP(view, False), False)
            layer.input_layernorm = LayerNorm(d, eps=eps, bias=False)
            layer.post_attention_layernorm = LayerNorm(d, eps=eps, bias=False)
            return layer

        inner = BloomModel(view, eps, build, embed_norm=False)
        inner.norm = LayerNorm(d, eps=eps, bias=False)
        super().__init__(config, inner)

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if ".self_attn.qkv." not in name:
            yield name, w
            return
        for shard, part in zip("qkv", w.chunk(3, dim=0), strict=True):  # rows [q | k | v]
            yield name.replace(".qkv.", f".{shard}_proj."), part
