"""Mamba (v1) mixer: the selective state-space token mixer of Mamba, Falcon Mamba and Jamba's
mamba layers.

Per token, in_proj gives the conv input x and a gate z ([I] each). After a causal depthwise conv
(width K) and SiLU, x_proj gives a low-rank step dt_r [R] and B, C [N]; Falcon Mamba normalizes
the three by an RMSNorm without weight, Jamba by RMSNorms with weights.
dt = softplus(dt_proj(dt_r)), its bias added in float32. With A = -exp(A_log) [I, N], each
channel d runs

    h[d] = exp(dt[d] * A[d]) * h[d] + dt[d] * x[d] * B;   y[d] = h[d] . C + D[d] * x[d]

(h[d]: [N]), then out_proj(y * silu(z)). Unlike Mamba2 (layers/mamba2.py) the decay is per
channel and state entry, and B, C are shared by every channel. The state a sequence carries:
its conv window [I, K - 1] and h [I, N], in per-layer pools indexed by `md.state_slots`
(worker/recurrent_state.py), as every linear mixer's (layers/linear_mixer.py).

Tensor parallelism splits the channels I: in_proj per segment (x | z), the conv, dt_proj's
rows, A_log and D; x_proj and out_proj by their input (an all-reduce each).
"""

from __future__ import annotations

from dataclasses import dataclass

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
from paged_engine.layers.norm import RMSNorm

# How x_proj's three outputs (dt_r, B, C) are normalized before use.
INNER_NORMS = ("none", "weightless", "weighted")


@dataclass(frozen=True, slots=True)
class MambaSpec:
    """A Mamba mixer's sizes and options (each family names them differently)."""

    hidden_size: int
    intermediate_size: int
    state_size: int
    time_step_rank: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool  # in_proj's and out_proj's
    inner_norms: str = "none"  # INNER_NORMS: Mamba / Falcon Mamba / Jamba
    inner_norm_eps: float = 1e-6
    activation: str = "silu"


class MambaMixer(LinearMixer):
    def __init__(self, spec: MambaSpec) -> None:
        super().__init__()
        if spec.inner_norms not in INNER_NORMS:
            raise ValueError(f"inner_norms must be one of {INNER_NORMS}, got {spec.inner_norms!r}")
        tp, rank = get_tp_size(), get_tp_rank()
        check_mixer("MambaMixer", spec.activation, tp, intermediate_size=spec.intermediate_size)
        self.tp_size, self.tp_rank = tp, rank
        self.full_inner = spec.intermediate_size
        self.inner = spec.intermediate_size // tp  # this rank's channels
        self.state_size, self.rank = spec.state_size, spec.time_step_rank
        self.kernel = spec.conv_kernel
        # in_proj's rows: x | z, each split over the ranks; built whole at this rank's size
        self.in_proj = ColumnParallelLinear(spec.hidden_size, 2 * self.inner, spec.proj_bias, 0, 1)
        self.in_proj.weight.weight_loader = self._load_in_proj
        if spec.proj_bias:
            self.in_proj.bias.weight_loader = self._load_in_proj
        # LoRA (lora/model.py): an adapter's B [x | z rows, r] loads as the weight does
        self.in_proj.lora_segments = {None: (0, 2 * self.full_inner)}
        self.in_proj.lora_b_loader = self._load_in_proj
        self.conv1d = DepthwiseConv(self.inner, self.kernel, spec.conv_bias)
        self.conv1d.weight.weight_loader = self._load_channels
        if self.conv1d.bias is not None:
            self.conv1d.bias.weight_loader = self._load_channels
        self.x_proj = RowParallelLinear(self.full_inner, self.rank + 2 * self.state_size, False)
        self.dt_proj = ColumnParallelLinear(self.rank, self.full_inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(self.inner, self.state_size))
        self.D = nn.Parameter(torch.empty(self.inner))
        for p in (self.A_log, self.D):
            p.weight_loader = self._load_channels
        self.out_proj = RowParallelLinear(self.full_inner, spec.hidden_size, spec.proj_bias)
        self.inner_norms = spec.inner_norms
        self.norm_eps = spec.inner_norm_eps
        if spec.inner_norms == "weighted":  # Jamba's, under HF's names
            self.dt_layernorm = RMSNorm(self.rank, spec.inner_norm_eps)
            self.b_layernorm = RMSNorm(self.state_size, spec.inner_norm_eps)
            self.c_layernorm = RMSNorm(self.state_size, spec.inner_norm_eps)
        self.conv_state: torch.Tensor | None = None  # [slots, inner, K - 1]
        self.ssm_state: torch.Tensor | None = None  # [slots, inner, state_size]

    # ---- state -----------------------------------------------------------------------------------
    def state_shapes(self, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (num_slots, self.inner, self.kernel - 1), (num_slots, self.inner, self.state_size)

    # ---- weight loading --------------------------------------------------------------------------
    def _load_in_proj(self, param, w: torch.Tensor, shard_id=None) -> None:
        rows = shard_segments(w, [self.full_inner, self.full_inner], self.tp_rank, self.tp_size)
        copy_checked(param.data, rows, "in_proj")

    def _load_channels(self, param, w: torch.Tensor, shard_id=None) -> None:
        rows = shard_segments(w, [w.shape[0]], self.tp_rank, self.tp_size)
        copy_checked(param.data, rows, "mamba")

    # ---- forward ---------------------------------------------------------------------------------
    def _normalize(self, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor):
        if self.inner_norms == "weighted":
            return self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)
        if self.inner_norms == "weightless":  # in float32, back in the input dtype

            def norm(t: torch.Tensor) -> torch.Tensor:
                return torch.rms_norm(t.float(), (t.shape[-1],), None, self.norm_eps).to(t.dtype)

            return norm(dt), norm(b), norm(c)
        return dt, b, c

    def forward(self, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:  # [T, D] -> [T, D]
        assert self.conv_state is not None and self.ssm_state is not None, "allocate_state() first"
        slots, has_state = md.state_rows()
        xs, z = self.in_proj(x).split([self.inner, self.inner], dim=-1)
        backend = md.backend
        xs = self.run_conv(self.conv1d, xs, md, slots, has_state)
        dt, b, c = self.x_proj(xs).split([self.rank, self.state_size, self.state_size], dim=-1)
        dt, b, c = self._normalize(dt, b, c)
        # dt_proj's product in the model dtype, its bias added in float32 (as the references)
        dt_proj = self.dt_proj
        dt_full = dt_proj._linear(dt, None)
        if dt_proj.lora is not None:
            dt_full = dt_proj.lora.apply(dt, dt_full)
        dt_full = F.softplus(dt_full.float() + dt_proj.bias.float())
        y = backend.selective_scan(
            xs,
            dt_full,
            -torch.exp(self.A_log.float()),
            b,
            c,
            self.ssm_state,
            md.cu_seqlens_q,
            slots,
            has_state,
        )
        y = (y + xs.float() * self.D.float()) * F.silu(z.float())
        return self.out_proj(y.to(x.dtype))
