"""openPangu's MoE releases (remote code; vLLM's openpangu.py serves both with one class):
`PanguUltraMoEForCausalLM` (openPangu-Ultra-MoE-718B, model_type pangu_ultra_moe) and
`PanguProMoEV2ForCausalLM` (openPangu Pro MoE V2). Both are DeepSeek-V3's decoder with three
changes, read from config.json:

    attention  DeepSeek's MLA (models/deepseek_v2.py MlaAttention: q bottleneck or q_proj,
               latent kv, GPT-J-style rope over qk_rope_head_dim unless `rope_interleave` is
               false); plain RoPE (vLLM's deepseek_yarn of factor 1 is plain rope; the release's
               modeling file has no scaling), softmax scale qk_head_dim^-0.5
    router     sigmoid scores, top-k over all experts (no groups: vLLM's num_expert_group 1),
               renormalized when `norm_topk_prob` (and k > 1, as the release's gate does),
               times `routed_scaling_factor`; a correction bias on the choice only where
               `router_enable_expert_bias` (checkpoint `mlp.e_score_correction_bias`, which
               vLLM renames to `mlp.gate.e_score_correction_bias`; both names load)
    norms      `sandwich_norm`: x += post_attention_layernorm(attn(input_layernorm(x)));
               x += post_mlp_layernorm(mlp(pre_mlp_layernorm(x))); without it, DeepSeek's
               pre-norm layer

The release names DeepSeek's fields its own way (its OpenPanguMoEConfig); the translation reads
either spelling: attention_{q,kv}_lora_dim, attention_qk_dim (nope), attention_qk_rope_dim,
attention_v_dim, num_routed_experts, num_shared_experts, num_dense_layers, num_mtp_layers.
Checkpoint names are DeepSeek-V3's (`mlp.gate.weight`, `mlp.experts.M.*`,
`mlp.shared_experts.*`), plus `pre_mlp_layernorm` / `post_mlp_layernorm` with sandwich norms.
The MTP layers (`model.layers.{L}.*`, L >= num_hidden_layers) lie past the stack and are skipped
here; models/openpangu_mtp.py runs the first as a draft head.

Where vLLM and the release's modeling file differ we follow the file: its latent norms
(q_a_layernorm, kv_a_layernorm) keep RMSNorm's default eps 1e-6 (vLLM: rms_norm_eps), and
with one expert a token its weight is not renormalized. vLLM's float16-only rescaling of the
stream by 1 / routed_scaling_factor changes nothing the final norm keeps, so it is not done.

Refused by name (vLLM's other openPangu switches, no reference here): a config without MLA
(Pro MoE V2's Llama-style or sink attention: `param_sink_number`), `use_mhc`, `use_mome`,
`index_topk` (sparse attention), `block_post_layernorm_idx`, sliding windows, `attention_bias`,
`mlp_bias`, an activation other than SiLU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from paged_engine.layers.deepseek_moe import DeepseekMoe, is_dense_layer
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.deepseek_v2 import (
    DeepseekDecoderLayer,
    DeepseekModel,
    DeepseekV2ForCausalLM,
    MlaAttention,
)
from paged_engine.models.llama import LlamaMLP
from paged_engine.models.mixtral import check_silu, expert_rules
from paged_engine.models.remote_aliases import common_fields, field
from paged_engine.models.utils import CausalLMBase, cfg_get

ARCHS = ("PanguUltraMoEForCausalLM", "PanguProMoEV2ForCausalLM")

# our (DeepSeek's) field -> the release's spelling of it
_ALIASES = {
    "q_lora_rank": "attention_q_lora_dim",
    "kv_lora_rank": "attention_kv_lora_dim",
    "qk_nope_head_dim": "attention_qk_dim",
    "qk_rope_head_dim": "attention_qk_rope_dim",
    "v_head_dim": "attention_v_dim",
    "n_routed_experts": "num_routed_experts",
    "n_shared_experts": "num_shared_experts",
    "first_k_dense_replace": "num_dense_layers",
    "num_nextn_predict_layers": "num_mtp_layers",
}
_MLA = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# switches of vLLM's openpangu.py without a reference here: refused when set (truthy)
_REFUSED = (
    "param_sink_number",
    "use_mhc",
    "use_mome",
    "index_topk",
    "block_post_layernorm_idx",
    "sliding_window",
    "sliding_window_list",
    "interleaved_sliding_window",
    "attention_bias",
    "mlp_bias",
)


def _read(raw: dict[str, Any], ours: str, kind: type, default: Any = None) -> Any:
    """raw[ours], else raw[its release spelling], checked like remote_aliases.field; `default`
    when both are absent (None: required)."""
    theirs = _ALIASES.get(ours)
    name = ours if raw.get(ours) is not None or theirs is None else theirs
    return field(raw, name, kind, default)


def _count(raw: dict[str, Any], ours: str, default: int) -> int:
    """A count that may be 0 (dense layers, MTP layers, shared experts)."""
    theirs = _ALIASES.get(ours, ours)
    value = raw.get(ours, raw.get(theirs))
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"config.json field {ours!r} must be a count >= 0, got {value!r}")
    return value


def openpangu_moe_config(raw: dict[str, Any]) -> PretrainedConfig:
    """openPangu Ultra MoE's / Pro MoE V2's config.json under DeepSeek-V3's field names."""
    arch = (raw.get("architectures") or [ARCHS[0]])[0]
    for name in _REFUSED:
        if raw.get(name):
            raise ValueError(f"{arch}: config.json field {name!r}={raw[name]!r} is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        act = raw["hidden_act"]
        raise ValueError(f"{arch}: config.json field 'hidden_act'={act!r} (only silu)")
    absent = [n for n in _MLA if raw.get(n) is None and raw.get(_ALIASES[n]) is None]
    if absent:
        raise ValueError(
            f"{arch}: config.json has no {absent[0]!r} ({_ALIASES[absent[0]]!r}): only openPangu's "
            "MLA attention is supported (not its Llama-style or sink attention)"
        )
    heads = field(raw, "num_attention_heads", int)
    layers = field(raw, "num_hidden_layers", int)
    q_lora = raw.get("q_lora_rank", raw.get(_ALIASES["q_lora_rank"]))
    moe: dict[str, Any] = {}
    experts = raw.get("n_routed_experts", raw.get("num_routed_experts"))
    if experts is not None:
        moe = {
            "n_routed_experts": _read(raw, "n_routed_experts", int),
            "n_shared_experts": _count(raw, "n_shared_experts", 0) or None,
            "moe_intermediate_size": field(raw, "moe_intermediate_size", int),
            "num_experts_per_tok": field(raw, "num_experts_per_tok", int),
            "routed_scaling_factor": field(raw, "routed_scaling_factor", float, 1.0),
            "norm_topk_prob": field(raw, "norm_topk_prob", bool, True),
            "first_k_dense_replace": _count(raw, "first_k_dense_replace", 0),
            "router_enable_expert_bias": field(raw, "router_enable_expert_bias", bool, False),
        }
        if moe["num_experts_per_tok"] > moe["n_routed_experts"]:
            raise ValueError(
                f"{arch}: config.json field 'num_experts_per_tok' exceeds the routed experts"
            )
    theta = field(raw, "rope_theta", float, 25600000.0)
    config = PretrainedConfig(
        **common_fields(raw),
        vocab_size=field(raw, "vocab_size", int),
        hidden_size=field(raw, "hidden_size", int),
        intermediate_size=field(raw, "intermediate_size", int),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=field(raw, "max_position_embeddings", int, 131072),
        rms_norm_eps=field(raw, "rms_norm_eps", float, 1e-5),
        hidden_act="silu",
        rope_theta=theta,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        rope_interleave=field(raw, "rope_interleave", bool, True),
        q_lora_rank=None if q_lora is None else _read(raw, "q_lora_rank", int),
        kv_lora_rank=_read(raw, "kv_lora_rank", int),
        qk_nope_head_dim=_read(raw, "qk_nope_head_dim", int),
        qk_rope_head_dim=_read(raw, "qk_rope_head_dim", int),
        v_head_dim=_read(raw, "v_head_dim", int),
        sandwich_norm=field(raw, "sandwich_norm", bool, False),
        num_nextn_predict_layers=_count(raw, "num_nextn_predict_layers", 0),
        tie_word_embeddings=field(raw, "tie_word_embeddings", bool, False),
        **moe,
    )
    config.model_type = str(raw.get("model_type") or "pangu_ultra_moe")
    return config


class SandwichDecoderLayer(DeepseekDecoderLayer):
    """DeepSeek's layer with openPangu's sandwich norms: each sublayer's input normed before it
    and its output normed before the residual add (`pre_mlp_layernorm`, `post_mlp_layernorm`;
    `post_attention_layernorm` norms the attention's output)."""

    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding, mlp: nn.Module, attn_cls):
        super().__init__(config, layer_idx, rope, mlp, attn_cls)
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        self.pre_mlp_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        h = self.self_attn(positions, self.input_layernorm(x), kv_cache, md)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_mlp_layernorm(self.mlp(self.pre_mlp_layernorm(x)))

    def forward_residual(self, positions, h, residual, kv_cache, md):
        """(this layer's normed MLP output, the stream before it), as PreNormDecoderLayer's:
        the stream is residual + h (h alone where residual is None)."""
        x = h if residual is None else h + residual
        a = self.self_attn(positions, self.input_layernorm(x), kv_cache, md)
        x = x + self.post_attention_layernorm(a)
        return self.post_mlp_layernorm(self.mlp(self.pre_mlp_layernorm(x))), x


