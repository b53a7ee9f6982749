"""OpenBMB MiniCPM5-MoE (`MiniCPM5MoeForCausalLM`: MiniCPM5-15B-A2.5B).

A Llama-style pre-norm decoder with two parts borrowed:

    attention  GQA with a per-head output gate and no q / k norms: `q_gate_proj` yields each
               head's query and gate side by side, the output is scaled by sigmoid(gate) before
               o_proj (Qwen3-Next's `GatedAttention`, models/qwen3_next.py, without its norms);
               RoPE over whole heads, NeoX halves
    mlp        per `mlp_layer_types` ("dense": a gated SiLU MLP of intermediate_size; "sparse":
               DeepSeek-V3's MoE, layers/deepseek_moe.py: sigmoid scores plus a correction bias,
               group-limited top-k, renormalized and scaled by routed_scaling_factor, shared
               experts)

Checkpoints name the query-and-gate projection `self_attn.q_gate_proj` and experts
`mlp.experts.M.{gate_proj,up_proj,down_proj}` (transformers 5's fused experts load too).
"""

from __future__ import annotations

from torch import nn

from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.deepseek_v2 import Glm4MoeLiteForCausalLM
from paged_engine.models.olmoe import OlmoeForCausalLM
from paged_engine.models.qwen3_next import GatedAttention


class MiniCPM5MoeForCausalLM(OlmoeForCausalLM):
    """OLMoE's stack (Mixtral's pre-norm MoE layers over an attention of the class's choice)
    with the gated attention and GLM-style MLPs."""

    renames = ((".self_attn.q_gate_proj.", ".self_attn.q_proj."),)

    @classmethod
    def build_attention(cls, config, rope: RotaryEmbedding) -> nn.Module:
        return GatedAttention(config, rope, qk_norm=False)

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        return Glm4MoeLiteForCausalLM.build_mlp(config, layer_idx)  # by mlp_layer_types
