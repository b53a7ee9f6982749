"""Ling (inclusionAI, remote code): `BailingMoeForCausalLM` (Ling v1: Ling-lite, Ling-plus,
Ling-Coder-lite; model_type "bailing_moe") and `BailingMoeV2ForCausalLM` (Ling 2.0 / Ring 2.0:
Ling-mini-2.0, Ling-flash-2.0, Ring-mini-2.0; model_type "bailing_moe" or "bailing_moe_v2"), as
vLLM's bailing_moe.py serves both: GLM-4.5's decoder (models/glm4_moe.py) under Ling's names.

    attention  GQA over a fused `query_key_value` (rows [q heads | k heads | v heads]) with a
               bias when use_qkv_bias; `dense` the output projection; per-head RMSNorm on q / k
               before rope when use_qk_norm (`query_layernorm` / `key_layernorm`); NeoX rope
               over the first rotary_dim (or head_dim * partial_rotary_factor) dims of a head
    mlp        layers i < first_k_dense_replace: a gated SiLU MLP of intermediate_size; later
               ones DeepseekMoe (layers/deepseek_moe.py): score_function "sigmoid" (Ling 2.0:
               the checkpoint's `gate.expert_bias` as the correction bias, groups scored by
               their two best) or "softmax" (Ling v1, the default: no bias, no groups); top
               num_experts_per_tok, renormalized when norm_topk_prob, times
               routed_scaling_factor; plus ungated shared experts of num_shared_experts *
               (moe_shared_expert_intermediate_size or moe_intermediate_size)
    head       `norm_head`: each column of lm_head's weight L2-normalized at load (over the
               vocabulary, as vLLM does)

The config.json is read as JSON (remote_aliases.py) with each release config class's defaults;
Ling 2.0's multi-token-prediction layers (indices from num_hidden_layers) are skipped at load.
The router runs in float32 whatever `router_dtype` says. Refused by name (no reference, or vLLM
and the release code disagree): use_bias=True (biased dense / experts / output projection), a
hidden_act other than SiLU, sigmoid scores without moe_router_enable_expert_bias (or softmax
with it), softmax with n_group groups to choose from, use_qk_norm with use_rmsnorm=False
(LayerNorm q / k norms), rotary_dim beside partial_rotary_factor < 1, norm_head with tied
embeddings.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from paged_engine.layers.deepseek_moe import DeepseekMoe, is_dense_layer
from paged_engine.models.glm4_moe import Glm4MoeForCausalLM
from paged_engine.models.llama import LlamaMLP, llama_head_dim
from paged_engine.models.remote_aliases import common_fields, field
from paged_engine.models.utils import CausalLMBase

# the defaults of each release's config class where config.json omits a field
_V1_DEFAULTS = {"use_bias": True, "rms_norm_eps": 1e-5, "max_position_embeddings": 16384}
_V2_DEFAULTS = {"use_bias": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768}


def _count(raw: dict[str, Any], name: str) -> int:
    """A non-negative int field, 0 when absent or null."""
    value = raw.get(name)
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"config.json field {name!r} must be a non-negative int, got {value!r}")
    return value


def _rope_dim(raw: dict[str, Any], head_dim: int) -> int:
    """The rotated dims of a head: rotary_dim (Ling-1T's field) or head_dim *
    partial_rotary_factor (Ling-mini / flash's)."""
    factor = field(raw, "partial_rotary_factor", float, 1.0)
    rotary = raw.get("rotary_dim")
    if rotary is not None and factor != 1.0:
        raise ValueError(
            "config.json fields 'rotary_dim' and 'partial_rotary_factor' < 1 together are not "
            "supported (vLLM rotates rotary_dim * factor dims, the release code head_dim * factor)"
        )
    dims = field(raw, "rotary_dim", int) if rotary is not None else int(head_dim * factor)
    if not 0 < dims <= head_dim or dims % 2:
        raise ValueError(f"config.json rotary dims {dims} must be even and in (0, {head_dim}]")
    return dims


def _router(raw: dict[str, Any]) -> dict[str, Any]:
    """The routing fields, checked: score function, correction bias, groups."""
    score = raw.get("score_function") or "softmax"
    if score not in ("softmax", "sigmoid"):
        raise ValueError(f"config.json field 'score_function' must be softmax / sigmoid: {score!r}")
    bias = field(raw, "moe_router_enable_expert_bias", bool, False)
    if bias != (score == "sigmoid"):
        raise ValueError(
            f"config.json field 'moe_router_enable_expert_bias'={bias} with score_function "
            f"{score!r} is not supported (sigmoid scores need the bias, softmax ones none)"
        )
    n_group = field(raw, "n_group", int, 1)
    topk_group = field(raw, "topk_group", int, n_group)
    if score == "softmax" and topk_group < n_group:
        raise ValueError(f"config.json field 'n_group'={n_group} with softmax scores")
    return {
        "score_function": score,
        "n_group": n_group,
        "topk_group": topk_group,
        "norm_topk_prob": field(raw, "norm_topk_prob", bool, True),
        "routed_scaling_factor": field(raw, "routed_scaling_factor", float, 1.0),
    }


def _ling_config(raw: dict[str, Any], defaults: dict[str, Any]) -> PretrainedConfig:
    """A Ling config.json under the names models/glm4_moe.py's classes read."""
    if field(raw, "use_bias", bool, defaults["use_bias"]):
        raise ValueError("config.json field 'use_bias'=True is not supported (biased MLPs)")
    act = field(raw, "hidden_act", str, "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"config.json field 'hidden_act' must be silu, got {act!r}")
    hidden = field(raw, "hidden_size", int)
    heads = field(raw, "num_attention_heads", int)
    kv_heads = field(raw, "num_key_value_heads", int, heads)
    if heads % kv_heads:
        raise ValueError(f"config.json field 'num_key_value_heads'={kv_heads} must divide {heads}")
    head_dim = field(raw, "head_dim", int, hidden // heads)
    qk_norm = field(raw, "use_qk_norm", bool, False)
    if qk_norm and not field(raw, "use_rmsnorm", bool, True):
        raise ValueError("config.json field 'use_rmsnorm'=False (LayerNorm q / k norms)")
    tied = field(raw, "tie_word_embeddings", bool, False)
    norm_head = field(raw, "norm_head", bool, False)
    if norm_head and tied:
        raise ValueError("config.json field 'norm_head' with tie_word_embeddings is not supported")
    moe_inter = field(raw, "moe_intermediate_size", int)
    shared = _count(raw, "num_shared_experts")
    shared_inter = field(raw, "moe_shared_expert_intermediate_size", int, moe_inter)
    dense = _count(raw, "first_k_dense_replace")
    scaling = raw.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"config.json field 'rope_scaling' must be a dict, got {scaling!r}")
    fields = {
        **common_fields(raw),
        "vocab_size": field(raw, "vocab_size", int),
        "hidden_size": hidden,
        # the dense layers' width (unused, so optional, without dense layers)
        "intermediate_size": field(raw, "intermediate_size", int, None if dense else moe_inter),
        "num_hidden_layers": field(raw, "num_hidden_layers", int),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": field(raw, "rms_norm_eps", float, defaults["rms_norm_eps"]),
        "max_position_embeddings": field(
            raw, "max_position_embeddings", int, defaults["max_position_embeddings"]
        ),
        "tie_word_embeddings": tied,
        "norm_head": norm_head,
        "attention_bias": field(raw, "use_qkv_bias", bool, False),
        "use_qk_norm": qk_norm,
        "num_experts": field(raw, "num_experts", int),
        "num_experts_per_tok": field(raw, "num_experts_per_tok", int),
        "moe_intermediate_size": moe_inter,
        "shared_intermediate_size": shared * shared_inter,
        "first_k_dense_replace": dense,
        **_router(raw),
    }
    config = PretrainedConfig(**fields)
    # transformers 5's rope dict (layers/rotary.py rope_config reads it); set after
    # construction, which would validate it against PretrainedConfig's own rope fields
    config.rope_parameters = {
        "rope_theta": field(raw, "rope_theta", float, 10000.0),
        "partial_rotary_factor": _rope_dim(raw, head_dim) / head_dim,
        **(scaling or {"rope_type": "default"}),
    }
    config.model_type = raw.get("model_type") or "bailing_moe"
    return config


def bailing_moe_config(raw: dict[str, Any]) -> PretrainedConfig:
    """Ling v1's config.json (BailingMoeConfig's defaults)."""
    return _ling_config(raw, _V1_DEFAULTS)


def bailing_moe_v2_config(raw: dict[str, Any]) -> PretrainedConfig:
    """Ling 2.0's config.json (BailingMoeV2Config's defaults)."""
    return _ling_config(raw, _V2_DEFAULTS)


class BailingMoeForCausalLM(Glm4MoeForCausalLM):
    """GLM-4.5's stack and expert loading under Ling's names; Ling v1 and 2.0 alike."""

    renames = (
        ("model.word_embeddings.", "model.embed_tokens."),
        (".attention.query_layernorm.", ".self_attn.q_norm."),
        (".attention.key_layernorm.", ".self_attn.k_norm."),
        (".attention.dense.", ".self_attn.o_proj."),
        (".attention.", ".self_attn."),  # query_key_value: split by convert_weight
        (".mlp.gate.expert_bias", ".mlp.gate.e_score_correction_bias"),
    )

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        if is_dense_layer(config, layer_idx):
            return LlamaMLP(config, bias=False)
        sigmoid = config.score_function == "sigmoid"
        return DeepseekMoe(
            int(config.num_experts),
            int(config.num_experts_per_tok),
            int(config.hidden_size),
            int(config.moe_intermediate_size),
            int(config.shared_intermediate_size),
            n_group=int(config.n_group),
            topk_group=int(config.topk_group),
            sigmoid=sigmoid,
            correction_bias=sigmoid,
            renormalize=bool(config.norm_topk_prob),
            routed_scaling_factor=float(config.routed_scaling_factor),
        )

    def rename_weight(self, name: str) -> str:
        return CausalLMBase.rename_weight(self, name)

    def _split_qkv(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        d, config = llama_head_dim(self.config), self.config
        sizes = [d * config.num_attention_heads] + [d * config.num_key_value_heads] * 2
        if w.shape[0] != sum(sizes):
            raise ValueError(f"{name}: {w.shape[0]} rows, expected q | k | v = {sizes}")
        for shard, part in zip("qkv", w.split(sizes), strict=True):
            yield name.replace(".query_key_value.", f".{shard}_proj."), part

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if ".self_attn.query_key_value." in name:
            return self._split_qkv(name, w)
        if name == "lm_head.weight" and self.config.norm_head:  # [V, H]: each column unit norm
            return ((name, F.normalize(w.float(), dim=0, eps=1e-7).to(w.dtype)),)
        return ((name, w),)

    def convert_lora_b(self, name: str, b: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if ".self_attn.query_key_value." in name:  # a LoRA B is never normalized
            return self._split_qkv(name, b)
        return ((name, b),)
