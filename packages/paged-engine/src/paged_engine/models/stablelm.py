"""StableLM (`StableLmForCausalLM`: StableLM-2 1.6B / 12B, StableLM-3B-4E1T, StableLM-Zephyr).

The Llama decoder (gated SiLU MLP without biases, grouped-query attention, o_proj without bias)
with LayerNorms (weight and bias) for every norm and partial NeoX RoPE (`partial_rotary_factor`,
a quarter of each head by default). Per config:
- `use_qkv_bias`: biases on q / k / v (StableLM-2 1.6B);
- `use_parallel_residual`: x += attn(ln1(x)) + mlp(ln1(x)), no post-attention norm (2-12B);
- `qk_layernorm`: each q and k head gets its own bias-free LayerNorm before RoPE (2-12B; HF's
  `q_layernorm.norms.{h}.weight`, one per head).

Invariants: head_dim is hidden_size / num_attention_heads. Under tensor parallelism a rank holds
the rows of its own heads' norms (k heads replicated past num_key_value_heads ranks share them);
each checkpoint row routes to the rank holding that head through a per-head stacked rule.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from paged_engine.layers.linear import QKVParallelLinear
from paged_engine.layers.norm import HeadLayerNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from paged_engine.models.starcoder2 import LayerNormDecoderLayer, LayerNormLlamaModel
from paged_engine.models.utils import (
    CausalLMBase,
    StackedRule,
    cfg_get,
    check_heads_span_hidden,
)

# (q norm, k norm) for one layer's q / k / v projection (this rank's heads)
HeadNorms = Callable[[QKVParallelLinear], tuple[nn.Module, nn.Module]]


class QKNormAttention(LlamaAttention):
    """LlamaAttention with its q / k norms made by `norms` for this rank's heads ([T, heads, D]
    -> [T, heads, D], between projection and RoPE): Llama's own qk-norm path with other norms
    (per-head LayerNorms here, Phi's shared LayerNorm). They are `q_norm` / `k_norm`; HF's
    `q_layernorm` / `k_layernorm` load into them."""

    def __init__(
        self,
        config,
        layer_idx: int,
        flags: dict[str, bool],
        rope: RotaryEmbedding,
        norms: HeadNorms,
    ):
        super().__init__(config, layer_idx, {**flags, "qk_norm": False}, rope)
        self.qk_norm = True
        self.q_norm, self.k_norm = norms(self.qkv_proj)


def _per_head_norms(eps: float) -> HeadNorms:
    def build(proj: QKVParallelLinear) -> tuple[nn.Module, nn.Module]:
        kv_shard = proj.tp_rank // proj.kv_replicas  # k heads replicated past num_kv_heads
        return (
            HeadLayerNorm(proj.num_heads, proj.head_dim, eps, proj.tp_rank),
            HeadLayerNorm(proj.num_kv_heads, proj.head_dim, eps, kv_shard),
        )

    return build


def _per_head_norm_rules(config) -> tuple[StackedRule, ...]:
    """HF's `{q,k}_layernorm.norms.{h}.weight` -> our stacked weight, shard id h."""
    heads = config.num_attention_heads
    kv_heads = cfg_get(config, "num_key_value_heads", heads)
    return tuple(
        (f".{p}_norm.weight", f".{p}_layernorm.norms.{h}.weight", h)
        for p, n in (("q", heads), ("k", kv_heads))
        for h in range(n)
    )


class StableLmForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        check_heads_span_hidden(config, "StableLM")  # HF's rope reads head_dim, its heads not
        flags = self.layer_flags(config)
        eps = float(cfg_get(config, "layer_norm_eps", 1e-5))
        parallel = bool(cfg_get(config, "use_parallel_residual", False))
        qk_norm = bool(cfg_get(config, "qk_layernorm", False))

        def build(i: int, rope: RotaryEmbedding) -> nn.Module:
            if qk_norm:
                attn = QKNormAttention(config, i, flags, rope, _per_head_norms(eps))
            else:
                attn = LlamaAttention(config, i, flags, rope)
            mlp = LlamaMLP(config, bias=False)
            return LayerNormDecoderLayer(config.hidden_size, eps, attn, mlp, parallel)

        CausalLMBase.__init__(self, config, LayerNormLlamaModel(config, eps, build))
        if qk_norm:  # this config's head count decides the rules
            self.stacked_params = (*type(self).stacked_params, *_per_head_norm_rules(config))

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        return {
            "qkv_bias": bool(cfg_get(config, "use_qkv_bias", False)),
            "o_bias": False,
            "qk_norm": False,
            "mlp_bias": False,
            "sliding": False,
        }
