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
applies rope exactly when the layer has a window. It has no qk norm. Sliding layers without a
`sliding_window` (which transformers 5 cannot run) are refused by name.

Cohere 2 MoE (`Cohere2MoeForCausalLM`) keeps that parallel block with a feed-forward per
`mlp_layer_types`: "dense" (a gated SiLU MLP of `prefix_dense_intermediate_size`; those layers
rotate even when global if `prefix_dense_sliding_window_pattern` is 1, HF's `force_rope`) or
"sparse": the top `num_experts_per_tok` router logits, softmaxed among themselves ("softmax") or
each through a sigmoid and renormalized when `norm_topk_prob` ("sigmoid"), experts of
`intermediate_size`, plus `num_shared_experts` x intermediate_size of shared experts added
("sum") or averaged with the routed output ("average"). Its norms are RMSNorms when the config
sets `rms_norm_eps`.
"""

from __future__ import annotations

import torch
from torch import nn

from paged_engine.layers.fused_moe import SparseMoeBlock
from paged_engine.layers.norm import HeadLayerNorm, LayerNorm, RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.exaone_moe import is_sparse_layer
from paged_engine.models.gemma2 import check_sliding_has_window, gemma_layer_types
from paged_engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel
from paged_engine.models.mixtral import check_silu, expert_rules, num_experts
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
        mlp: nn.Module | None = None,
        norm: nn.Module | None = None,
    ):
        super().__init__()
        self.self_attn = CohereAttention(config, layer_idx, flags, rope, sliding_window)
        self.mlp = LlamaMLP(config, bias=False) if mlp is None else mlp
        self.input_layernorm = (
            cohere_layer_norm(config, config.hidden_size) if norm is None else norm
        )

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        h = self.input_layernorm(x)
        return x + self.self_attn(positions, h, kv_cache, md) + self.mlp(h)


class CohereForCausalLM(LlamaForCausalLM):
    tie_default = True

    def __init__(self, config):
        flags = self.layer_flags(config)
        specs = self.layer_specs(config)

        cls = type(self)

        def build(i: int, rope: RotaryEmbedding) -> CohereDecoderLayer:
            window, rotates = specs[i]
            rope = rope if rotates else None
            mlp, norm = cls.build_mlp(config, i), cls.build_norm(config)
            return CohereDecoderLayer(config, i, flags, rope, window, mlp, norm)

        inner = LlamaModel(config, flags, build, is_neox_style=False)
        inner.norm = cls.build_norm(config)  # in place of the RMSNorm
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

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        return LlamaMLP(config, bias=False)

    @classmethod
    def build_norm(cls, config) -> nn.Module:
        """The layers' and the final norm."""
        return cohere_layer_norm(config, config.hidden_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        return super().compute_logits(hidden) * self.logit_scale


class Cohere2ForCausalLM(CohereForCausalLM):
    def __init__(self, config):
        if getattr(config, "model_type", None) == "cohere2":
            pattern = int(cfg_get(config, "sliding_window_pattern", 4))
            check_sliding_has_window(config, gemma_layer_types(config, pattern), "Cohere 2")
        super().__init__(config)

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
            else:  # a full layer, or a sliding one without a window (Cohere 2 refuses it): NoPE
                specs.append((None, False))
        return specs


class Cohere2MoeBlock(SparseMoeBlock):
    """Cohere 2 MoE's feed-forward (the module docstring's routing and shared experts)."""

    def __init__(self, config) -> None:
        inter = int(config.intermediate_size)
        super().__init__(
            num_experts(config), int(config.num_experts_per_tok), config.hidden_size, inter, True
        )
        selection = cfg_get(config, "expert_selection_fn", "softmax")
        combine = cfg_get(config, "shared_expert_combination_strategy", "average")
        if selection not in ("softmax", "sigmoid") or combine not in ("sum", "average"):
            raise ValueError(
                f"Cohere 2 MoE: expert_selection_fn {selection!r} (softmax | sigmoid) or "
                f"shared_expert_combination_strategy {combine!r} (sum | average) unsupported"
            )
        self.sigmoid, self.average = selection == "sigmoid", combine == "average"
        self.norm_topk = bool(cfg_get(config, "norm_topk_prob", True))
        shared = int(cfg_get(config, "num_shared_experts", 0) or 0)
        self.shared_experts = (
            LlamaMLP(config, bias=False, intermediate_size=inter * shared) if shared else None
        )

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.sigmoid:  # softmax over the top-k logits: the renormalized softmax
            return super().select_experts(x)
        logits, ids = self.gate(x).float().topk(self.top_k, dim=-1)
        weights = torch.sigmoid(logits)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.shared_experts is None:
            return out
        out = out + self.shared_experts(x)
        return out / 2 if self.average else out


class Cohere2MoeForCausalLM(Cohere2ForCausalLM):
    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        super().__init__(config)
        rules = expert_rules(num_experts(config), "gate_proj", "up_proj", "down_proj")
        self.stacked_params = (*rules, *type(self).stacked_params)

    @classmethod
    def layer_specs(cls, config) -> list[tuple[int | None, bool]]:
        window = cfg_get(config, "sliding_window", None)
        force = int(cfg_get(config, "prefix_dense_sliding_window_pattern", 1)) == 1
        specs: list[tuple[int | None, bool]] = []
        for kind, mlp in zip(config.layer_types, config.mlp_layer_types, strict=True):
            if kind == "sliding_attention" and window is not None:
                specs.append((int(window), True))
            else:  # global: NoPE, unless a dense prefix layer forced to rotate
                specs.append((None, force and mlp == "dense"))
        return specs

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        if is_sparse_layer(config, layer_idx):  # by mlp_layer_types
            return Cohere2MoeBlock(config)
        size = cfg_get(config, "prefix_dense_intermediate_size", None) or config.intermediate_size
        return LlamaMLP(config, bias=False, intermediate_size=int(size))

    @classmethod
    def build_norm(cls, config) -> nn.Module:
        eps = cfg_get(config, "rms_norm_eps", None)
        if eps is None:
            return super().build_norm(config)
        return RMSNorm(config.hidden_size, float(eps))
