"""The DeepSeek-style MoE MLP (DeepSeek-V3, GLM-4.5 / 4.6 `Glm4MoeForCausalLM`; DeepSeek-V2's
and Mistral 4's softmax routers too): routed experts chosen group by group, plus shared experts
every token goes through. [T, H] -> [T, H].

    router   logits = x @ W_g^T [T, E] in float32 (W_g kept in float32, as HF keeps it);
             `noaux_tc` (V3, GLM; the default): s = sigmoid(logits); the choice ranks
             s + e_score_correction_bias (a per-expert float32 balance bias), the weights are the
             chosen experts' unbiased s, renormalized to sum 1 when `norm_topk_prob`.
             `greedy` / `group_limited_greedy` (V2): s = softmax(logits), no correction bias,
             never renormalized (HF's V2 router ignores norm_topk_prob)
             Mistral 4 (model_type "mistral4", no topk_method): s = softmax(logits), no bias,
             renormalized when `norm_topk_prob`; all of it in the model dtype, W_g too (HF's
             Mistral 4 router keeps no float32)
    groups   with n_group > 1 the E experts form n_group contiguous groups; a token keeps its
             `topk_group` best groups (scored by the sum of a group's two best choice scores,
             "top2_sum"; V2's group_limited_greedy: its best score, "max") and picks its k
             experts among them
    weights  times `routed_scaling_factor`, then y = sum_j w_j * expert_{e_j}(x) (FusedMoE)
    shared   + shared_experts(x): a gated SiLU MLP of n_shared_experts * moe_intermediate_size

Layers i < first_k_dense_replace have a dense MLP of `intermediate_size` instead
(`is_dense_layer`); every later layer is a MoE layer.

Checkpoint names are HF's: `mlp.gate.weight` [E, H], `mlp.gate.e_score_correction_bias` [E],
`mlp.experts.M.{gate_proj,up_proj,down_proj}.weight` (per expert: a model routes them into the
fused experts with `expert_rules(E, "gate_proj", "up_proj", "down_proj")` from models/mixtral.py,
placed before its dense gate / up rules) or transformers 5's fused `mlp.experts.gate_up_proj` /
`down_proj` (by name), and `mlp.shared_experts.{gate_proj,up_proj}` (a model's Llama rules stack
them into `shared_experts.gate_up_proj`) and `mlp.shared_experts.down_proj`.

Tensor parallelism: the router is replicated (all ranks route alike); the routed experts and the
shared experts split their intermediate dims like a dense MLP, each rank computes the partial sum
of both, and the block all-reduces once (a LoRA delta on the shared down_proj, whole on every
rank, is added by rank 0 alone). `DeepseekMoe.partial_sum` is that per-rank sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.distributed.communication import tp_all_reduce
from paged_engine.layers.activation import SiluAndMul
from paged_engine.layers.fused_moe import FusedMoE
from paged_engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear

# topk_method -> whether it scores with a sigmoid and a correction bias (else a softmax)
TOPK_METHODS = {"noaux_tc": True, "greedy": False, "group_limited_greedy": False}
GROUP_SCORES = ("top2_sum", "max")  # a group's score: its two best choice scores' sum, its best


def num_routed_experts(config) -> int:
    """E: `n_routed_experts` (transformers aliases it as num_local_experts / num_experts)."""
    for name in ("n_routed_experts", "num_local_experts", "num_experts"):
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    raise ValueError("config has no n_routed_experts")


def is_dense_layer(config, layer_idx: int) -> bool:
    """Whether decoder layer `layer_idx` has a dense MLP: the first `first_k_dense_replace`."""
    return layer_idx < int(getattr(config, "first_k_dense_replace", None) or 0)


def grouped_topk(
    logits: torch.Tensor,  # [T, E]
    top_k: int,
    *,
    n_group: int = 1,
    topk_group: int = 1,
    correction_bias: torch.Tensor | None = None,  # [E] float32
    sigmoid: bool = True,
    renormalize: bool = True,
    scale: float = 1.0,
    group_score: str | None = None,  # GROUP_SCORES; None: "top2_sum" for sigmoid, else "max"
    float32: bool = True,  # False: score in the logits' dtype (Mistral 4)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64): the routing of the module docstring,
    on the device with static shapes (no host sync, capturable)."""
    if float32:
        logits = logits.float()
    scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias
    if n_group > 1 and topk_group < n_group:  # otherwise every group is kept
        t, e = choice.shape
        grouped = choice.view(t, n_group, e // n_group)
        if group_score is None:
            group_score = "top2_sum" if sigmoid else "max"
        if group_score == "top2_sum":
            group_scores = grouped.topk(min(2, e // n_group), dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        kept = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if scale != 1.0:
        weights = weights * scale
    return weights.float(), ids


class DeepseekRouter(nn.Module):
    """HF's `mlp.gate`: `weight` [E, H] and (noaux_tc) `e_score_correction_bias` [E], both
    float32 whatever the model dtype (`float32=False`: the weight and the routing in the model
    dtype) and replicated on every rank. x [T, H] -> (weights [T, k] float32, ids [T, k])."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        top_k: int,
        *,
        n_group: int = 1,
        topk_group: int = 1,
        sigmoid: bool = True,
        correction_bias: bool = True,
        renormalize: bool = True,
        scale: float = 1.0,
        group_score: str | None = None,
        float32: bool = True,
    ) -> None:
        super().__init__()
        if group_score is not None and group_score not in GROUP_SCORES:
            raise ValueError(f"group_score={group_score!r}; supported: {list(GROUP_SCORES)}")
        if n_group < 1 or num_experts % n_group:
            raise ValueError(f"n_group={n_group} must divide the {num_experts} routed experts")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group={topk_group} must be between 1 and n_group={n_group}")
        reachable = num_experts if topk_group == n_group else topk_group * num_experts // n_group
        if not 1 <= top_k <= reachable:
            raise ValueError(
                f"num_experts_per_tok={top_k} must be between 1 and the {reachable} experts of "
                f"the topk_group={topk_group} groups a token may use"
            )
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.sigmoid, self.renormalize, self.scale = sigmoid, renormalize, float(scale)
        self.group_score, self.float32 = group_score, float32
        dtype = torch.float32 if float32 else None  # None: the model's (the default dtype)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype))
        self.e_score_correction_bias = None
        if correction_bias:
            bias = torch.empty(num_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grouped_topk(
            F.linear(x.float() if self.float32 else x.to(self.weight.dtype), self.weight),
            self.top_k,
            n_group=self.n_group,
            topk_group=self.topk_group,
            correction_bias=self.e_score_correction_bias,
            sigmoid=self.sigmoid,
            renormalize=self.renormalize,
            scale=self.scale,
            group_score=self.group_score,
            float32=self.float32,
        )


class PartialRowLinear(RowParallelLinear):
    """A row-parallel linear that leaves its partial sum to the block's all-reduce. A LoRA
    adapter's delta is whole on every rank (lora/layers.py reduces its shrink), so rank 0
    alone adds it to its partial."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._linear(x, self.bias if self.tp_rank == 0 else None)
        if self.lora is not None:
            if self.tp_rank == 0:
                out = self.lora.apply(x, out)
            else:  # joins the shrink's all-reduce, drops the delta
                self.lora.apply(x, torch.zeros_like(out))
        return out


class SharedExpertsMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate | up fused as `gate_up_proj`; [T, H] -> this rank's
    partial sum (not all-reduced). `bias`: on all three projections (ERNIE 4.5's `use_bias`;
    the down bias is added by rank 0 alone)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        *,
        bias: bool = False,
    ) -> None:
        super().__init__()
        sizes = [intermediate_size, intermediate_size]
        tp = (tp_rank, tp_size)
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, sizes, bias, *tp)
        self.down_proj = PartialRowLinear(intermediate_size, hidden_size, bias, *tp)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DeepseekMoe(nn.Module):
    """Route, run the routed experts and the shared ones, all-reduce once. [T, H] -> [T, H].

    Submodules carry HF's names: `gate` (DeepseekRouter), `experts` (FusedMoE), and
    `shared_experts` (None when `shared_intermediate_size` is 0). `from_config` reads an HF
    DeepSeek-V2 / V3, GLM-4-MoE or Mistral 4 config.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,  # each routed expert's
        shared_intermediate_size: int,  # n_shared_experts * moe_intermediate_size; 0: none
        *,
        n_group: int = 1,
        topk_group: int = 1,
        sigmoid: bool = True,
        correction_bias: bool = True,
        renormalize: bool = True,
        routed_scaling_factor: float = 1.0,
        group_score: str | None = None,
        router_float32: bool = True,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__()
        self.gate = DeepseekRouter(
            num_experts,
            hidden_size,
            top_k,
            n_group=n_group,
            topk_group=topk_group,
            sigmoid=sigmoid,
            correction_bias=correction_bias,
            renormalize=renormalize,
            scale=routed_scaling_factor,
            group_score=group_score,
            float32=router_float32,
        )
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, tp_rank, tp_size)
        self.shared_experts = None
        if shared_intermediate_size:
            shared = SharedExpertsMLP(hidden_size, shared_intermediate_size, tp_rank, tp_size)
            self.shared_experts = shared

    @classmethod
    def from_config(
        cls, config, tp_rank: int | None = None, tp_size: int | None = None
    ) -> DeepseekMoe:
        """The MoE block of an HF config (hidden_act must be SiLU; see the module docstring);
        `tp_rank` / `tp_size` default to this process's place in the tensor-parallel group."""
        act = getattr(config, "hidden_act", None) or "silu"
        if act not in ("silu", "swish"):
            raise ValueError(f"{cls.__name__} supports hidden_act='silu' only, got {act!r}")
        # DeepSeek-V2's dense and shared MLPs then have biases; the types whose transformers
        # MLPs never read mlp_bias load with it False (config_ignored.py)
        if getattr(config, "mlp_bias", False):
            raise ValueError(f"{cls.__name__} has no MLP biases (config.mlp_bias=True)")
        inter = int(config.moe_intermediate_size)
        common = dict(
            num_experts=num_routed_experts(config),
            top_k=int(config.num_experts_per_tok),
            hidden_size=int(config.hidden_size),
            intermediate_size=inter,
            shared_intermediate_size=inter * int(getattr(config, "n_shared_experts", None) or 0),
            routed_scaling_factor=float(getattr(config, "routed_scaling_factor", None) or 1.0),
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        if getattr(config, "model_type", None) == "mistral4":  # its router has no topk_method
            return cls(
                **common,
                n_group=int(getattr(config, "n_group", None) or 1),
                topk_group=int(getattr(config, "topk_group", None) or 1),
                sigmoid=False,
                correction_bias=False,
                renormalize=bool(getattr(config, "norm_topk_prob", False)),
                group_score="top2_sum",
                router_float32=False,
            )
        method = getattr(config, "topk_method", None) or "noaux_tc"
        if method not in TOPK_METHODS:
            raise ValueError(f"unsupported topk_method {method!r}; supported: {list(TOPK_METHODS)}")
        sigmoid = TOPK_METHODS[method]
        scoring = getattr(config, "scoring_func", None)
        if scoring is not None and scoring != ("sigmoid" if sigmoid else "softmax"):
            raise ValueError(f"topk_method={method!r} with scoring_func={scoring!r}")
        grouped = method != "greedy"
        return cls(
            **common,
            n_group=int(getattr(config, "n_group", None) or 1) if grouped else 1,
            topk_group=int(getattr(config, "topk_group", None) or 1) if grouped else 1,
            sigmoid=sigmoid,
            correction_bias=sigmoid,
            renormalize=sigmoid and bool(getattr(config, "norm_topk_prob", False)),
        )

    def partial_sum(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output [T, H]: routed plus shared experts' partial sums."""
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.partial_sum(x)
        return tp_all_reduce(out) if self.experts.tp_size > 1 else out
