"""Mistral Large 3's native checkpoint (params.json with multi-head latent attention, the
`qk_nope_head_dim` field; consolidated*.safetensors): the translation mistral_format.py applies
to such a params.json and to its tensor names.

vLLM serves it as `MistralLarge3ForCausalLM`, DeepSeek-V3's model on the config its Mistral
adapter (transformers_utils/configs/mistral.py) derives; transformers' `Mistral4ForCausalLM`
(Mistral Small 4's HF release) is the same network, and paged serves it (models/mistral4.py),
so params.json becomes a `Mistral4Config`:

    dim, n_layers, n_heads, ...   as for every Mistral model (mistral_format._RENAMED)
    q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
                                  as they are; head_dim, where given, must be nope + rope
    moe.num_experts            -> n_routed_experts
    moe.num_experts_per_tok    -> num_experts_per_tok
    moe.expert_hidden_dim      -> moe_intermediate_size
    moe.num_shared_experts     -> n_shared_experts
    moe.routed_scale           -> routed_scaling_factor
    moe.first_k_dense_replace  -> first_k_dense_replace
    moe.num_expert_groups      -> n_group
    moe.num_expert_groups_per_tok -> topk_group (all groups kept only: see _moe)
    (no moe section: every layer dense, as vLLM's one-expert stand-in computes)
    router                        softmax, no correction bias, top-k renormalized (vLLM's
                                  scoring_func="softmax", norm_topk_prob=True; the mistral4
                                  router of layers/deepseek_moe.py)
    llama_4_scaling.{beta, original_max_position_embeddings}
                               -> rope_parameters llama_4_scaling_beta / original length:
                                  q *= 1 + beta * log(1 + floor(pos / original)), after RoPE
    yarn                       -> YaRN frequencies (mistral_format._rope) with DeepSeek's
                                  magnitude rule, as vLLM's `deepseek_yarn`: softmax scale
                                  times mscale(factor)^2 (mscale_all_dim=1), cos / sin unscaled
                                  (mscale=1); `apply_scale: false` (Large 3's) drops the
                                  magnitude correction entirely (vLLM's
                                  `deepseek_llama_scaling`, after its accuracy fix #57563)

RoPE rotates interleaved pairs (rope_interleave=True), which is how the consolidated tensors
already are: unlike Mistral's wq / wk, no rows are permuted. Tensor names follow vLLM's
MistralLarge3ForCausalLM.remapping (`layers.N.attention.wq_a` -> `self_attn.q_a_proj`, ...).
A `vision_encoder` section (Large 3's Pixtral tower) takes mistral_vision.py's path unchanged:
HF's Mistral 3 wrapper around this text config, as Mistral Small 4's HF release is. FP8 / NVFP4
releases (params.json `quantization_config`) are refused by name.
"""

from __future__ import annotations

import re
from typing import Any

MLA_FIELD = "qk_nope_head_dim"  # its presence marks an MLA (Large 3) params.json
_MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# params.json fields read here (beside mistral_format's common ones)
MLA_FIELDS = {*_MLA_DIMS, "llama_4_scaling", "quantization_config"}
# moe field -> Mistral4Config name
_MOE_FIELDS = {
    "num_experts": "n_routed_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "expert_hidden_dim": "moe_intermediate_size",
    "first_k_dense_replace": "first_k_dense_replace",
    "num_shared_experts": "n_shared_experts",
    "routed_scale": "routed_scaling_factor",
    "num_expert_groups": "n_group",
    "num_expert_groups_per_tok": "topk_group",
}
# moe fields that change no output here: parallelism layouts, and the only values we accept
_MOE_RUNTIME = {"expert_parallel", "expert_model_parallel"}
_MOE_FIXED = {"route_every_n": 1, "renorm_strategy": "WEIGHTS", "use_load_balancing_bias": False}


def is_mla(params: dict[str, Any]) -> bool:
    return bool(params.get(MLA_FIELD))


def mla_config(params: dict[str, Any], common: dict[str, Any], where: str):
    """The Mistral4Config of an MLA params.json. `common`: mistral_format's kwargs for the
    fields every Mistral model shares (renamed sizes, dtype, max_position_embeddings, its
    rope_parameters from rope_theta / yarn); `where`: the file named in errors."""
    import transformers

    if params.get("quantization_config"):
        raise ValueError(
            f"{where} field 'quantization_config' (Mistral Large 3's FP8 / NVFP4 releases) is "
            "not supported in Mistral's native format; serve a BF16 release"
        )
    missing = [f for f in _MLA_DIMS if not params.get(f)]
    if missing:  # (vLLM's Large 3 names no wq for an MLA without the q bottleneck)
        raise ValueError(f"{where} MLA fields {missing} are missing")
    dims = {f: int(params[f]) for f in _MLA_DIMS}
    qk_head_dim = dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]
    if params.get("head_dim", qk_head_dim) != qk_head_dim:
        raise ValueError(
            f"{where} head_dim={params['head_dim']} is not qk_nope_head_dim + qk_rope_head_dim "
            f"= {qk_head_dim}"
        )
    if common.get("layer_types") or common.get("sliding_window"):
        raise ValueError(f"{where} field 'sliding_window' is not supported with MLA")
    kwargs = {k: v for k, v in common.items() if k not in ("head_dim", "sliding_window")}
    kwargs.update(dims)
    kwargs.update(_moe(params.get("moe"), params["n_layers"], params["hidden_dim"], where))
    kwargs["rope_parameters"] = _mla_rope(common["rope_parameters"], params, where)
    return transformers.Mistral4Config(
        architectures=["Mistral4ForCausalLM"],
        norm_topk_prob=True,  # vLLM's Large 3 renormalizes the chosen experts' softmax
        rope_interleave=True,
        **kwargs,
    )


