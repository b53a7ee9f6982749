"""Swiss AI Apertus (`ApertusForCausalLM`: Apertus-8B / 70B, base and Instruct).

The Llama decoder with two changes:

    MLP        no gate: down(xielu(up(x))), xIELU's four learned scalars per layer
               (`mlp.act_fn.{alpha_p,alpha_n,beta,eps}`, layers/activation.py's XIELU)
    attention  per-head RMSNorms on q and k before RoPE (Qwen3's `q_norm` / `k_norm`)

The pre-norms are named `attention_layernorm` / `feedforward_layernorm` (Llama's
`input_layernorm` / `post_attention_layernorm`, renamed on load). The rope is Llama 3's scaling
(theta 12M, factor 8 over 8192 by default), GQA, untied head, no biases unless
`attention_bias`: all Llama's.
"""

from __future__ import annotations

import torch
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.models.llama import LlamaForCausalLM, LlamaModel
from paged_engine.models.mixtral import MoeDecoderLayer
from paged_engine.models.nemotron_h import Relu2MLP
from paged_engine.models.utils import QKV_PROJ_RULES, CausalLMBase, cfg_get

# checkpoint norm names -> ours (MoeDecoderLayer's, Llama's)
_RENAMES = (
    (".attention_layernorm.", ".input_layernorm."),
    (".feedforward_layernorm.", ".post_attention_layernorm."),
)


class ApertusMLP(Relu2MLP):
    """down(act(up(x))): [T, D] -> [T, D]; `act_fn` xIELU (or another elementwise `hidden_act`)."""

    def __init__(self, config) -> None:
        super().__init__(config.hidden_size, config.intermediate_size, bias=False)
        self.act_fn = get_act_fn(cfg_get(config, "hidden_act", "xielu"))  # XIELU for "xielu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


class ApertusForCausalLM(LlamaForCausalLM):
    renames = _RENAMES
    stacked_params = QKV_PROJ_RULES  # no gate: Llama's ".up_proj" rule would stack it

    def __init__(self, config) -> None:
        flags = self.layer_flags(config)

        def build(i, rope) -> nn.Module:
            return MoeDecoderLayer(config, i, flags, rope, ApertusMLP(config))

        CausalLMBase.__init__(self, config, LlamaModel(config, flags, build))

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        return {**LlamaForCausalLM.layer_flags(config), "qk_norm": True}
