"""Kimi Delta Attention (KDA): the linear-attention token mixer of Kimi Linear (3 of every 4
layers of Kimi-Linear-48B-A3B), Gated DeltaNet with a decay per key channel.

Per token, H heads of D channels (as many key heads as value heads): q, k, v = q_proj(x),
k_proj(x), v_proj(x), each through its own causal depthwise conv of width K and SiLU; a write
strength per head beta = sigmoid(b_proj(x)); a log-decay per head and key channel

    g = -exp(A_log[h]) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)      [H, D], float32

(f_a_proj a low-rank bottleneck of D). The recurrence keeps one [D, D] matrix S per head (q and
k L2-normalised, q scaled by D^-0.5):

    S = diag(exp(g)) S;  S += k (beta * (v - k^T S))^T;  o = q^T S

o goes through an RMSNorm (float32, weight [D] shared by the heads) gated by
sigmoid(g_b_proj(g_a_proj(x))) and the output projection.

What a sequence carries: the conv window of q | k | v (one pool `conv_state` [slots, 3 H D,
K - 1]: the three convs side by side as one conv over the concatenated channels) and S per head
(`ssm_state` [slots, H, D, D]); rows as in layers/gated_delta_net.py. The conv runs on
`md.backend.causal_conv1d`, the recurrence on `md.backend.gated_delta_rule` given the [T, H, D]
gate (paged_kernels' per-key-channel decay).

Tensor parallelism splits heads: q / k / v / f_b / g_b / b projections column-wise, the conv
channels (per q | k | v segment), dt_bias and A_log with them, o_proj row-wise; the bottlenecks
f_a_proj / g_a_proj and the norm's weight are replicated.

Checkpoint layouts: Moonshot's `q_conv1d` / `k_conv1d` / `v_conv1d` ([C, 1, K] each) load as
segments of our `conv1d`; transformers 5's fused `conv1d.weight` and its
`forget_gate.{f_a_proj,f_b_proj,dt_bias,A_log}` names load too (the model renames the latter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.attention.backend import AttentionMetadata
from paged_engine.distributed.parallel_state import get_tp_rank, get_tp_size
from paged_engine.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_checked,
    shard_segments,
)
from paged_engine.layers.linear_mixer import DepthwiseConv, LinearMixer, check_mixer

# Stacked rules routing Moonshot's three short-conv weights into our fused conv1d.
KDA_CONV_RULES = (
    (".conv1d.weight", ".q_conv1d.weight", "q"),
    (".conv1d.weight", ".k_conv1d.weight", "k"),
    (".conv1d.weight", ".v_conv1d.weight", "v"),
)


class SigmoidGatedRMSNorm(nn.Module):
    """y = weight * rmsnorm(x) * sigmoid(gate), all in float32, rounded once to x's dtype;
    per head: x, gate [T, H, D]."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = torch.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (self.weight.float() * y * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(LinearMixer):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        self.tp_size, self.tp_rank = tp, rank
        hidden = config.hidden_size
        heads, dim = int(config.linear_num_heads), int(config.linear_head_dim)
        check_mixer(
            type(self).__name__, getattr(config, "hidden_act", "silu"), tp, linear_num_heads=heads
        )
        self.full_heads, self.full = heads, heads * dim  # whole-model (checkpoint layout)
        self.heads, self.head_dim = heads // tp, dim  # this rank's
        self.dim = self.heads * dim
        self.kernel = int(config.linear_conv_kernel_dim)
        self.q_proj = ColumnParallelLinear(hidden, self.full, bias=False)
        self.k_proj = ColumnParallelLinear(hidden, self.full, bias=False)
        self.v_proj = ColumnParallelLinear(hidden, self.full, bias=False)
        self.conv1d = DepthwiseConv(3 * self.dim, self.kernel, bias=False)
        self.conv1d.weight.weight_loader = self._load_conv
        # The decay: a replicated bottleneck, then per-head rows.
        self.f_a_proj = ColumnParallelLinear(hidden, dim, bias=False, tp_rank=0, tp_size=1)
        self.f_b_proj = ColumnParallelLinear(dim, self.full, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.dim, dtype=torch.float32))  # HF's: fp32
        self.A_log = nn.Parameter(torch.empty(self.heads))
        self.dt_bias.weight_loader = self._load_dt_bias
        self.A_log.weight_loader = self._load_a_log
        self.b_proj = ColumnParallelLinear(hidden, heads, bias=False)
        self.g_a_proj = ColumnParallelLinear(hidden, dim, bias=False, tp_rank=0, tp_size=1)
        self.g_b_proj = ColumnParallelLinear(dim, self.full, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(dim, float(getattr(config, "rms_norm_eps", 1e-6)))
        self.o_proj = RowParallelLinear(self.full, hidden, bias=False)
        # The state pools (plain tensors, allocated by the worker; `allocate_state`).
        self.conv_state: torch.Tensor | None = None  # [slots, 3 * dim, K - 1]
        self.ssm_state: torch.Tensor | None = None  # [slots, heads, D, D]

    # ---- state -----------------------------------------------------------------------------------
    def state_shapes(self, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        d = self.head_dim
        return (num_slots, 3 * self.dim, self.kernel - 1), (num_slots, self.heads, d, d)

    # ---- weight loading --------------------------------------------------------------------------
    def _load_conv(self, param, w: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id is None:  # transformers 5: q | k | v fused
            src = shard_segments(w, [self.full] * 3, self.tp_rank, self.tp_size)
            copy_checked(param.data, src, "conv1d")
            return
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"bad conv1d shard {shard_id!r}")
        src = shard_segments(w, [self.full], self.tp_rank, self.tp_size)
        dst = param.data.narrow(0, "qkv".index(shard_id) * self.dim, self.dim)
        copy_checked(dst, src, f"{shard_id}_conv1d")

    def _load_dt_bias(self, param, w: torch.Tensor, shard_id=None) -> None:
        src = shard_segments(w.reshape(-1), [self.full], self.tp_rank, self.tp_size)
        copy_checked(param.data, src, "dt_bias")

    def _load_a_log(self, param, w: torch.Tensor, shard_id=None) -> None:  # [1, 1, H, 1] or [H]
        src = shard_segments(w.reshape(-1), [self.full_heads], self.tp_rank, self.tp_size)
        copy_checked(param.data, src, "A_log")

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:  # [T, D] -> [T, D]
        assert self.conv_state is not None and self.ssm_state is not None, "allocate_state() first"
        t, h, d = x.shape[0], self.heads, self.head_dim
        slots, has_state = md.state_rows()
        backend = md.backend
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        mixed = self.run_conv(self.conv1d, mixed, md, slots, has_state)
        q, k, v = (part.reshape(t, h, d) for part in mixed.split([self.dim] * 3, dim=-1))
        raw = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        g = -self.A_log.float().exp()[:, None] * F.softplus(raw.view(t, h, d))
        beta = self.b_proj(x).sigmoid()
        o = backend.gated_delta_rule(
            q, k, v, g, beta, self.ssm_state, md.cu_seqlens_q, slots, has_state
        )
        o = self.o_norm(o, self.g_b_proj(self.g_a_proj(x)).view(t, h, d))
        return self.o_proj(o.reshape(t, self.dim))
