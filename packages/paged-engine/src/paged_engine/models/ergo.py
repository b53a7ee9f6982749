"""Amazon Ergo (`ErgoForCausalLM`, model_type "ergo").

Beam's decoder (models/beam.py: norms on both sides of each sublayer with the weight multiplied
in float32, per-head q / k norms, sliding layers beside NoPE ones, dense layers then a sigmoid-
routed MoE), as transformers runs it with these changes:

    residual   a learned gate per channel instead of the depth scale: with w the add's weight,
               x = sigmoid(w) * branch + sqrt(1 + sigmoid(w)) * exp(-softplus(w) / 2) * x, in
               float32 (`attention_residual_gate`, `feedforward_residual_gate`)
    attention  no output gate; q | k | v fused in one `qkv_proj`, head_dim = hidden_size / heads;
               the rope rotates interleaved pairs (GPT-J style); the "full_attention" layers
               (every `global_attention_every_n_layers`-th by default) run without positional
               encoding, q and k each times sqrt(global_attention_scale) when set (here: the
               logits times global_attention_scale), and no scalable-softmax query scale
    mlp        not gated: down(relu(up(x))^2), the dense layers' of first_dense_intermediate_size;
               the MoE's router takes the top num_experts_per_tok of sigmoid scores +
               e_score_correction_bias (one group), renormalized, times moe_routed_scaling_factor
               (the router's weight and the weights rounded to the model dtype, as HF rounds
               them); each routed expert's output is RMS-normalized with that expert's own
               weight (`post_expert_norm` [E, H]) before the weighted sum; the shared expert
               (shared_intermediate_size) is RMS-normalized too (`shared_experts.norm`)
    logits     no soft cap; the head is never tied to the embedding

Checkpoints load under transformers 5's names (`mlp.gate.linear.weight`, `mlp.experts.up_proj`
[E, H, I] and `down_proj` [E, I, H], stored transposed against our experts) and under the
released layout's (`tok_embeddings`, `layers.L.attention.wqkv`, `feed_forward.gate_kernel`
[H, E], `feed_forward.shared_up_proj` [H, I], ...: transformers' conversion mapping, here in
`_RELEASE_RENAMES` and `convert_weight`). Refused by name: mlp_layer_types entries other than
"dense" / "sparse".
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.distributed.communication import tp_all_reduce
from paged_engine.layers.deepseek_moe import DeepseekRouter, grouped_topk
from paged_engine.layers.fused_moe import FusedMoE
from paged_engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.beam import BeamDecoderLayer, BeamForCausalLM
from paged_engine.models.exaone_moe import is_sparse_layer
from paged_engine.models.llama import LlamaAttention
from paged_engine.models.mixtral import num_experts
from paged_engine.models.nemotron_h import RELU2, Relu2MLP
from paged_engine.models.olmo2 import Olmo2RMSNorm
from paged_engine.models.phi3 import Phi3ForCausalLM
from paged_engine.models.utils import QKV_PROJ_RULES, StackedRule, cfg_get

# the released checkpoints' names -> transformers' (its conversion mapping for "ergo")
_RELEASE_RENAMES: tuple[tuple[str, str], ...] = (
    (".attention_norm.", ".input_layernorm."),
    (".post_attention_norm.", ".post_attention_layernorm."),
    (".ffn_norm.", ".pre_feedforward_layernorm."),
    (".post_ffn_norm.", ".post_feedforward_layernorm."),
    (".post_attention_residual.scale", ".attention_residual_gate.weight"),
    (".post_ffn_residual.scale", ".feedforward_residual_gate.weight"),
    (".attention.wqkv.", ".self_attn.qkv_proj."),
    (".attention.wo.", ".self_attn.o_proj."),
    (".attention.q_norm.", ".self_attn.q_norm."),
    (".attention.k_norm.", ".self_attn.k_norm."),
    (".feed_forward.up.", ".mlp.up_proj."),
    (".feed_forward.down.", ".mlp.down_proj."),
    (".feed_forward.gate_kernel", ".mlp.gate.weight_t"),  # [H, E]: transposed by convert_weight
    (".feed_forward.router_bias", ".mlp.gate.e_score_correction_bias"),
    (".feed_forward.up_proj", ".mlp.experts.up_proj"),
    (".feed_forward.down_proj", ".mlp.experts.down_proj"),
    (".feed_forward.expert_output_norm.scale", ".mlp.experts.post_expert_norm.weight"),
    (".feed_forward.shared_up_proj", ".mlp.shared_experts.up_proj.weight_t"),
    (".feed_forward.shared_down_proj", ".mlp.shared_experts.down_proj.weight_t"),
    (".feed_forward.shared_expert_output_norm.scale", ".mlp.shared_experts.norm.weight"),
)
_RELEASE_PREFIXES = (
    ("tok_embeddings.", "model.embed_tokens."),
    ("norm.", "model.norm."),
    ("output.", "lm_head."),
    ("layers.", "model.layers."),
)


class ErgoAttention(LlamaAttention):
    """Llama's attention with float32-weight q / k norms applied on every layer (NoPE ones
    too), and the full layers' logits times global_attention_scale."""

    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding | None) -> None:
        flags = {"qkv_bias": False, "o_bias": False, "qk_norm": True, "sliding": True}
        super().__init__(config, layer_idx, flags, rope)
        eps, d = cfg_get(config, "rms_norm_eps", 1e-12), self.head_dim
        self.q_norm, self.k_norm = Olmo2RMSNorm(d, eps), Olmo2RMSNorm(d, eps)
        scale = getattr(config, "global_attention_scale", None)
        if self.attn.sliding_window is None and scale is not None:
            self.attn.scale = self.attn.scale * float(scale)  # (q * sqrt(s)) . (k * sqrt(s))

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, -1, d)).reshape(t, -1)
        k = self.k_norm(k.reshape(t, -1, d)).reshape(t, -1)
        if self.rotary_emb is not None:  # the full layers: NoPE
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, md))


