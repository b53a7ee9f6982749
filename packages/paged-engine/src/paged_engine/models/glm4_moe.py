"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (`Glm4MoeForCausalLM`): a Llama-style pre-norm decoder with
DeepSeek-V3's MoE MLP (layers/deepseek_moe.py).

    attention  GQA; q / k / v biases when `attention_bias` (o_proj never has one); per-head
               q / k RMSNorm before RoPE when `use_qk_norm`; partial rotary, NeoX style over the
               first head_dim * partial_rotary_factor dims of each head (0.5 by default)
    mlp        layers i < first_k_dense_replace: a dense gated SiLU MLP of intermediate_size;
               later ones: DeepseekMoe (sigmoid scores with a correction bias, group-limited
               top-k, norm_topk_prob, routed_scaling_factor, shared experts)

Checkpoints may carry `num_nextn_predict_layers` multi-token-prediction layers after the
decoder (`model.layers.{num_hidden_layers + j}.*`); no pipeline stage holds a layer past
num_hidden_layers, so loading skips them (CausalLMBase.load_weights), and speculative_config
{"method": "mtp"} runs the first one as a draft head (models/mtp.py).
"""

from __future__ import annotations

from torch import nn

from paged_engine.layers.deepseek_moe import DeepseekMoe, is_dense_layer
from paged_engine.models.llama import LlamaMLP
from paged_engine.models.mixtral import MixtralForCausalLM


class Glm4MoeForCausalLM(MixtralForCausalLM):
    """Mixtral's stack and expert loading (per-expert `mlp.experts.M.*` or fused tensors) with
    GLM's attention flags and DeepSeek's MoE block."""

    expert_names = ("gate_proj", "up_proj", "down_proj")

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        return {
            "qkv_bias": bool(getattr(config, "attention_bias", False)),
            "o_bias": False,
            "qk_norm": bool(getattr(config, "use_qk_norm", False)),
            "mlp_bias": False,
            "sliding": False,
        }

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        if is_dense_layer(config, layer_idx):
            return LlamaMLP(config, bias=False)
        return DeepseekMoe.from_config(config)


class SolarOpenForCausalLM(Glm4MoeForCausalLM):
    """Upstage Solar Open (`SolarOpenForCausalLM`: Solar-Open-100B): GLM-4.5's MoE in every
    layer (its config has no first_k_dense_replace), Llama attention without q / k norms, the
    config's rope over whole heads; GLM-4.5's checkpoint names."""
