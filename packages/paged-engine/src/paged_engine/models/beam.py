"""Reflection Beam (`BeamForCausalLM`, model_type "beam": Beam-1.0-501B-A23B).

Arcee AFMoE's decoder (models/afmoe.py: norms on both sides of each sublayer, OLMo 2's RMSNorm
with the weight multiplied in float32, per-head q / k norms, a sigmoid output gate on the
attention, dense layers then DeepSeek-V3's MoE), as transformers runs it with these changes:

    residual   each add is depth-scaled: x = branch / sqrt(n) + x * sqrt((n - 1) / n), n = 2l + 2
               for layer l's attention and 2l + 3 for its MLP
    attention  the output gate is per channel plus a learned bias per head (`gate_bias` [H]):
               out * sigmoid(gate_proj(x) + gate_bias[head]); the `layer_types` "sliding_attention"
               layers see the last `sliding_window` keys; a layer type whose rope_parameters
               entry is None (the "full_attention" layers by default) runs without positional
               encoding and multiplies q by (1 + (position + 1) / 2048) ** 0.1 (scalable softmax)
               after its norm; the other types rotate with their own rope (NeoX halves)
    mlp        `mlp_layer_types` "dense": a gated SiLU MLP of intermediate_size; "sparse":
               DeepSeek-V3's MoE (layers/deepseek_moe.py) without shared experts: sigmoid
               scores, the top num_experts_per_tok of scores + e_score_correction_bias within
               the topk_group best of n_group groups (a group's two best summed), renormalized
               when norm_topk_prob, the sum times routed_scaling_factor
    logits     soft-capped: cap * tanh(logits / cap), cap = final_logit_softcapping (None: none)

Checkpoints hold transformers 5's names: `self_attn.gate_proj` / `self_attn.gate_bias`,
`mlp.gate.weight` with `mlp.gate.e_score_correction_bias`, fused `mlp.experts.gate_up_proj`
[E, 2I, H] / `down_proj` [E, H, I] (per-expert `mlp.experts.M.{gate,up,down}_proj` load too).
Refused by name: a hidden_act other than SiLU; mlp_layer_types entries other than "dense" /
"sparse".
"""

from __future__ import annotations

import math

import torch
from torch import nn

from paged_engine.distributed.parallel_state import get_tp_rank
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.afmoe import AfmoeAttention, AfmoeForCausalLM
from paged_engine.models.exaone_moe import is_sparse_layer, shared_expert_moe
from paged_engine.models.llama import LlamaMLP, llama_head_dim
from paged_engine.models.mixtral import check_silu, expert_rules, num_experts
from paged_engine.models.olmo2 import Olmo2Model, Olmo2RMSNorm
from paged_engine.models.utils import (
    CausalLMBase,
    StackedRule,
    cfg_get,
    layer_sliding_window,
    soft_cap,
)

SSMAX_LENGTH = 2048.0  # the scalable-softmax query scale's length unit


def layer_ropes(config, head_dim: int, is_neox_style: bool) -> dict[str, RotaryEmbedding | None]:
    """Per layer type of config.layer_types: its rope (one instance shared by the type's
    layers), None where config.rope_parameters holds None for the type (NoPE)."""
    params = getattr(config, "rope_parameters", None) or {}
    return {
        t: None
        if t in params and params[t] is None
        else get_rope(config, head_dim, is_neox_style, layer_type=t)
        for t in set(config.layer_types)
    }


def ssmax_query_scale(positions: torch.Tensor) -> torch.Tensor:
    """[T] positions -> [T, 1] float32 scales (1 + (p + 1) / 2048) ** 0.1, in HF's ops."""
    return torch.exp(0.1 * torch.log1p((positions.float() + 1) / SSMAX_LENGTH))[:, None]


