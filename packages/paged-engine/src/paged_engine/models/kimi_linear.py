"""Kimi Linear (`KimiLinearForCausalLM`, model_type "kimi_linear": Kimi-Linear-48B-A3B): a hybrid
stack of Kimi Delta Attention layers (layers/kda.py) and multi-head latent attention layers
without positional encoding, with DeepSeek-V3's MoE.

    x += mixer(norm(x));  x += mlp(norm(x))        norms: RMSNorm (DeepSeek's)

`config.layer_types` says which layer is which ("linear_attention": KDA, "full_attention": MLA;
transformers builds it from the checkpoint's 1-based `linear_attn_config.kda_layers` /
`full_attn_layers`; 3 KDA : 1 MLA in the released model), `config.mlp_layer_types` which MLP is
dense ("dense", from first_k_dense_replace) and which DeepSeek-V3's MoE ("sparse": sigmoid router
with a correction bias, expert groups, renormalised and scaled weights, shared experts;
layers/deepseek_moe.py).

The MLA layers are DeepSeek-V2's (models/deepseek_v2.py: the absorbed latent cache, one
replicated KV head of kv_lora_rank + qk_rope_head_dim entries) with NoPE: the checkpoint still
has the shared qk_rope_head_dim part of the keys and queries, but nothing rotates it (HF applies
no rope at all), and the softmax scale is qk_head_dim^-0.5 whatever the config's rope settings.
Only these layers hold a paged KV cache; the KDA layers carry a recurrent state per sequence
(worker/recurrent_state.py).

Checkpoint names: Moonshot's (`block_sparse_moe.` for every layer's MLP, experts'
`w1` / `w3` / `w2`, the KDA layers' `q_conv1d` / `k_conv1d` / `v_conv1d`, `f_a_proj`, `dt_bias`,
`A_log` directly under `self_attn`), which transformers 5 also writes; its in-memory names
(`mlp.`, fused experts and conv1d, `self_attn.forget_gate.`) load too.
"""

from __future__ import annotations

import torch
from torch import nn

from paged_engine.layers.attention import AttentionMetadata, LatentAttention
from paged_engine.layers.deepseek_moe import num_routed_experts
from paged_engine.layers.kda import KDA_CONV_RULES, KimiDeltaAttention
from paged_engine.layers.norm import RMSNorm
from paged_engine.models.deepseek_v2 import Glm4MoeLiteForCausalLM, MlaAttention
from paged_engine.models.hybrid import LINEAR_LAYER_TYPES, HybridModel, layer_types
from paged_engine.models.mixtral import check_silu, expert_rules
from paged_engine.models.utils import CausalLMBase, cfg_get


class NoRope(nn.Module):
    """The rope of NoPE attention: leaves q and k as they are. With `num_positions` it also
    holds zero-width cos / sin tables [num_positions, 0] for attention that indexes them
    (Mistral Large 4's NoPE layers: rotating the empty rotary part is a no-op)."""

    def __init__(self, num_positions: int | None = None) -> None:
        super().__init__()
        if num_positions is not None:
            self.register_buffer("cos", torch.zeros(num_positions, 0), persistent=False)
            self.register_buffer("sin", torch.zeros(num_positions, 0), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


class NopeMlaAttention(MlaAttention):
    """MLA whose rope part is never rotated, softmax scale qk_head_dim^-0.5."""

    def __init__(self, config) -> None:
        super().__init__(config, NoRope())
        scale = (self.nope + self.rope_dim) ** -0.5
        self.attn = LatentAttention(self.heads, self.rank + self.rope_dim, self.rank, scale)


class KimiDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, mlp: nn.Module) -> None:
        super().__init__()
        self.is_linear = layer_types(config)[layer_idx] in LINEAR_LAYER_TYPES
        if self.is_linear:
            self.self_attn = KimiDeltaAttention(config, layer_idx)
        else:
            self.self_attn = NopeMlaAttention(config)
        self.mlp = mlp
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, positions, x, kv_cache, md: AttentionMetadata) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.is_linear:
            h = self.self_attn(h, md)
        else:
            h = self.self_attn(positions, h, kv_cache, md)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class KimiLinearForCausalLM(CausalLMBase):
    stacked_params = (
        *KDA_CONV_RULES,
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )
    ignored_weights = ("rotary_emb.inv_freq",)
    ties_head = False  # HF keeps lm_head apart whatever tie_word_embeddings says

    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        # Dense or MoE by mlp_layer_types (else first_k_dense_replace), as GLM-4.7-Flash.
        build_mlp = Glm4MoeLiteForCausalLM.build_mlp
        inner = HybridModel(
            config,
            lambda i: KimiDecoderLayer(config, i, build_mlp(config, i)),
            RMSNorm(config.hidden_size, eps),
            None,
        )
        super().__init__(config, inner)
        # Per-expert names first: the dense and shared MLPs' ".gate_proj" rule matches no expert
        # here (w1 / w3 / w2), but keep the order models/deepseek_v2.py uses.
        rules = expert_rules(num_routed_experts(config), "w1", "w3", "w2")
        self.stacked_params = (*rules, *type(self).stacked_params)

    def rename_weight(self, name: str) -> str:
        return name.replace(".block_sparse_moe.", ".mlp.").replace(
            ".self_attn.forget_gate.", ".self_attn."
        )