class ErgoResidualGate(nn.Module):
    """sigmoid(w) * h + sqrt(1 + sigmoid(w)) * exp(-softplus(w) / 2) * x, in float32."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=torch.float32))

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.float()
        branch = w.sigmoid()
        keep = torch.sqrt(1.0 + branch) * torch.exp(-0.5 * F.softplus(w))
        return (branch * h.float() + keep * x.float()).to(x.dtype)


class ErgoDecoderLayer(BeamDecoderLayer):
    def __init__(self, config, layer_idx: int, attention: nn.Module, mlp: nn.Module) -> None:
        super().__init__(config, layer_idx, attention, mlp)
        self.attention_residual_gate = ErgoResidualGate(config.hidden_size)
        self.feedforward_residual_gate = ErgoResidualGate(config.hidden_size)

    def add_attention(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.attention_residual_gate(h, x)

    def add_mlp(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.feedforward_residual_gate(h, x)


class ErgoRouter(DeepseekRouter):
    """DeepSeek-V3's one-group router with HF Ergo's roundings: the weight [E, H] (float32)
    rounded to the input's dtype before a float32 product, the weights after routing too."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.to(x.dtype).float())
        weights, ids = grouped_topk(
            logits,
            self.top_k,
            correction_bias=self.e_score_correction_bias,
            renormalize=True,
            scale=self.scale,
        )
        return weights.to(x.dtype).float(), ids


