"""GPT-J (`GPTJForCausalLM`: GPT-J-6B and its fine-tunes, e.g. GPT4All-J, Pygmalion-6B).

One LayerNorm per layer feeds attention and MLP side by side, x += attn(ln(x)) + mlp(ln(x)) (the
parallel `LayerNormDecoderLayer` of models/starcoder2.py, as Phi uses). Attention is Llama's
multi-head attention without any bias (separate q / k / v, fused here into `qkv_proj`) and rotary
on the first `rotary_dim` dims of each head only, in GPT-J's interleaved style: pairs (0, 1),
(2, 3), ... rotate, not NeoX's halves (`is_neox_style=False`). The MLP is GPT-2's non-gated
fc_out(gelu_new(fc_in(x))) with biases (`n_inner`, 4 * hidden by default); a final LayerNorm, then
an untied LM head with a bias of its own (`lm_head.bias`, as Phi's).

HF's names map onto the shared modules in `rename_weight`: `transformer.wte` / `h` / `ln_f` ->
`model.embed_tokens` / `layers` / `norm`, `ln_1` -> `input_layernorm`, `attn` -> `self_attn`
(`out_proj` -> `o_proj`), `fc_in` / `fc_out` -> `c_fc` / `c_proj`.
"""

from __future__ import annotations

import copy

from torch import nn

from paged_engine.layers.norm import LayerNorm
from paged_engine.layers.rotary import RotaryEmbedding, rope_config
from paged_engine.models.llama import LlamaAttention, LlamaModel
from paged_engine.models.starcoder2 import LayerNormDecoderLayer, Starcoder2MLP
from paged_engine.models.utils import QKV_PROJ_RULES, CausalLMBase, cfg_get

# (HF's name fragment, ours), applied in order
_RENAMES = (
    ("transformer.wte.", "model.embed_tokens."),
    ("transformer.h.", "model.layers."),
    ("transformer.ln_f.", "model.norm."),
    (".ln_1.", ".input_layernorm."),
    (".attn.out_proj.", ".self_attn.o_proj."),
    (".attn.", ".self_attn."),
    (".mlp.fc_in.", ".mlp.c_fc."),
    (".mlp.fc_out.", ".mlp.c_proj."),
)


def llama_view(config):
    """A shallow copy of a GPT-J config under the Llama names the shared modules read."""
    view = copy.copy(config)
    d = config.hidden_size
    head_dim = d // config.num_attention_heads
    view.intermediate_size = cfg_get(config, "n_inner", 4 * d)
    view.hidden_act = cfg_get(config, "activation_function", "gelu_new")
    view.partial_rotary_factor = cfg_get(config, "rotary_dim", head_dim) / head_dim
    view.num_key_value_heads = config.num_attention_heads
    view.head_dim = head_dim
    return view


class GPTJForCausalLM(CausalLMBase):
    renames = _RENAMES
    head_bias = True
    stacked_params = QKV_PROJ_RULES
    # HF's causal-mask buffers (old checkpoints carry them), its sin / cos table
    ignored_weights = (".self_attn.bias", ".self_attn.masked_bias", "embed_positions")

    def __init__(self, config):
        theta, scaling, _ = rope_config(config)
        if theta != 10000.0 or scaling is not None:  # HF's sin / cos table is fixed
            field = f"rope_theta={theta}" if scaling is None else f"rope_scaling={scaling}"
            raise ValueError(
                f"GPT-J with {field} is not supported (transformers rotates by base 10000, "
                "unscaled, whatever the config says)"
            )
        view = llama_view(config)
        eps = float(cfg_get(config, "layer_norm_epsilon", 1e-5))
        flags = {"qkv_bias": False, "o_bias": False, "qk_norm": False, "sliding": False}

        def build(i: int, rope: RotaryEmbedding) -> nn.Module:
            attn = LlamaAttention(view, i, flags, rope)
            mlp = Starcoder2MLP(view, bias=True)
            return LayerNormDecoderLayer(config.hidden_size, eps, attn, mlp, parallel=True)

        inner = LlamaModel(view, {}, build, is_neox_style=False)
        inner.norm = LayerNorm(config.hidden_size, eps=eps)  # replaces Llama's RMSNorm
        super().__init__(config, inner)
