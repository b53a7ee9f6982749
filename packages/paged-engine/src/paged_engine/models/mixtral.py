"""Mixtral: Mistral's decoder (GQA, RoPE, optional sliding window) with a sparse MoE MLP in
every layer; also the base of Qwen3-MoE (models/qwen3_moe.py), which only changes the attention
flags and which layers are sparse.

Checkpoints hold each expert's matrices separately, `block_sparse_moe.experts.M.{w1,w3,w2}`
(gate, up, down) and `block_sparse_moe.gate` (the router); transformers 5 models name the block
`mlp` and hold the experts fused (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]).
Both load: per-expert matrices through one stacked rule per (expert, matrix), fused tensors by
name (our parameters have transformers 5's names and layouts).
"""

from __future__ import annotations

from torch import nn

from paged_engine.layers.fused_moe import SparseMoeBlock
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaModel,
    PreNormDecoderLayer,
)
from paged_engine.models.utils import CausalLMBase, StackedRule, cfg_get


def num_experts(config) -> int:
    """E: transformers 5 maps `num_experts` to `num_local_experts`; older configs hold one."""
    value = getattr(config, "num_experts", None)
    return int(value if value is not None else config.num_local_experts)


def expert_rules(count: int, gate: str, up: str, down: str) -> tuple[StackedRule, ...]:
    """Stacked rules (shard id FusedMoE's: (expert, 0 gate | 1 up), or the expert for down)
    routing expert M's HF matrices `experts.M.{gate,up,down}.weight` into the
    fused parameters (".experts.1." never matches inside ".experts.11.")."""
    rules: list[StackedRule] = []
    for m in range(count):
        rules += [
            (".experts.gate_up_proj", f".experts.{m}.{gate}.weight", (m, 0)),
            (".experts.gate_up_proj", f".experts.{m}.{up}.weight", (m, 1)),
            (".experts.down_proj", f".experts.{m}.{down}.weight", m),
        ]
    return tuple(rules)


class MoeDecoderLayer(PreNormDecoderLayer):
    """Llama's pre-norm layer around any MLP: x += attn(norm(x)); x += mlp(norm(x)).
    `attention`: a module with LlamaAttention's forward in its place (EXAONE-MoE's, OLMoE's)."""

    def __init__(
        self,
        config,
        layer_idx: int,
        flags: dict[str, bool],
        rope: RotaryEmbedding | None,
        mlp: nn.Module,
        attention: nn.Module | None = None,
    ) -> None:
        super().__init__()
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        if attention is None:
            attention = LlamaAttention(config, layer_idx, flags, rope)
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)


def check_silu(config, cls_name: str) -> None:
    act = cfg_get(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{cls_name} supports hidden_act='silu' only, got {act!r}")


class MixtralForCausalLM(CausalLMBase):
    # HF's per-expert matrix names: gate, up, down.
    expert_names: tuple[str, str, str] = ("w1", "w3", "w2")
    stacked_params = LlamaForCausalLM.stacked_params
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config):
        check_silu(config, type(self).__name__)
        cls = type(self)
        flags = cls.layer_flags(config)
        inner = LlamaModel(
            config,
            flags,
            lambda i, rope: MoeDecoderLayer(config, i, flags, rope, cls.build_mlp(config, i)),
        )
        super().__init__(config, inner)
        # Expert rules first: the dense MLP's ".gate_proj" would also match an expert's name.
        rules = expert_rules(num_experts(config), *self.expert_names)
        self.stacked_params = (*rules, *type(self).stacked_params)

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        # Llama's attention with the window; "mlp_bias" is read by dense MLPs only (Qwen3-MoE's
        # dense layers). Attention biases follow attention_bias (OLMoE's, AFMoE's), which HF's
        # Mixtral never reads (config_ignored.py sets it False).
        return {**LlamaForCausalLM.layer_flags(config), "sliding": True, "mlp_bias": False}

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(
            num_experts(config),
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            renormalize=True,
        )

    def rename_weight(self, name: str) -> str:
        return name.replace(".block_sparse_moe.", ".mlp.")
