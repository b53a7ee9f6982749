"""Cohere: Command R / R+ (`CohereForCausalLM`) and Command R7B / Command A (`Cohere2ForCausalLM`).

Llama's projections, attention and gated SiLU MLP (models/llama.py) in a parallel block, both
sublayers reading one norm of the residual:

    h = input_layernorm(x);  x = x + attn(h) + mlp(h)

and otherwise:

    norms      LayerNorm (mean subtracted) with a weight and no bias, in float32, rounded to the
               activation dtype once; the final norm too
    rope       GPT-J style (interleaved (even, odd) pairs) over the whole head
    qk norm    `use_qk_norm` (Command R+ 08-2024): q and k LayerNorm'd per head before rope, with
               a weight per head ([H, D] and [Hkv, D]); under tensor parallelism each rank holds
               the rows of its own heads, so the norms need no communication
    biases     q / k / v and o_proj when `attention_bias`; the MLP has none
    logits     multiplied by `logit_scale` (0.0625 by default); embeddings tied by default

Cohere 2 adds sliding-window layers: `layer_types` (configs of transformers < 4.53: every
`sliding_window_pattern`-th layer full, 4 by default). Only the sliding layers rotate q and k;
the full-attention layers use no position embedding at all (NoPE), as HF's Cohere2Attention
applies rope exactly when the layer has a window. It has no qk norm.
"""

from __future__ import annotations

import torch
from torch import nn

from paged_engine.layers.norm import HeadLayerNorm, LayerNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.gemma2 import gemma_layer_types
from paged_engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel
from paged_engine.models.utils import CausalLMBase, cfg_get


def cohere_layer_norm(config, size: int) -> LayerNorm:
    return LayerNorm(size, eps=cfg_get(config, "layer_norm_eps", 1e-5), bias=False)


class CohereAttention(LlamaAttention):
    """Llama's attention with an explicit sliding window (Cohere 2's, None: full attention) and,
    with flags["qk_norm"], HeadLayerNorms in place of Llama's shared-weight RMSNorms (the same
    forward: q and k normalized per head, then rotated)."""

    def __init__(
        self,
        config,
        layer_idx: int,
        flags: dict[str, bool],
        rope: RotaryEmbedding | None,
        sliding_window: int | None,
    ):
        super().__init__(config, layer_idx, {**flags, "qk_norm": False, "sliding": False}, rope)
        self.attn.sliding_window = sliding_window
        if flags["qk_norm"]:
            if rope is None:  # LlamaAttention's NoPE path skips the norms
                raise ValueError("qk norms on a layer without rope are not supported")
            proj = self.qkv_proj
            eps = cfg_get(config, "layer_norm_eps", 1e-5)
            self.qk_norm = True
            self.q_norm = HeadLayerNorm(proj.num_heads, self.head_dim, eps, proj.tp_rank)
            kv_shard = proj.tp_rank // proj.kv_replicas  # k heads replicated past num_kv_heads
            self.k_norm = HeadLayerNorm(proj.num_kv_heads, self.head_dim, eps, kv_shard)


class CohereDecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        layer_idx: int,
        flags: dict[str, bool],
        rope: RotaryEmbedding | None,
        sliding_window: int | None = None,
    ):
        super().__init__()
        self.self_attn = CohereAttention(config, layer_idx, flags, rope, sliding_window)
        self.mlp = LlamaMLP(config, bias=False)
        self.input_layernorm = cohere_layer_norm(config, config.hidden_size)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        h = self.input_layernorm(x)
        return x + self.self_attn(positions, h, kv_cache, md) + self.mlp(h)


class CohereForCausalLM(LlamaForCausalLM):
    tie_default = True

    def __init__(self, config):
        flags = self.layer_flags(config)
        specs = self.layer_specs(config)

        def build(i: int, rope: RotaryEmbedding) -> CohereDecoderLayer:
            window, rotates = specs[i]
            return CohereDecoderLayer(config, i, flags, rope if rotates else None, window)

        inner = LlamaModel(config, flags, build, is_neox_style=False)
        inner.norm = cohere_layer_norm(config, config.hidden_size)  # in place of the RMSNorm
        CausalLMBase.__init__(self, config, inner)
        self.logit_scale = float(config.logit_scale)

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        return {
            **super().layer_flags(config),
            "qk_norm": bool(getattr(config, "use_qk_norm", False)),
            "mlp_bias": False,
        }

    @classmethod
    def layer_specs(cls, config) -> list[tuple[int | None, bool]]:
        """Per layer: (sliding window or None, whether it rotates q and k)."""
        return [(None, True)] * config.num_hidden_layers

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        return super().compute_logits(hidden) * self.logit_scale


class Cohere2ForCausalLM(CohereForCausalLM):
    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        return {**super().layer_flags(config), "qk_norm": False}

    @classmethod
    def layer_specs(cls, config) -> list[tuple[int | None, bool]]:
        pattern = int(cfg_get(config, "sliding_window_pattern", 4))
        window = cfg_get(config, "sliding_window", None)
        specs: list[tuple[int | None, bool]] = []
        for kind in gemma_layer_types(config, pattern):
            if kind == "sliding_attention" and window is not None:
                specs.append((int(window), True))
            else:  # a full layer, or a sliding one of a config without a window: NoPE (as HF)
                specs.append((None, False))
        return specs