class ErgoExpertNorm(nn.Module):
    """Each expert's RMSNorm weight, `weight` [E, H] float32."""

    def __init__(self, num_experts: int, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.eps = eps

    def forward(self, y: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # [N, H], [N]
        normed = F.rms_norm(y.float(), (y.shape[-1],), eps=self.eps)
        return (normed * self.weight[ids]).to(y.dtype)


class RouteNormedExperts(FusedMoE):
    """FusedMoE experts whose each route's output is normed (`route_norm`) before its routing
    weight scales it (Ergo's per-expert norm, Muse's Spark experts' shared one): the routes run
    one row each at unit weight, reduced over TP ranks before the norm."""

    def route_norm(self, y: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """y [N, H] the routes' whole outputs, ids [N] their experts -> normed [N, H]."""
        raise NotImplementedError

    def routes(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing weights / ids [T, k] -> sum_j w_j * norm(expert_{e_j}(x)) [T, H]."""
        t, k = ids.shape
        rows = x.repeat_interleave(k, dim=0)  # [T*k, H]: one row a route, unit weight
        flat = ids.reshape(-1, 1)
        y = super().forward(rows, torch.ones(flat.shape, device=x.device), flat)
        if self.tp_size > 1:  # each route's whole output before its norm
            y = tp_all_reduce(y)
        y = self.route_norm(y, flat.flatten()).view(t, k, -1)
        return (y * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)


class ErgoExperts(RouteNormedExperts):
    """Non-gated relu^2 experts (FusedMoE: up in gate_up_proj [E, I, H], down_proj [E, H, I])
    with `post_expert_norm`."""

    def __init__(self, config) -> None:
        super().__init__(
            num_experts(config),
            config.hidden_size,
            int(config.moe_intermediate_size),
            activation=RELU2,
        )
        eps = float(cfg_get(config, "rms_norm_eps", 1e-12))
        self.post_expert_norm = ErgoExpertNorm(self.num_experts, config.hidden_size, eps)

    def route_norm(self, y: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.post_expert_norm(y, ids)  # expert e's own norm weight


class ErgoSharedExpert(Relu2MLP):
    """down(relu(up(x))^2), RMS-normalized (`norm`)."""

    def __init__(self, config) -> None:
        nn.Module.__init__(self)
        hidden, inter = config.hidden_size, int(config.shared_intermediate_size)
        self.up_proj = ColumnParallelLinear(hidden, inter, False)
        self.down_proj = RowParallelLinear(inter, hidden, False)
        self.norm = Olmo2RMSNorm(hidden, float(cfg_get(config, "rms_norm_eps", 1e-12)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(super().forward(x))


class ErgoMoe(nn.Module):
    """routed experts (each output normalized) + the normalized shared expert. [T, H]."""

    def __init__(self, config) -> None:
        super().__init__()
        self.gate = ErgoRouter(
            num_experts(config),
            config.hidden_size,
            int(config.num_experts_per_tok),
            scale=float(cfg_get(config, "moe_routed_scaling_factor", 1.0)),
        )
        self.experts = ErgoExperts(config)
        self.shared_experts = ErgoSharedExpert(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts.routes(x, weights, ids) + self.shared_experts(x)


class ErgoForCausalLM(BeamForCausalLM):
    is_neox_style = False
    ties_head = False  # HF keeps lm_head apart whatever tie_word_embeddings says (Beam ties)

    def __init__(self, config) -> None:
        super().__init__(config)
        self.final_soft_cap = None

    @classmethod
    def check_config(cls, config) -> None:
        pass  # relu^2 throughout; HF's config has no hidden_act

    @classmethod
    def weight_rules(cls, config) -> tuple[StackedRule, ...]:
        return QKV_PROJ_RULES  # the MLPs' up_proj / down_proj load as they are, experts fused

    @classmethod
    def build_attention(cls, config, layer_idx: int, rope: RotaryEmbedding | None) -> nn.Module:
        return ErgoAttention(config, layer_idx, rope)

    @classmethod
    def build_layer(cls, config, layer_idx: int, attention: nn.Module, mlp: nn.Module) -> nn.Module:
        return ErgoDecoderLayer(config, layer_idx, attention, mlp)

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            inter = int(config.first_dense_intermediate_size)
            return Relu2MLP(config.hidden_size, inter, bias=False)
        return ErgoMoe(config)

    def rename_weight(self, name: str) -> str:
        for theirs, ours in _RELEASE_PREFIXES:
            if name.startswith(theirs):
                name = ours + name[len(theirs) :]
                break
        for theirs, ours in _RELEASE_RENAMES:
            name = name.replace(theirs, ours)
        return name.replace(".mlp.gate.linear.", ".mlp.gate.")

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.endswith(".weight_t"):  # the release's [in, out] router / shared expert
            yield name.removesuffix("_t"), w.t()
        elif name.endswith((".mlp.experts.up_proj", ".mlp.experts.down_proj")):
            # HF's x @ W layout [E, in, out] -> ours [E, out, in]
            yield name.replace(".up_proj", ".gate_up_proj"), w.transpose(1, 2)
        else:  # the fused qkv_proj split as Phi-3's (rows q | k | v)
            yield from Phi3ForCausalLM.convert_weight(self, name, w)
