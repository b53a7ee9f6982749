"""Google's RecurrentGemma (`RecurrentGemmaForCausalLM`: RecurrentGemma-2B / 9B), the Griffin
architecture: residual blocks whose temporal mixer is either Griffin's recurrent block (a
temporal conv and the RG-LRU, layers/rg_lru.py) or local multi-query attention over a sliding
window (`attention_window_size`), in the repeating pattern of `block_types` ("recurrent",
"recurrent", "attention" in the releases; HF's `layers_block_type` names them
"linear_attention" / "sliding_attention").

    x = embed(ids) * sqrt(D)   (sqrt(D) rounded to bfloat16 whatever the dtype, as HF's buffer)
    x += temporal_block(temporal_pre_norm(x));  x += mlp_block(channel_pre_norm(x))
    logits = cap * tanh(lm_head(final_norm(x)) / cap)      (`logits_soft_cap`)

Norms are Gemma's x / rms(x) * (1 + w). The attention: q / k / v without bias (unless
`attention_bias`), o_proj with one, RoPE (neox layout) over the first `partial_rotary_factor`
(0.5) of each head, scale head_dim^-0.5. The MLP: down(gelu_tanh(gate x) * up x) of width
intermediate_size / 2, every projection biased. The LM head is tied to the embedding.

Only the attention layers hold paged KV (models/hybrid.py); a recurrent layer carries its conv
window and RG-LRU state per sequence (worker/recurrent_state.py), so prefix caching resumes
from state snapshots and chunked prefill continues the state, as for LFM2 / Zamba2.
Refused by name: tensor_parallel_size > 1, an activation other than gelu_pytorch_tanh, a rope
type other than the default one. vLLM has no RecurrentGemma; transformers is the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from paged_engine.distributed.parallel_state import get_tp_size
from paged_engine.layers.activation import ActAndMul, get_act_fn
from paged_engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from paged_engine.layers.norm import GemmaRMSNorm
from paged_engine.layers.rg_lru import RecurrentBlock
from paged_engine.layers.rotary import RotaryEmbedding, context_len_or, rope_config
from paged_engine.models.hybrid import HybridModel, layer_types
from paged_engine.models.llama import LlamaAttention, llama_head_dim
from paged_engine.models.utils import QKV_PROJ_RULES, CausalLMBase, cfg_get, soft_cap

LAYER_TYPES = ("linear_attention", "sliding_attention")

# checkpoint name fragment -> ours (the attention under LlamaAttention's name)
_RENAMES = (
    ("model.final_norm.", "model.norm."),
    (".temporal_block.q_proj.", ".self_attn.q_proj."),
    (".temporal_block.k_proj.", ".self_attn.k_proj."),
    (".temporal_block.v_proj.", ".self_attn.v_proj."),
    (".temporal_block.o_proj.", ".self_attn.o_proj."),
)
_MLP_RULES = (
    (".mlp_block.gate_up_proj.", ".mlp_block.gate_proj.", 0),
    (".mlp_block.gate_up_proj.", ".mlp_block.up_proj.", 1),
)


def check_recurrent_gemma_config(config) -> None:
    """Refuse (ValueError naming the field) what this implementation does not run."""
    if get_tp_size() > 1:
        raise ValueError(
            f"RecurrentGemma does not support tensor_parallel_size={get_tp_size()} (its RG-LRU "
            "gates are not split across ranks)"
        )
    act = cfg_get(config, "hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(
            f"RecurrentGemma supports hidden_activation='gelu_pytorch_tanh', got {act!r}"
        )
    kind = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if kind != "default":
        raise ValueError(f"RecurrentGemma supports the default rope only, got rope_type={kind!r}")
    types = layer_types(config)
    if any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"RecurrentGemma block_types must be recurrent / attention, got {types!r}")


class RecurrentGemmaMlp(nn.Module):
    """down(act(gate x) * up x), gate | up fused as gate_up_proj, all biased: [T, D] -> [T, D]."""

    def __init__(self, hidden_size: int, width: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [width, width], bias=True)
        self.down_proj = RowParallelLinear(width, hidden_size, bias=True)
        self.act_fn = ActAndMul(get_act_fn(act, "hidden_activation"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class RecurrentGemmaLayer(nn.Module):
    """Griffin's residual block over a recurrent or a local-attention temporal block."""

    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        d, eps = config.hidden_size, float(cfg_get(config, "rms_norm_eps", 1e-6))
        act = cfg_get(config, "hidden_activation", "gelu_pytorch_tanh")
        self.is_recurrent = layer_types(config)[layer_idx] == "linear_attention"
        if self.is_recurrent:
            width = int(cfg_get(config, "lru_width", d))
            kernel = int(cfg_get(config, "conv1d_width", 4))
            heads = config.num_attention_heads
            self.temporal_block = RecurrentBlock(
                d, width, heads, kernel, get_act_fn(act, "hidden_activation")
            )
        else:
            bias = bool(getattr(config, "attention_bias", False))
            flags = {"qkv_bias": bias, "o_bias": True, "qk_norm": False, "sliding": True}
            self.self_attn = LlamaAttention(config, layer_idx, flags, rope)
        self.temporal_pre_norm = GemmaRMSNorm(d, eps)
        self.channel_pre_norm = GemmaRMSNorm(d, eps)
        self.mlp_block = RecurrentGemmaMlp(d, config.intermediate_size // 2, act)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        h = self.temporal_pre_norm(x)
        if self.is_recurrent:
            h = self.temporal_block(positions, h, md)
        else:
            h = self.self_attn(positions, h, kv_cache, md)
        x = x + h
        return x + self.mlp_block(self.channel_pre_norm(x))


class RecurrentGemmaForCausalLM(CausalLMBase):
    renames = _RENAMES
    stacked_params = (*QKV_PROJ_RULES, *_MLP_RULES)
    ignored_weights = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq", "normalizer")
    tie_default = True

    def __init__(self, config) -> None:
        check_recurrent_gemma_config(config)
        head_dim = llama_head_dim(config)
        theta, _, partial = rope_config(config)
        rope = RotaryEmbedding(
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            # no max_position_embeddings: local attention and a recurrence serve any length
            max_position=context_len_or(int(getattr(config, "max_position_embeddings", 8192))),
            base=float(theta or 10000.0),
        )
        d = config.hidden_size
        inner = HybridModel(
            config,
            lambda i: RecurrentGemmaLayer(config, i, rope),
            GemmaRMSNorm(d, float(cfg_get(config, "rms_norm_eps", 1e-6))),
            rope,
            # HF's normalizer buffer is bfloat16 whatever the model dtype
            embedding_multiplier=float(torch.tensor(d**0.5, dtype=torch.bfloat16)),
        )
        super().__init__(config, inner)
        self.final_soft_cap = cfg_get(config, "logits_soft_cap", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        return soft_cap(super().compute_logits(hidden), self.final_soft_cap)
