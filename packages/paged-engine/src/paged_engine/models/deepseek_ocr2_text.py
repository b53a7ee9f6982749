"""DeepSeek-OCR-2's decoder (`DeepseekOcr2ForConditionalGeneration`'s text model, HF's
DeepseekOcr2TextModel, text_config.model_type "deepseek_ocr2_text"), served text-only.

It is DeepSeek-V2's layer with plain multi-head attention in place of MLA:

    attention  Llama's: q_proj / k_proj / v_proj / o_proj (bias: attention_bias), head_dim =
               hidden_size / num_attention_heads, NeoX rope (rotate_half) over the whole head
    MLP        `mlp_layer_types[i]`: "dense" a gated SiLU MLP of intermediate_size, "sparse"
               DeepSeek-V2's MoE (softmax router, topk_method greedy / group_limited_greedy,
               times routed_scaling_factor, never renormalized; shared experts):
               layers/deepseek_moe.py, Glm4MoeLiteForCausalLM's per-layer choice

HF's layer indexes mlp_layer_types unconditionally, so a config without it is refused here.
The images (a SAM tower into a Qwen2 encoder with learned queries, local crops and a global view)
do not run: multimodal_data is refused by the text-only wrapper path.
"""

from __future__ import annotations

from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.deepseek_v2 import Glm4MoeLiteForCausalLM
from paged_engine.models.llama import QKV_PROJ_RULES, LlamaAttention


class _Attention(LlamaAttention):
    """Llama's attention under DeepseekDecoderLayer's constructor (config, rope)."""

    def __init__(self, config, rope: RotaryEmbedding) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        flags = {"qkv_bias": bias, "o_bias": bias, "qk_norm": False, "sliding": False}
        super().__init__(config, 0, flags, rope)


class DeepseekOcr2TextForCausalLM(Glm4MoeLiteForCausalLM):
    """DeepSeek-V2's MoE layers with multi-head attention (see the module docstring)."""

    stacked_params = (*QKV_PROJ_RULES, *Glm4MoeLiteForCausalLM.stacked_params)
    attention_cls = _Attention  # type: ignore[assignment]

    def __init__(self, config) -> None:
        types = getattr(config, "mlp_layer_types", None)
        if types is None:
            raise ValueError(
                "mlp_layer_types=None is not supported: DeepSeek-OCR-2 names each layer's MLP "
                "('dense' / 'sparse')"
            )
        method = getattr(config, "topk_method", None)
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(
                f"topk_method={method!r} is not supported: 'greedy' or 'group_limited_greedy'"
            )
        super().__init__(config)

    @classmethod
    def build_rope(cls, config) -> RotaryEmbedding:
        head_dim = config.hidden_size // config.num_attention_heads
        return get_rope(config, head_dim, is_neox_style=True)
