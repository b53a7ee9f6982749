"""NVIDIA Nemotron-H (`NemotronHForCausalLM`: Nemotron-H-4B / 8B / 47B / 56B, NVIDIA Nemotron
Nano 2 9B / 12B, Nemotron 3 Nano / Super): a stack of single-mixer blocks, each one of

    "mamba" / "linear_attention"   a Mamba2 mixer (layers/mamba2.py)
    "attention" / "full_attention" grouped-query attention without any positional encoding
    "mlp"                          up -> relu(.)^2 -> down (no gate)
    "moe"                          a mixture of such MLPs and shared ones (Nemotron 3)

as `config.layer_types` (or the older `hybrid_override_pattern`, "M" / "*" / "-") lists them,
every block x += mixer(rmsnorm(x)), a final RMSNorm (`norm_f`). Only the attention blocks hold
paged KV (models/hybrid.py); the Mamba blocks a recurrent state per sequence. Their prompt
tokens' dt is clamped to `time_step_limit` ((0, inf) unless the config says otherwise: as
mamba_ssm and transformers >= 5.25; older transformers clamped at `time_step_min` instead).

Checkpoints name the stack `backbone.` (the Hub's) or `model.` (transformers 5), the embedding
`embeddings` and the final norm `norm_f`; multi-token-prediction weights (`mtp.*`) are skipped.
Nemotron 3's "moe" blocks (`NemotronMoe`): DeepSeek-V3's router, non-gated relu^2 experts
(`FusedMoE` with the "relu2" activation, optionally in a `moe_latent_size` space) and relu^2
shared experts.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.distributed.communication import tp_all_reduce
from paged_engine.layers.deepseek_moe import DeepseekRouter, PartialRowLinear
from paged_engine.layers.fused_moe import FusedMoE
from paged_engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from paged_engine.layers.linear_mixer import check_mixer
from paged_engine.layers.mamba2 import Mamba2Mixer, Mamba2Spec
from paged_engine.layers.norm import RMSNorm
from paged_engine.models.hybrid import LINEAR_LAYER_TYPES, HybridModel, layer_types
from paged_engine.models.llama import LlamaAttention
from paged_engine.models.mixtral import expert_rules
from paged_engine.models.utils import QKV_PROJ_RULES, CausalLMBase, cfg_get
from paged_kernels import MoeActivation

RELU2 = MoeActivation("relu2")  # the experts' non-gated relu(x)^2

# checkpoint prefix -> ours, applied in order
_RENAMES = (
    ("backbone.", "model."),
    ("model.embeddings.", "model.embed_tokens."),
    ("model.norm_f.", "model.norm."),
)


def nemotron_mamba2(config) -> Mamba2Spec:
    check_mixer("Nemotron-H's Mamba2", getattr(config, "mamba_hidden_act", "silu"), 1)
    return Mamba2Spec(
        hidden_size=config.hidden_size,
        num_heads=int(config.mamba_num_heads),
        head_dim=int(config.mamba_head_dim),
        num_groups=int(config.n_groups),
        state_size=int(config.ssm_state_size),
        conv_kernel=int(config.conv_kernel),
        conv_bias=bool(getattr(config, "use_conv_bias", True)),
        proj_bias=bool(getattr(config, "use_bias", False)),
        eps=float(cfg_get(config, "layer_norm_epsilon", 1e-5)),
        dt_limit=tuple(cfg_get(config, "time_step_limit", None) or (0.0, float("inf"))),
    )


class Relu2MLP(nn.Module):
    """down(relu(up(x))^2): [T, D] -> [T, D]."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class PartialRelu2MLP(Relu2MLP):
    """Relu2MLP leaving its partial sum to the block's all-reduce (the shared experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        nn.Module.__init__(self)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias)
        self.down_proj = PartialRowLinear(intermediate_size, hidden_size, bias)


class NemotronMoe(nn.Module):
    """Nemotron 3's MoE block: DeepSeek-V3's router (sigmoid scores plus a correction bias,
    groups, renormalized, scaled), non-gated relu^2 experts (FusedMoE), optionally run in a
    latent space (`moe_latent_size`: fc1_latent_proj before the experts, fc2_latent_proj after),
    plus relu^2 shared experts on the input; one all-reduce. [T, H] -> [T, H]."""

    def __init__(self, config) -> None:
        super().__init__()
        num_experts = int(config.n_routed_experts)
        hidden = config.hidden_size
        latent = getattr(config, "moe_latent_size", None)
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate = DeepseekRouter(
            num_experts,
            hidden,
            int(config.num_experts_per_tok),
            n_group=int(cfg_get(config, "n_group", 1)),
            topk_group=int(cfg_get(config, "topk_group", 1)),
            renormalize=bool(getattr(config, "norm_topk_prob", True)),
            scale=float(cfg_get(config, "routed_scaling_factor", 1.0)),
            group_score="top2_sum",
        )
        width = int(latent) if latent else hidden
        self.experts = FusedMoE(
            num_experts, width, int(config.moe_intermediate_size), activation=RELU2
        )
        # the latent projections are replicated: fc2 maps each rank's partial sum, its bias
        # (mlp_bias, as HF's and vLLM's) added by rank 0 alone
        whole = {"tp_rank": 0, "tp_size": 1}
        self.fc1_latent_proj = (
            ColumnParallelLinear(hidden, width, bias, **whole) if latent else None
        )
        self.fc2_latent_proj = (
            ColumnParallelLinear(width, hidden, bias, **whole) if latent else None
        )
        shared = int(config.moe_shared_expert_intermediate_size)
        self.shared_experts = PartialRelu2MLP(hidden, shared, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        h = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x
        out = self.experts(h, weights, ids)
        if self.fc2_latent_proj is not None:
            fc2 = self.fc2_latent_proj
            out = fc2(out) if self.experts.tp_rank == 0 else fc2._linear(out, None)
        out = out + self.shared_experts(x)
        return tp_all_reduce(out) if self.experts.tp_size > 1 else out


class NemotronHBlock(nn.Module):
    def __init__(self, config, layer_idx: int, flags: dict[str, bool]) -> None:
        super().__init__()
        kind = layer_types(config)[layer_idx]
        self.kind = "mamba" if kind in LINEAR_LAYER_TYPES else kind
        if self.kind == "mamba":
            self.mixer: nn.Module = Mamba2Mixer(nemotron_mamba2(config))
        elif kind == "mlp":
            bias = bool(getattr(config, "mlp_bias", False))
            self.mixer = Relu2MLP(config.hidden_size, config.intermediate_size, bias)
        elif kind == "moe":
            self.mixer = NemotronMoe(config)
        else:
            self.kind = "attention"
            self.mixer = LlamaAttention(config, layer_idx, flags, None)  # no positional encoding
        self.norm = RMSNorm(config.hidden_size, cfg_get(config, "layer_norm_epsilon", 1e-5))

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        h = self.norm(x)
        if self.kind == "mamba":
            h = self.mixer(h, md)
        elif self.kind in ("mlp", "moe"):
            h = self.mixer(h)
        else:
            h = self.mixer(positions, h, kv_cache, md)
        return x + h


class NemotronHForCausalLM(CausalLMBase):
    stacked_params = QKV_PROJ_RULES  # the MLP's up_proj is not a gate_up half
    ignored_weights = ("rotary_emb.inv_freq",)
    ties_head = False  # HF (and vLLM) keep lm_head apart whatever tie_word_embeddings says

    def __init__(self, config) -> None:
        act = cfg_get(config, "mlp_hidden_act", "relu2")
        if act != "relu2":
            raise ValueError(f"NemotronH supports mlp_hidden_act='relu2' only, got {act!r}")
        # no attention biases whatever attention_bias says (HF's and vLLM's NemotronH)
        flags = {"qkv_bias": False, "o_bias": False, "qk_norm": False, "mlp_bias": False}
        flags["sliding"] = False
        inner = HybridModel(
            config,
            lambda i: NemotronHBlock(config, i, flags),
            RMSNorm(config.hidden_size, cfg_get(config, "layer_norm_epsilon", 1e-5)),
            None,
        )
        super().__init__(config, inner)
        if "moe" in layer_types(config):  # per-expert checkpoint names into the fused experts
            rules = expert_rules(int(config.n_routed_experts), "gate_proj", "up_proj", "down_proj")
            self.stacked_params = (*rules, *QKV_PROJ_RULES)

    def rename_weight(self, name: str) -> str:
        for old, new in _RENAMES:
            if name.startswith(old):
                name = new + name[len(old) :]
        # transformers 5's fused experts: the up projection alone sits in our gate_up_proj
        return name.replace(".experts.up_proj", ".experts.gate_up_proj")

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        # Multi-token-prediction modules (`mtp.*`) serve speculation we do not run.
        return super().load_weights(
            ((n, w) for n, w in weights if not n.startswith("mtp.")), strict
        )
