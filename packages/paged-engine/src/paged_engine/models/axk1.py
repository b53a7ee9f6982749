"""SK Telecom A.X K1 (`AXK1ForCausalLM`, model_type "axk1": A.X-K1).

DeepSeek-V3 (models/deepseek_v2.py: multi-head latent attention over the latent KV cache,
layers/deepseek_moe.py's MoE) in GLM-4.7-Flash's layout, as transformers runs it:

    attention  MLA, always through the q bottleneck (q_a_proj, q_a_layernorm, q_b_proj);
               interleaved RoPE unless `rope_interleave` is false; YaRN's `mscale_all_dim`
               scales the softmax
    mlp        per `mlp_layer_types` ("dense": a gated SiLU MLP of intermediate_size;
               "sparse": DeepSeek-V3's MoE, sigmoid scores plus e_score_correction_bias,
               group-limited top-k, renormalized when `norm_topk_prob`, times
               routed_scaling_factor, plus the shared experts); a config without the list
               (the release's remote code) derives it as transformers does: sparse where
               i >= first_k_dense_replace (1) and i % moe_layer_freq (1) == 0
    post norm  A.X's one change: a sparse layer's MoE output (routed plus shared) goes through
               an RMSNorm, `post_mlp_layernorm`, before the residual add; dense layers have none

Checkpoints store that norm beside the layer's norms (`layers.N.post_mlp_layernorm`; HF moves
it into `mlp.` at load, either name loads here), a dense layer's copy included, which is unused
and skipped as transformers skips it. The release routes without a correction bias: a
checkpoint that has no `mlp.gate.e_score_correction_bias` gets zeros, as in transformers.

Refused by name: `q_lora_rank` None (transformers' A.X attention has no plain q_proj), and a
`topk_method` other than "noaux_tc" (transformers always routes over biased sigmoid scores).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.layers.deepseek_moe import DeepseekMoe, num_routed_experts
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.deepseek_v2 import DeepseekV3ForCausalLM, head_dim_sized_rope
from paged_engine.models.llama import LlamaMLP
from paged_engine.models.utils import cfg_get, layer_index

_BIAS = ".mlp.gate.e_score_correction_bias"


def axk1_mlp_layer_types(config) -> list[str]:
    """Each layer's MLP, "dense" or "sparse": `mlp_layer_types`, else AXK1Config's derivation
    from the legacy first_k_dense_replace / moe_layer_freq."""
    num_layers = int(config.num_hidden_layers)
    types = getattr(config, "mlp_layer_types", None)
    if types is None:
        first = int(cfg_get(config, "first_k_dense_replace", 1))
        freq = int(cfg_get(config, "moe_layer_freq", 1))
        types = ["sparse" if i >= first and i % freq == 0 else "dense" for i in range(num_layers)]
    if len(types) != num_layers or any(t not in ("dense", "sparse") for t in types):
        raise ValueError(f"mlp_layer_types must be 'dense' / 'sparse' a layer, got {types}")
    return list(types)


class PostNormedMoe(DeepseekMoe):
    """DeepSeek's MoE block whose whole output (routed plus shared experts, after the
    tensor-parallel all-reduce) goes through `post_mlp_layernorm`. [T, H] -> [T, H]."""

    post_mlp_layernorm: RMSNorm

    @classmethod
    def from_config(
        cls, config, tp_rank: int | None = None, tp_size: int | None = None
    ) -> PostNormedMoe:
        block = super().from_config(config, tp_rank, tp_size)
        assert isinstance(block, PostNormedMoe)
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        block.post_mlp_layernorm = RMSNorm(int(config.hidden_size), eps)
        return block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_mlp_layernorm(super().forward(x))


class AXK1ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3's stack with the MLPs `mlp_layer_types` names and the post-MoE norm."""

    def __init__(self, config) -> None:
        if cfg_get(config, "q_lora_rank", None) is None:
            raise ValueError("AXK1ForCausalLM needs config.q_lora_rank (no plain q_proj)")
        method = cfg_get(config, "topk_method", "noaux_tc")
        if method != "noaux_tc":
            raise ValueError(f"AXK1ForCausalLM routes as noaux_tc only, got topk_method={method!r}")
        super().__init__(config)
        types = axk1_mlp_layer_types(config)
        self.dense_layers = frozenset(i for i, t in enumerate(types) if t == "dense")

    @classmethod
    def build_rope(cls, config) -> RotaryEmbedding:
        return head_dim_sized_rope(config)

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        if axk1_mlp_layer_types(config)[layer_idx] == "dense":
            return LlamaMLP(config, bias=False)
        return PostNormedMoe.from_config(config)

    def rename_weight(self, name: str) -> str:
        name = super().rename_weight(name)
        if ".post_mlp_layernorm." in name and ".mlp.post_mlp_layernorm." not in name:
            name = name.replace(".post_mlp_layernorm.", ".mlp.post_mlp_layernorm.")
        return name

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if ".mlp.post_mlp_layernorm." in name and layer_index(name) in self.dense_layers:
            return ()  # a dense layer's copy: unused
        return super().convert_weight(name, w)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        if not strict:  # an update of some weights: nothing to fill in
            return super().load_weights(weights, strict)
        # this stage's sparse layers' balance biases the checkpoint has not given (yet)
        absent = {n for n, _ in self.named_parameters() if n.endswith(_BIAS)}
        experts = num_routed_experts(self.config)

        def with_zero_biases() -> Iterable[tuple[str, torch.Tensor]]:
            for name, w in weights:
                absent.discard(name)
                yield name, w
            for name in sorted(absent):
                yield name, torch.zeros(experts, dtype=torch.float32)

        return super().load_weights(with_zero_biases(), strict)
