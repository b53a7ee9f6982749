"""IBM Granite 3.x MoE (`GraniteMoeForCausalLM`: granite-3.0-1b-a400m / 3b-a800m,
granite-3.1-1b-a400m / 3b-a800m, PowerMoE-3b): Granite's decoder (models/granite.py: the four
multipliers, q / k / v / o biases when `attention_bias`) with a sparse MoE MLP in every layer.

    router   logits = x @ W_r^T [T, E]; a token's k largest logits, softmaxed over those k alone
             (= the softmax over all E, top-k, renormalized: `route(..., renormalize=True)`)
    experts  E gated SiLU MLPs of `intermediate_size` (the experts' size: there is no dense MLP)
    layer    x += m * attn(norm(x)); x += m * moe(norm(x)), m = residual_multiplier

Checkpoints hold the experts fused in our layout: `block_sparse_moe.input_linear.weight`
[E, 2I, H] (gate rows, then up rows), `block_sparse_moe.output_linear.weight` [E, H, I] and the
router `block_sparse_moe.router.layer.weight` [E, H]; transformers 5 names them
`block_sparse_moe.experts.{gate_up_proj,down_proj}` and `block_sparse_moe.router.weight` in
memory. Both load (renamed to our `mlp.experts.*`, `mlp.gate.weight`). Tensor parallelism splits
each expert's I (FusedMoE); the router is replicated.
"""

from __future__ import annotations

from torch import nn

from paged_engine.layers.fused_moe import SparseMoeBlock
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.granite import GraniteDecoderLayer, GraniteForCausalLM, granite_multiplier
from paged_engine.models.mixtral import MoeDecoderLayer, check_silu, num_experts

# HF name fragment -> ours, first match wins (checkpoint names, then transformers 5's).
_RENAMES = (
    (".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"),
    (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj"),
    (".block_sparse_moe.router.layer.", ".mlp.gate."),
    (".block_sparse_moe.router.", ".mlp.gate."),
    (".block_sparse_moe.", ".mlp."),
)


class GraniteMoeDecoderLayer(MoeDecoderLayer):
    """Llama's layer around a MoE MLP with Granite's attention scale and residual multiplier."""

    def __init__(
        self, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding, mlp: nn.Module
    ) -> None:
        super().__init__(config, layer_idx, flags, rope, mlp)
        self.self_attn.attn.scale = granite_multiplier(config, "attention_multiplier")
        self.residual_multiplier = granite_multiplier(config, "residual_multiplier")

    forward = GraniteDecoderLayer.forward  # x += m * attn(...); x += m * mlp(...)


class GraniteMoeForCausalLM(GraniteForCausalLM):
    def __init__(self, config):
        check_silu(config, type(self).__name__)
        super().__init__(config)

    @classmethod
    def build_layer(
        cls, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding
    ) -> nn.Module:
        return GraniteMoeDecoderLayer(config, layer_idx, flags, rope, cls.build_mlp(config))

    @classmethod
    def build_mlp(cls, config) -> nn.Module:
        return SparseMoeBlock(
            num_experts(config),
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            renormalize=True,  # softmax over the k chosen logits
        )

    def rename_weight(self, name: str) -> str:
        return rename_granite_moe(name)


def rename_granite_moe(name: str) -> str:
    """A Granite MoE checkpoint's (or transformers 5's) MoE names -> ours."""
    for old, new in _RENAMES:
        if old in name:
            return name.replace(old, new)
    return name
