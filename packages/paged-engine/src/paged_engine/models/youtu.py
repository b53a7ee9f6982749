"""Tencent Youtu-LLM (`YoutuForCausalLM`, model_type "youtu": Youtu-LLM-2B).

DeepSeek-V3's multi-head latent attention (models/deepseek_v2.py: the latent KV cache, the
absorbed queries) in a plain Llama-style stack, as transformers runs it:

    attention  MLA with or without the q bottleneck (`q_lora_rank` None: q_proj), biases on
               q_a_proj / kv_a_proj_with_mqa / o_proj when `attention_bias`; RoPE over the
               qk_rope_head_dim part, (even, odd) pairs when `rope_interleave` (the default),
               NeoX halves otherwise; YaRN's `mscale_all_dim` scales the softmax as DeepSeek's
    mlp        every layer a dense gated MLP of `intermediate_size` (Qwen3's: down(act(gate) *
               up) with the config's `hidden_act`); no experts, no router
    head       tied to the token embedding by default (`tie_word_embeddings` True)

Checkpoints use DeepSeek-V3's attention names and Llama's MLP names.
"""

from __future__ import annotations

from torch import nn

from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.deepseek_v2 import (
    DeepseekModel,
    DeepseekV2ForCausalLM,
    head_dim_sized_rope,
)
from paged_engine.models.llama import LlamaMLP
from paged_engine.models.utils import CausalLMBase


class YoutuForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek's MLA stack with a dense MLP in every layer."""

    tie_default = True  # YoutuConfig's default

    def __init__(self, config) -> None:
        cls = type(self)
        inner = DeepseekModel(config, cls.build_mlp, cls.attention_cls, cls.build_rope(config))
        CausalLMBase.__init__(self, config, inner)
        self.stacked_params = cls.stacked_params  # no experts

    @classmethod
    def build_rope(cls, config) -> RotaryEmbedding:
        return head_dim_sized_rope(config)

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        return LlamaMLP(config, bias=False)
