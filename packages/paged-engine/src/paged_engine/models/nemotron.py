"""NVIDIA Nemotron (`NemotronForCausalLM`: Nemotron-4 / Nemotron-3 8B, Minitron-4B / 8B,
Mistral-NeMo-Minitron-8B).

Llama's pre-norm decoder (x += attn(norm(x)); x += mlp(norm(x))) and GQA with three changes:

    norms       LayerNorm1P: a LayerNorm with a bias whose checkpoint weight is stored minus 1,
                y = norm(x) * (1 + weight) + bias (layers/norm.py), `norm_eps`
    mlp         not gated: down(relu(up(x))^2) (`hidden_act` "relu2"; Nemotron-H's Relu2MLP),
                biases when `mlp_bias`
    rope        partial: NeoX style over the first head_dim * partial_rotary_factor dims of
                each head (0.5 by default), the rest passed through

q / k / v / o biases when `attention_bias`. Checkpoints use Llama's names (no gate_proj; the
norms carry `.bias`); the head is not tied by default.

Jais 2 (`Jais2ForCausalLM`: Jais-2-8B-Chat) is the same decoder with plain LayerNorms
(`layer_norm_eps`) and the config's rope (whole heads unless `partial_rotary_factor` says).
"""

from __future__ import annotations

from torch import nn

from paged_engine.layers.norm import LayerNorm1P
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.llama import LlamaAttention
from paged_engine.models.nemotron_h import Relu2MLP
from paged_engine.models.starcoder2 import LayerNormDecoderLayer, LayerNormLlamaModel
from paged_engine.models.utils import QKV_PROJ_RULES, CausalLMBase, cfg_get


class NemotronForCausalLM(CausalLMBase):
    stacked_params = QKV_PROJ_RULES
    ignored_weights = ("rotary_emb.inv_freq",)
    norm_cls: type[nn.Module] = LayerNorm1P  # the layers' and the final norm
    eps_name = "norm_eps"

    def __init__(self, config) -> None:
        name = type(self).__name__
        act = cfg_get(config, "hidden_act", "relu2")
        if act != "relu2":
            raise ValueError(f"{name} supports hidden_act='relu2' only, got {act!r}")
        eps = float(cfg_get(config, type(self).eps_name, 1e-5))
        norm = type(self).norm_cls
        d = config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        flags = {"qkv_bias": bias, "o_bias": bias, "qk_norm": False, "sliding": False}
        mlp_bias = bool(getattr(config, "mlp_bias", False))

        def build(i: int, rope: RotaryEmbedding) -> nn.Module:
            mlp = Relu2MLP(d, config.intermediate_size, mlp_bias)
            layer = LayerNormDecoderLayer(
                d, eps, LlamaAttention(config, i, flags, rope), mlp, parallel=False
            )
            layer.input_layernorm = norm(d, eps=eps)
            layer.post_attention_layernorm = norm(d, eps=eps)
            return layer

        inner = LayerNormLlamaModel(config, eps, build)
        inner.norm = norm(d, eps=eps)
        super().__init__(config, inner)


class Jais2ForCausalLM(NemotronForCausalLM):
    norm_cls = nn.LayerNorm
    eps_name = "layer_norm_eps"
