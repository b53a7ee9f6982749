"""LG AI K-EXAONE (`ExaoneMoeForCausalLM`, model_type "exaone_moe": K-EXAONE-236B-A23B).

EXAONE 4.0's attention (models/exaone4.py) in a pre-norm MoE decoder:

    layers     Llama's pre-norm placement, x += attn(norm(x)); x += mlp(norm(x)) (EXAONE 4.0
               puts its norms after the sublayers; this model does not)
    attention  per-head q / k RMSNorms after the projections; with a `sliding_window`, the
               `sliding_attention` layers of config.layer_types (3 of 4, "LLLG") see the last
               sliding_window keys and rotate q and k, the `full_attention` ones see everything
               without positional encoding (NoPE); without a window every layer is global and
               rotates
    mlp        config.mlp_layer_types ("dense" for the first `first_k_dense_replace` layers by
               default): a gated SiLU MLP of intermediate_size; "sparse": DeepSeek-V3's MoE
               (layers/deepseek_moe.py): s = sigmoid(x @ W_g^T) in float32, the top
               num_experts_per_tok of s + e_score_correction_bias within the topk_group best of
               n_group groups, weights s renormalized (norm_topk_prob) times
               routed_scaling_factor, experts of moe_intermediate_size, plus
               num_shared_experts * moe_intermediate_size of shared experts

Checkpoints name experts `mlp.experts.M.{gate,up,down}_proj` (transformers 5's fused
`mlp.experts.gate_up_proj` / `down_proj` load too), the router `mlp.gate.weight`, its balance
bias `mlp.e_score_correction_bias` (HF holds it as `mlp.gate.e_score_correction_bias`: both
load), the shared experts `mlp.shared_experts.*`. Multi-token-prediction weights (`mtp.*`) are
skipped.

Tencent Hy3 (`HYV3ForCausalLM`, model_type "hy_v3": Hy3-preview) is the same MoE decoder with
Qwen3's attention (per-head q / k RMSNorms before RoPE, every layer global and rotating), one
expert group, and its scaling named `router_scaling_factor`; its checkpoints name the router
`mlp.router.gate`, the balance bias `mlp.expert_bias` and the shared experts `mlp.shared_mlp`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.layers.deepseek_moe import DeepseekMoe
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.exaone4 import Exaone4Attention, Exaone4ForCausalLM, exaone4_layers
from paged_engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel
from paged_engine.models.mixtral import (
    MixtralForCausalLM,
    MoeDecoderLayer,
    check_silu,
    expert_rules,
    num_experts,
)
from paged_engine.models.utils import CausalLMBase, cfg_get


def is_sparse_layer(config, layer_idx: int) -> bool:
    """config.mlp_layer_types[i] == "sparse", else i >= first_k_dense_replace."""
    types = getattr(config, "mlp_layer_types", None)
    if types is not None:
        if types[layer_idx] not in ("dense", "sparse"):
            raise ValueError(f"config.mlp_layer_types: unsupported {types[layer_idx]!r}")
        return types[layer_idx] == "sparse"
    return layer_idx >= int(cfg_get(config, "first_k_dense_replace", 1))


def shared_expert_moe(config, scaling: float) -> DeepseekMoe:
    """DeepSeek-V3's MoE as configs name it with `num_experts` / `num_shared_experts`
    (K-EXAONE, Hy3, AFMoE): experts of moe_intermediate_size, the shared ones
    num_shared_experts times that, n_group / topk_group (default one group), renormalized
    unless norm_topk_prob says not, weights times `scaling`."""
    inter = int(config.moe_intermediate_size)
    return DeepseekMoe(
        num_experts(config),
        int(config.num_experts_per_tok),
        config.hidden_size,
        inter,
        inter * int(cfg_get(config, "num_shared_experts", 0) or 0),
        n_group=int(cfg_get(config, "n_group", 1)),
        topk_group=int(cfg_get(config, "topk_group", 1)),
        renormalize=bool(cfg_get(config, "norm_topk_prob", True)),
        routed_scaling_factor=scaling,
        group_score="top2_sum",
    )


class ExaoneMoeForCausalLM(MixtralForCausalLM):
    expert_names = ("gate_proj", "up_proj", "down_proj")
    scaling_name = "routed_scaling_factor"  # the config's name of the MoE weights' scale

    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        cls = type(self)
        flags = cls.layer_flags(config)

        def build(i: int, rope: RotaryEmbedding) -> MoeDecoderLayer:
            attention = cls.build_attention(config, i, flags, rope)
            return MoeDecoderLayer(config, i, flags, None, cls.build_mlp(config, i), attention)

        CausalLMBase.__init__(self, config, LlamaModel(config, flags, build))
        # Expert rules first: the dense rules' ".gate_proj" would also match an expert's name.
        rules = expert_rules(num_experts(config), *self.expert_names)
        self.stacked_params = (*rules, *cls.stacked_params)

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        return Exaone4ForCausalLM.layer_flags(config)

    @classmethod
    def build_attention(cls, config, layer_idx: int, flags, rope: RotaryEmbedding) -> nn.Module:
        """EXAONE 4.0's: sliding layers rotate, global ones are NoPE (exaone4_layers)."""
        window, rotates = exaone4_layers(config)[layer_idx]
        attention = Exaone4Attention(config, layer_idx, flags, rope if rotates else None)
        attention.attn.sliding_window = window  # None: the whole context
        return attention

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(config, bias=False)
        return shared_expert_moe(config, float(cfg_get(config, cls.scaling_name, 1.0) or 1.0))

    def rename_weight(self, name: str) -> str:
        return name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.startswith("mtp.") or ".mtp." in name:
            return ()
        return ((name, w),)


class HYV3ForCausalLM(ExaoneMoeForCausalLM):
    scaling_name = "router_scaling_factor"

    def __init__(self, config) -> None:
        if getattr(config, "mlp_bias", False):  # HF's dense and shared MLPs then have biases
            raise ValueError("HY-V3 with MLP biases (config.mlp_bias=True) is not supported")
        super().__init__(config)

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        return {**LlamaForCausalLM.layer_flags(config), "qk_norm": True}

    @classmethod
    def build_attention(cls, config, layer_idx: int, flags, rope: RotaryEmbedding) -> nn.Module:
        return LlamaAttention(config, layer_idx, flags, rope)

    def rename_weight(self, name: str) -> str:
        # the release's names (transformers 5 maps them at load, and saves them back)
        name = name.replace(".mlp.router.gate.", ".mlp.gate.")
        name = name.replace(".mlp.expert_bias", ".mlp.gate.e_score_correction_bias")
        return super().rename_weight(name.replace(".mlp.shared_mlp.", ".mlp.shared_experts."))