class BeamAttention(AfmoeAttention):
    """AFMoE's attention with a bias per head on the output gate, the window of the layer's
    type, and the scalable-softmax query scale on the NoPE layers (`rope` None)."""

    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding | None) -> None:
        super().__init__(config, layer_idx, rope)
        self.rotary_emb = rope  # by rope_parameters, not (AFMoE's) by window
        self.attn.sliding_window = layer_sliding_window(config, layer_idx)
        heads = self.q_size // self.head_dim  # this rank's
        self.gate_bias = nn.Parameter(torch.empty(heads))
        self.gate_bias.weight_loader = self._load_gate_bias

    def _load_gate_bias(self, param: nn.Parameter, w: torch.Tensor) -> None:
        heads = param.shape[0]
        begin = get_tp_rank() * heads
        if w.dim() != 1 or w.shape[0] < begin + heads:
            raise ValueError(f"gate_bias: {tuple(w.shape)} holds fewer than {begin + heads} heads")
        param.data.copy_(w[begin : begin + heads])

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, -1, d))  # [T, H, d]
        k = self.k_norm(k.reshape(t, -1, d)).reshape(t, -1)
        if self.rotary_emb is None:  # NoPE: q times its position's scale
            q = (q.float() * ssmax_query_scale(positions)[:, :, None]).to(q.dtype).reshape(t, -1)
        else:
            q, k = self.rotary_emb(positions, q.reshape(t, -1), k)
        out = self.attn(q, k, v, kv_cache, md).view(t, -1, d)  # [T, H, d]
        gate = self.out_gate(x).view(t, -1, d) + self.gate_bias[:, None]
        return self.o_proj((out * torch.sigmoid(gate)).reshape(t, -1))


class BeamDecoderLayer(nn.Module):
    """x = add(post_norm(attn(pre_norm(x))), x), the same around the MLP; `add_attention` /
    `add_mlp` are Beam's depth-scaled residual adds (Ergo overrides them)."""

    def __init__(self, config, layer_idx: int, attention: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        eps, d = cfg_get(config, "rms_norm_eps", 1e-6), config.hidden_size
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = Olmo2RMSNorm(d, eps)
        self.post_attention_layernorm = Olmo2RMSNorm(d, eps)
        self.pre_feedforward_layernorm = Olmo2RMSNorm(d, eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(d, eps)
        self.attn_add_idx = 2 * (layer_idx + 1)  # the residual adds counted from 1

    @staticmethod
    def depth_scaled_add(h: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
        return h * (1.0 / math.sqrt(n)) + x * math.sqrt((n - 1) / n)

    def add_attention(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.depth_scaled_add(h, x, self.attn_add_idx)

    def add_mlp(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.depth_scaled_add(h, x, self.attn_add_idx + 1)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        h = self.self_attn(positions, self.input_layernorm(x), kv_cache, md)
        x = self.add_attention(self.post_attention_layernorm(h), x)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return self.add_mlp(self.post_feedforward_layernorm(h), x)


class BeamForCausalLM(AfmoeForCausalLM):
    is_neox_style = True  # the rope's pairing (Ergo's: interleaved)

    def __init__(self, config) -> None:
        self.check_config(config)
        cls = type(self)
        ropes = layer_ropes(config, llama_head_dim(config), cls.is_neox_style)

        def build(i: int) -> nn.Module:
            attention = cls.build_attention(config, i, ropes[config.layer_types[i]])
            return cls.build_layer(config, i, attention, cls.build_mlp(config, i))

        CausalLMBase.__init__(self, config, Olmo2Model(config, build))
        self.stacked_params = cls.weight_rules(config)
        self.final_soft_cap = cfg_get(config, "final_logit_softcapping", None)

    @classmethod
    def check_config(cls, config) -> None:
        check_silu(config, cls.__name__)

    @classmethod
    def weight_rules(cls, config) -> tuple[StackedRule, ...]:
        # Expert rules first: the dense rules' ".gate_proj" would also match an expert's name.
        return (*expert_rules(num_experts(config), *cls.expert_names), *cls.stacked_params)

    @classmethod
    def build_attention(cls, config, layer_idx: int, rope: RotaryEmbedding | None) -> nn.Module:
        return BeamAttention(config, layer_idx, rope)

    @classmethod
    def build_layer(cls, config, layer_idx: int, attention: nn.Module, mlp: nn.Module) -> nn.Module:
        return BeamDecoderLayer(config, layer_idx, attention, mlp)

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(config, bias=False)
        return shared_expert_moe(config, float(cfg_get(config, "routed_scaling_factor", 1.0)))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        return soft_cap(super().compute_logits(hidden), self.final_soft_cap)
