"""Shanghai AI Lab InternLM3 (`InternLM3ForCausalLM`, model_type "internlm3":
internlm3-8b-instruct).

The Llama decoder (GQA, gated SiLU MLP, NeoX RoPE; the released model's dynamic NTK scaling)
with InternLM's own bias switches: `qkv_bias` on q / k / v, `bias` on o_proj and on the three
MLP projections (the released model has neither). transformers 5 serves the model type with
its Llama classes, reading `qkv_bias` / `bias` as `attention_bias` / `mlp_bias` (and requires
them equal); the checkpoint's remote code keeps them apart, as here. Checkpoints use Llama's
names; the head is not tied.
"""

from __future__ import annotations

from paged_engine.models.llama import LlamaForCausalLM


class InternLM3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        # transformers 5 configs map qkv_bias -> attention_bias and bias -> mlp_bias
        qkv_bias = getattr(config, "qkv_bias", None)
        if qkv_bias is None:
            qkv_bias = getattr(config, "attention_bias", False)
        bias = getattr(config, "bias", None)
        if bias is None:
            bias = getattr(config, "mlp_bias", False)
        return {
            "qkv_bias": bool(qkv_bias),
            "o_bias": bool(bias),
            "qk_norm": False,
            "mlp_bias": bool(bias),
            "sliding": False,
        }
