"""Phi (`PhiForCausalLM`: phi-1, phi-1.5, phi-2).

One LayerNorm per layer feeds attention and MLP side by side: x += attn(ln(x)) + mlp(ln(x))
(StableLM's parallel layer, models/stablelm.py). Attention is Llama's with biases on q / k / v and
on the output projection (`dense`) and partial NeoX RoPE (`partial_rotary_factor`, half of each
head by default); with `qk_layernorm`, one LayerNorm (weight and bias) shared by all q heads and
one by all k heads normalizes each head before RoPE. The MLP is StarCoder2's non-gated
fc2(gelu_new(fc1(x))) with biases; a final LayerNorm (`final_layernorm`), then an LM head with a
bias of its own (`lm_head.bias`, split over the vocabulary like the head's rows under tensor
parallelism; kept when the head's weight is tied).

HF's names map onto the shared modules in `rename_weight`: `dense` -> `o_proj`, `fc1` / `fc2` ->
`c_fc` / `c_proj`, `final_layernorm` -> `norm`.
"""

from __future__ import annotations

from torch import nn

from paged_engine.layers.linear import QKVParallelLinear
from paged_engine.layers.norm import LayerNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.llama import LlamaAttention
from paged_engine.models.stablelm import QKNormAttention
from paged_engine.models.starcoder2 import (
    LayerNormDecoderLayer,
    LayerNormLlamaModel,
    Starcoder2MLP,
)
from paged_engine.models.utils import (
    QKV_PROJ_RULES,
    CausalLMBase,
    cfg_get,
    check_heads_span_hidden,
)

# (HF's name fragment, ours)
_RENAMES = (
    (".self_attn.dense.", ".self_attn.o_proj."),
    (".mlp.fc1.", ".mlp.c_fc."),
    (".mlp.fc2.", ".mlp.c_proj."),
    ("model.final_layernorm.", "model.norm."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),  # QKNormAttention's names
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
)


def phi_model(config, *, qk_layernorm: bool, parallel: bool) -> LayerNormLlamaModel:
    """Phi's stack: LayerNorm layers (attention and MLP side by side when `parallel`, else one
    after the other) of biased attention, with one q and one k LayerNorm shared by all heads
    where config.qk_layernorm (default `qk_layernorm`) says, and a biased c_fc / c_proj MLP."""
    eps = float(cfg_get(config, "layer_norm_eps", 1e-5))
    flags = {"qkv_bias": True, "o_bias": True, "qk_norm": False, "sliding": False}
    head_dim = config.hidden_size // config.num_attention_heads

    def shared_norms(proj: QKVParallelLinear) -> tuple[nn.Module, nn.Module]:
        return LayerNorm(head_dim, eps=eps), LayerNorm(head_dim, eps=eps)

    def build(i: int, rope: RotaryEmbedding) -> nn.Module:
        if cfg_get(config, "qk_layernorm", qk_layernorm):
            attn = QKNormAttention(config, i, flags, rope, shared_norms)
        else:
            attn = LlamaAttention(config, i, flags, rope)
        mlp = Starcoder2MLP(config, bias=True)
        return LayerNormDecoderLayer(config.hidden_size, eps, attn, mlp, parallel=parallel)

    return LayerNormLlamaModel(config, eps, build)


class PhiForCausalLM(CausalLMBase):
    renames = _RENAMES
    head_bias = True
    stacked_params = QKV_PROJ_RULES
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config):
        check_heads_span_hidden(config, "Phi")  # HF's dense is hidden x hidden
        super().__init__(config, phi_model(config, qk_layernorm=False, parallel=True))
