"""LaraMini (`LaraMiniForCausalLM`: translated/Lara-4-Mini).

Qwen3.5's hybrid stack (models/qwen3_next.py: Gated DeltaNet linear layers among attention
layers, `config.layer_types`; x += mixer(norm(x)); x += mlp(norm(x))) with these differences,
each as transformers runs it:

    norms      every RMSNorm (the layers', the final one, the q / k ones) multiplies by `weight`
               (not 1 + weight) in float32 and rounds once (Helium's; our Olmo2RMSNorm)
    gated norm the Gated DeltaNet output norm stays in float32 throughout: weight * rmsnorm(o)
               * silu(z), rounded once at the end (GLM-5-Next's; Qwen3.5 rounds the norm first)
    attention  Qwen3's (no output gate, full head_dim RoPE, per-head q / k norms before RoPE);
               "sliding_attention" layers see the last `sliding_window` keys and rotate q and k,
               "full_attention" layers see the whole context with no positional encoding (NoPE),
               their q / k still normed (Flint's layout, without its sinks)
    MoE        every layer (no dense ones): logits = x @ W_g^T in float32, softmax, top-k,
               renormalized when `norm_topk_prob` (Qwen3-Next's router, in float32), plus an
               ungated shared expert of shared_expert_intermediate_size added in full (Flint's
               block, whose router is a sigmoid): our DeepseekMoe with a softmax router
    layers     `config.layer_types`, which transformers' config always writes (by default
               period 5: linear, sliding, linear, full, sliding); one attention layer at least

Checkpoints: the release fuses each linear layer's input projections into one `in_proj`, rows
[q | k | v | z | b | a], and names the gated norm `out_norm` (transformers converts on load and
back on save): both load here, as do transformers' split names. The shared expert
`mlp.shared_expert.*` loads into DeepseekMoe's `shared_experts`; the experts come fused
(`mlp.experts.gate_up_proj` / `down_proj`) or per expert.

Not supported, refused by name: `hidden_act` other than SiLU (`check_silu`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.deepseek_moe import DeepseekMoe
from paged_engine.layers.gated_delta_net import GDN_PROJ_RULES, GatedDeltaNet, GatedRMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.exaone4 import Exaone4Attention
from paged_engine.models.hybrid import LINEAR_LAYER_TYPES, HybridModel, layer_types
from paged_engine.models.llama import LlamaForCausalLM, llama_head_dim
from paged_engine.models.mixtral import check_silu, expert_rules, num_experts
from paged_engine.models.olmo2 import Olmo2RMSNorm
from paged_engine.models.qwen3_next import HybridDecoderLayer
from paged_engine.models.utils import CausalLMBase, cfg_get


class LaraMiniGatedNorm(GatedRMSNorm):
    """weight * rmsnorm(x) * silu(z) in float32, rounded once: x, z [T, H, D]."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = torch.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (self.weight.float() * y * F.silu(z.float())).to(x.dtype)


class LaraMiniAttention(Exaone4Attention):
    """Qwen3's attention with round-once q / k norms, applied in NoPE layers (`rope` None) too;
    the window of the layer's type."""

    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding | None) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        flags = {"qkv_bias": bias, "o_bias": bias, "qk_norm": True, "sliding": True}
        super().__init__(config, layer_idx, flags, rope)
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        self.q_norm = Olmo2RMSNorm(self.head_dim, eps)
        self.k_norm = Olmo2RMSNorm(self.head_dim, eps)


class LaraMiniDecoderLayer(HybridDecoderLayer):
    """Qwen3.5's layer (its forward) over LaraMini's mixers, norms and MoE block."""

    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding) -> None:
        nn.Module.__init__(self)
        kind = layer_types(config)[layer_idx]
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        self.is_linear = kind in LINEAR_LAYER_TYPES
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, layer_idx)
            self.linear_attn.norm = LaraMiniGatedNorm(self.linear_attn.head_v, eps)
        else:
            rotates = kind == "sliding_attention"
            self.self_attn = LaraMiniAttention(config, layer_idx, rope if rotates else None)
        self.mlp = DeepseekMoe(
            num_experts(config),
            int(config.num_experts_per_tok),
            config.hidden_size,
            int(config.moe_intermediate_size),
            int(config.shared_expert_intermediate_size),
            sigmoid=False,
            correction_bias=False,
            renormalize=bool(cfg_get(config, "norm_topk_prob", True)),
        )
        self.input_layernorm = Olmo2RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = Olmo2RMSNorm(config.hidden_size, eps)


class LaraMiniForCausalLM(CausalLMBase):
    tie_default = True
    stacked_params = (*GDN_PROJ_RULES, *LlamaForCausalLM.stacked_params)
    ignored_weights = ("rotary_emb.inv_freq",)
    renames = (
        (".linear_attn.out_norm.", ".linear_attn.norm."),  # the release's name
        (".mlp.shared_expert.", ".mlp.shared_experts."),
    )

    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        rope = get_rope(config, llama_head_dim(config))
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        inner = HybridModel(
            config,
            lambda i: LaraMiniDecoderLayer(config, i, rope),
            Olmo2RMSNorm(config.hidden_size, eps),
            rope,
        )
        super().__init__(config, inner)
        # Per-expert names first: the shared expert's ".gate_proj" rule would match them too.
        rules = expert_rules(num_experts(config), "gate_proj", "up_proj", "down_proj")
        self.stacked_params = (*rules, *type(self).stacked_params)
        # the release's fused in_proj rows: [q | k | v | z | b | a] (whole-model sizes)
        key = int(config.linear_num_key_heads) * int(config.linear_key_head_dim)
        value_heads = int(config.linear_num_value_heads)
        value = value_heads * int(config.linear_value_head_dim)
        self.in_proj_split = [2 * key + value, value, value_heads, value_heads]

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if ".linear_attn.in_proj.weight" not in name:
            yield from super().convert_weight(name, w)
            return
        if w.shape[0] != sum(self.in_proj_split):
            raise ValueError(
                f"{name}: {tuple(w.shape)} is not [q | k | v | z | b | a] of "
                f"{sum(self.in_proj_split)} rows"
            )
        parts = w.split(self.in_proj_split, dim=0)
        for suffix, part in zip(("qkv", "z", "b", "a"), parts, strict=True):
            yield name.replace(".in_proj.", f".in_proj_{suffix}."), part
