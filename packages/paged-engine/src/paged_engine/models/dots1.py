"""rednote dots.llm1 (`Dots1ForCausalLM`, model_type "dots1": dots.llm1.base / .inst, 142B total,
14B active): Qwen3's attention with DeepSeek-V3's MoE MLP (layers/deepseek_moe.py), i.e.
GLM-4.5's layout (models/glm4_moe.py) with Qwen3's attention flags.

    attention  GQA; per-head q / k RMSNorm before RoPE (always); q / k / v / o biases when
               `attention_bias`; full rotary; `sliding_attention` layers in config.layer_types
               (from sliding_window and max_window_layers: layer i slides when
               i >= max_window_layers) see the last sliding_window keys
    mlp        layers i < first_k_dense_replace: a dense gated SiLU MLP of intermediate_size;
               later ones: s = sigmoid(x @ W_g^T) (float32), the top-k of
               s + e_score_correction_bias within the topk_group best of n_group groups,
               weighted by their s (renormalized when norm_topk_prob) times
               routed_scaling_factor, experts of moe_intermediate_size, plus
               n_shared_experts * moe_intermediate_size of shared experts

Checkpoint names are DeepSeek-V3's: `mlp.gate.weight`, `mlp.gate.e_score_correction_bias`,
per-expert `mlp.experts.M.{gate,up,down}_proj.weight` (or transformers 5's fused
`mlp.experts.gate_up_proj` / `down_proj`), `mlp.shared_experts.*`.
"""

from __future__ import annotations

from paged_engine.models.glm4_moe import Glm4MoeForCausalLM
from paged_engine.models.qwen3 import Qwen3ForCausalLM


class Dots1ForCausalLM(Glm4MoeForCausalLM):
    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        return Qwen3ForCausalLM.layer_flags(config)  # q / k norms, biases, sliding layers