def decoder_layer_cls(config) -> type[DeepseekDecoderLayer]:
    return SandwichDecoderLayer if getattr(config, "sandwich_norm", False) else DeepseekDecoderLayer


def openpangu_moe_block(config) -> DeepseekMoe:
    """The MoE MLP: sigmoid routing over all experts (module docstring)."""
    top_k = int(config.num_experts_per_tok)
    inter = int(config.moe_intermediate_size)
    return DeepseekMoe(
        int(config.n_routed_experts),
        top_k,
        int(config.hidden_size),
        inter,
        inter * int(getattr(config, "n_shared_experts", None) or 0),
        sigmoid=True,
        correction_bias=bool(getattr(config, "router_enable_expert_bias", False)),
        renormalize=bool(config.norm_topk_prob) and top_k > 1,
        routed_scaling_factor=float(config.routed_scaling_factor),
    )


class PanguUltraMoEForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3's model (MLA, latent cache) with openPangu's router and sandwich norms."""

    attention_cls: type[MlaAttention] = MlaAttention
    # the release's correction bias sits beside the router (vLLM moves it into `gate`)
    renames = ((".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),)

    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        cls = type(self)
        inner = DeepseekModel(
            config, cls.build_mlp, cls.attention_cls, layer_cls=decoder_layer_cls(config)
        )
        CausalLMBase.__init__(self, config, inner)
        experts = int(getattr(config, "n_routed_experts", None) or 0)
        rules = expert_rules(experts, "gate_proj", "up_proj", "down_proj") if experts else ()
        self.stacked_params = (*rules, *DeepseekV2ForCausalLM.stacked_params)

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        if getattr(config, "n_routed_experts", None) is None or is_dense_layer(config, layer_idx):
            return LlamaMLP(config, bias=False)
        return openpangu_moe_block(config)


class PanguProMoEV2ForCausalLM(PanguUltraMoEForCausalLM):
    """The same model (vLLM serves both with one class); a non-MLA config is refused."""