def _moe(moe: dict[str, Any] | None, layers: int, dense: int, where: str) -> dict[str, Any]:
    if not moe:  # vLLM's stand-in: one expert, never reached, every layer dense
        return {
            "first_k_dense_replace": layers,
            "n_routed_experts": 1,
            "num_experts_per_tok": 1,
            "n_shared_experts": 1,
            "moe_intermediate_size": dense,
        }
    moe = {k: v for k, v in moe.items() if v is not None}
    unknown = sorted(set(moe) - set(_MOE_FIELDS) - _MOE_RUNTIME - set(_MOE_FIXED))
    if unknown:
        raise ValueError(f"{where} moe fields {unknown} are not supported")
    for field, value in _MOE_FIXED.items():
        if field in moe and moe[field] != value:
            raise ValueError(
                f"{where} moe.{field}={moe[field]!r} is not supported (only {value!r})"
            )
    out = {new: moe[old] for old, new in _MOE_FIELDS.items() if old in moe}
    for field in ("num_experts", "num_experts_per_tok", "expert_hidden_dim"):
        if field not in moe:
            raise ValueError(f"{where} moe.{field} is missing")
    out.setdefault("first_k_dense_replace", 0)
    out.setdefault("n_shared_experts", 0)
    # vLLM ranks groups by their best softmax score (no correction bias), HF's Mistral 4 by the
    # sum of the best two: equal only where every group is kept
    groups, kept = out.get("n_group", 1), out.get("topk_group", 1)
    if kept != groups:
        raise ValueError(
            f"{where} moe.num_expert_groups_per_tok={kept} < num_expert_groups={groups}: "
            "group-limited routing is not supported"
        )
    return out


def _mla_rope(rope: dict[str, Any], params: dict[str, Any], where: str) -> dict[str, Any]:
    """mistral_format's rope_parameters with DeepSeek's YaRN magnitude rule and the Llama-4
    query scaling (see the module docstring)."""
    rope = dict(rope)
    if rope["rope_type"] == "yarn":
        if rope.pop("attention_factor", None) is not None:  # apply_scale: false
            rope["attention_factor"] = 1.0
            rope.pop("mscale_all_dim")  # no softmax mscale^2 either
        else:
            rope.update(mscale=1.0, mscale_all_dim=1.0)
    scaling = dict(params.get("llama_4_scaling") or {})
    if not scaling:
        return rope
    beta, original = (
        scaling.pop("beta", None),
        scaling.pop("original_max_position_embeddings", None),
    )
    if scaling or beta is None or original is None:
        raise ValueError(
            f"{where} llama_4_scaling needs exactly beta and original_max_position_embeddings"
        )
    if rope.get("original_max_position_embeddings", original) != original:
        raise ValueError(
            f"{where} llama_4_scaling.original_max_position_embeddings={original} differs from "
            f"yarn's {rope['original_max_position_embeddings']}: not supported"
        )
    rope.update(llama_4_scaling_beta=float(beta), original_max_position_embeddings=int(original))
    return rope


# Large 3's module name (after `layers.N.`) -> HF's; attention.wo, the norms and a dense
# layer's feed_forward.w1 / w2 / w3 are named as in every Mistral model (mistral_format.py)
_LAYER_NAMES = {
    "attention.wq_a": "self_attn.q_a_proj",
    "attention.q_a_norm": "self_attn.q_a_layernorm",
    "attention.wq_b": "self_attn.q_b_proj",
    "attention.wkv_a_with_mqa": "self_attn.kv_a_proj_with_mqa",
    "attention.kv_a_norm": "self_attn.kv_a_layernorm",
    "attention.wkv_b": "self_attn.kv_b_proj",
    "gate": "mlp.gate",  # the router
    "shared_experts.w1": "mlp.shared_experts.gate_proj",
    "shared_experts.w2": "mlp.shared_experts.down_proj",
    "shared_experts.w3": "mlp.shared_experts.up_proj",
}
_EXPERT = re.compile(r"experts\.(\d+)\.(w[123])")
_EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def mla_module_name(sub: str) -> str | None:
    """HF's module name (after `model.layers.N.`) of a Large 3 module, else None."""
    if sub in _LAYER_NAMES:
        return _LAYER_NAMES[sub]
    expert = _EXPERT.fullmatch(sub)
    if expert is None:
        return None
    return f"mlp.experts.{expert[1]}.{_EXPERT_PROJ[expert[2]]}"
