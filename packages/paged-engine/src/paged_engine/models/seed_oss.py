"""ByteDance Seed-OSS (`SeedOssForCausalLM`: Seed-OSS-36B-Base / -Instruct): the Llama decoder
with its biases set apart.

    attention_bias      biases on q / k / v (True by default, unlike Llama)
    attention_out_bias  a bias on o_proj (False by default)
    mlp_bias            biases on gate / up / down (False by default)

`head_dim` is explicit (128, against hidden / heads = 64 in the 36B model). The dropouts of HF's
attention output and MLP are training-only. Everything else (RMSNorm, GQA, NeoX rope, gated SiLU,
untied head by default) is Llama's.
"""

from __future__ import annotations

from paged_engine.models.llama import LlamaForCausalLM
from paged_engine.models.utils import cfg_get


class SeedOssForCausalLM(LlamaForCausalLM):
    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        return {
            "qkv_bias": bool(cfg_get(config, "attention_bias", True)),
            "o_bias": bool(cfg_get(config, "attention_out_bias", False)),
            "qk_norm": False,
            "mlp_bias": bool(cfg_get(config, "mlp_bias", False)),
            "sliding": False,
        }
