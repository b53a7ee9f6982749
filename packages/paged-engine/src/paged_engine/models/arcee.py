"""Arcee AFM (`ArceeForCausalLM`: AFM-4.5B, base and instruct): the Llama decoder with an MLP
that has no gate, down(relu(up(x))^2) (`hidden_act` "relu2", Nemotron's MLP: models/nemotron_h.py).

Checkpoints hold `mlp.up_proj` / `mlp.down_proj` (biases with `mlp_bias`) and Llama's names
everywhere else. Attention (GQA, `attention_bias`, explicit `head_dim`), pre-norm RMSNorms, the
rope (YaRN in the released checkpoints, through rope_parameters / rope_scaling) and the untied
head are Llama's.
"""

from __future__ import annotations

from paged_engine.models.llama import LlamaForCausalLM, LlamaModel
from paged_engine.models.mixtral import MoeDecoderLayer
from paged_engine.models.nemotron_h import Relu2MLP
from paged_engine.models.utils import QKV_PROJ_RULES, CausalLMBase, cfg_get


class ArceeForCausalLM(LlamaForCausalLM):
    stacked_params = QKV_PROJ_RULES  # no gate: Llama's ".up_proj" rule would stack it

    def __init__(self, config) -> None:
        act = cfg_get(config, "hidden_act", "relu2")
        if act != "relu2":
            raise ValueError(f"ArceeForCausalLM supports hidden_act='relu2' only, got {act!r}")
        flags = self.layer_flags(config)
        size, bias = (config.hidden_size, config.intermediate_size), flags["mlp_bias"]

        def build(i, rope) -> MoeDecoderLayer:  # Llama's pre-norm layer around the relu^2 MLP
            return MoeDecoderLayer(config, i, flags, rope, Relu2MLP(*size, bias))

        CausalLMBase.__init__(self, config, LlamaModel(config, flags, build))
