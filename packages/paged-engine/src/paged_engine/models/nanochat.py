"""nanochat (`NanoChatForCausalLM`: karpathy/nanochat-d20 / d32 and fine-tunes in HF format).

Llama's pre-norm decoder with:

    norms   RMSNorms without a weight (`UnitRMSNorm`), also on the token embedding before the
            first layer and at the end, and on each q / k head *after* RoPE
    rope    NeoX halves over the whole head, rotating the other way (transformers' nanochat
            `rotate_half` is (x2, -x1)): the sine table negated
    mlp     fc2(relu(fc1(x))^2), no gate (Nemotron's `Relu2MLP`)
    logits  soft-capped, cap * tanh(logits / cap) (`final_logit_softcapping`, 15)

No biases unless `attention_bias`; the head is untied by default.
"""

from __future__ import annotations

import torch

from paged_engine.layers.norm import UnitRMSNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.llama import LlamaAttention, LlamaModel, PreNormDecoderLayer
from paged_engine.models.nemotron_h import Relu2MLP
from paged_engine.models.utils import QKV_PROJ_RULES, CausalLMBase, cfg_get, soft_cap


class NanoChatAttention(LlamaAttention):
    """Llama's attention with weightless per-head norms on q and k after RoPE."""

    def __init__(self, config, layer_idx: int, flags: dict, rope: RotaryEmbedding) -> None:
        super().__init__(config, layer_idx, flags, rope)
        self.head_norm = UnitRMSNorm(float(cfg_get(config, "rms_norm_eps", 1e-6)))

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        q = self.head_norm(q.view(t, -1, self.head_dim)).view(t, -1)
        k = self.head_norm(k.view(t, -1, self.head_dim)).view(t, -1)
        return self.o_proj(self.attn(q, k, v, kv_cache, md))


class NanoChatLayer(PreNormDecoderLayer):
    def __init__(self, config, layer_idx: int, flags: dict, rope: RotaryEmbedding) -> None:
        super().__init__()
        eps = float(cfg_get(config, "rms_norm_eps", 1e-6))
        self.self_attn = NanoChatAttention(config, layer_idx, flags, rope)
        self.mlp = Relu2MLP(config.hidden_size, config.intermediate_size, False)
        self.input_layernorm = UnitRMSNorm(eps)
        self.post_attention_layernorm = UnitRMSNorm(eps)


class NanoChatModel(LlamaModel):
    def __init__(self, config, flags: dict) -> None:
        super().__init__(config, flags, lambda i, rope: NanoChatLayer(config, i, flags, rope))
        self.rotary_emb.sin.neg_()  # every layer's rope: the rotation the other way
        self.norm = UnitRMSNorm(float(cfg_get(config, "rms_norm_eps", 1e-6)))

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        if hidden is None:  # first pipeline stage: the embedding, normed
            hidden = self.norm(self.embed_tokens(input_ids))
        return super().forward(input_ids, positions, kv_caches, md, hidden)


class NanoChatForCausalLM(CausalLMBase):
    stacked_params = QKV_PROJ_RULES
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config) -> None:
        act = cfg_get(config, "hidden_act", "relu2")
        if act != "relu2":
            raise ValueError(f"NanoChatForCausalLM supports hidden_act='relu2' only, got {act!r}")
        bias = bool(getattr(config, "attention_bias", False))
        flags = {"qkv_bias": bias, "o_bias": bias, "qk_norm": False, "sliding": False}
        super().__init__(config, NanoChatModel(config, flags))
        self.final_soft_cap = cfg_get(config, "final_logit_softcapping", None)

    def rename_weight(self, name: str) -> str:
        return name.replace(".mlp.fc1.", ".mlp.up_proj.").replace(".mlp.fc2.", ".mlp.down_proj.")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        return soft_cap(super().compute_logits(hidden), self.final_soft_cap)
