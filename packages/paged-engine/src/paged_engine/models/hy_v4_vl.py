"""The language model of Tencent Hy-V4-VL (`HYV4VLForConditionalGeneration`, text_config
model_type "hy_v4_vl_text"), served text-only through models/text_wrappers.py.

transformers builds it from Hy-V4's decoder (models/hy_v4.py: hyper-connection streams, gated
DSA attention with sinks, clamped MoE) with two differences, each checked against its code:

    latent norms  q_a_layernorm / kv_a_layernorm at config.rms_norm_eps (Hy-V4's keep RMSNorm's
                  1e-6 default, as every MLA model does)
    rope          Qwen3-VL's interleaved M-RoPE over qk_rope_head_dim (mrope_section, three
                  axes); a text token has one position on all three axes, so every frequency
                  sees it: Hy-V4's rope with the same inv_freq (the wrapper's `mrope` flag)

The wrapper's head is lm_head alone (float32 in transformers; the model dtype here, as Hy-V4's).
"""

from __future__ import annotations

from paged_engine.models.hy_v4 import HYV4ForCausalLM


class HYV4VLTextForCausalLM(HYV4ForCausalLM):
    """Hy-V4 with its MLA latent norms at rms_norm_eps."""

    def __init__(self, config) -> None:
        super().__init__(config)  # refuses pipeline parallelism: every layer is built here
        eps = float(config.rms_norm_eps)
        for layer in self.model.layers:
            layer.self_attn.q_a_layernorm.eps = eps
            layer.self_attn.kv_a_layernorm.eps = eps
