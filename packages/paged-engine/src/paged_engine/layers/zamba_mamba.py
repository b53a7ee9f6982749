"""Zamba's (v1) multi-head Mamba mixer: Mamba (v1)'s selective scan (layers/mamba.py) run
independently on `n_mamba_heads` equal slices of the channels, each with its own x_proj and
dt_proj (HF's ZambaMambaMixer; vLLM has no Zamba v1).

With I = mamba_expand * hidden channels in H heads of P = I / H, per token:

    x | z = in_proj(h)            (HF's rows interleave them: row 2i is x_i, row 2i + 1 is z_i)
    x = silu(causal_conv(x))      (depthwise over the I channels, width K)
    dt_r | B | C = x_proj_weight[h] @ x[head h]     ([R + 2N] per head: B, C per head)
    dt = softplus(dt_proj_weight[h] @ dt_r + dt_proj_bias[h])    ([P] per head)
    h[d] = exp(dt[d] A[d]) h[d] + dt[d] x[d] B;   y[d] = h[d] . C + D[d] x[d]
    out = out_proj(y * silu(z))

so one head is a Mamba (v1) mixer of P channels; the heads meet only in out_proj. Parameters
keep HF's per-head shapes and names (x_proj_weight [H, R + 2N, P], dt_proj_weight [H, P, R],
dt_proj_bias / D [H, P], A_log [H, P, N]); in_proj loads de-interleaved as x | z rows. The
state a sequence carries is Mamba's: its conv window [I, K - 1] and h [I, N] (head h's rows
h * P to (h + 1) * P), in the pools of worker/recurrent_state.py; the backend's Mamba (v1)
scan runs once per head on views of them. Prompt and generated tokens update the state alike
(no dt limit), so prefix-cache snapshots may follow generated tokens.

Tensor parallelism splits the heads: each rank holds whole heads (in_proj's x and z rows, the
conv, the per-head parameters), so x_proj and dt_proj need no communication; out_proj is
row-parallel (one all-reduce).
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


@dataclass(frozen=True, slots=True)
class ZambaMambaSpec:
    hidden_size: int
    num_heads: int  # n_mamba_heads
    intermediate_size: int  # mamba_expand * hidden_size, all heads
    state_size: int
    time_step_rank: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool  # in_proj's and out_proj's
    activation: str = "silu"


class ZambaMambaMixer(LinearMixer):
    def __init__(self, spec: ZambaMambaSpec) -> None:
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        check_mixer("Zamba's Mamba mixer", spec.activation, tp, n_mamba_heads=spec.num_heads)
        if spec.intermediate_size % spec.num_heads:
            raise ValueError(
                f"n_mamba_heads={spec.num_heads} does not divide the mixer's width "
                f"{spec.intermediate_size} (mamba_expand * hidden_size)"
            )
        self.tp_size, self.tp_rank = tp, rank
        self.full_inner = spec.intermediate_size
        self.num_heads = spec.num_heads // tp  # this rank's heads
        self.head_dim = spec.intermediate_size // spec.num_heads
        self.inner = self.num_heads * self.head_dim  # this rank's channels
        self.state_size, self.rank = spec.state_size, spec.time_step_rank
        self.kernel = spec.conv_kernel
        heads, p, n, r = self.num_heads, self.head_dim, self.state_size, self.rank
        # ours: x | z rows of this rank's channels (HF interleaves them: _load_in_proj)
        self.in_proj = ColumnParallelLinear(spec.hidden_size, 2 * self.inner, spec.proj_bias, 0, 1)
        self.in_proj.weight.weight_loader = self._load_in_proj
        if spec.proj_bias:
            self.in_proj.bias.weight_loader = self._load_in_proj
        self.conv1d = DepthwiseConv(self.inner, self.kernel, spec.conv_bias)
        self.x_proj_weight = nn.Parameter(torch.empty(heads, r + 2 * n, p))
        self.dt_proj_weight = nn.Parameter(torch.empty(heads, p, r))
        self.dt_proj_bias = nn.Parameter(torch.empty(heads, p))
        self.A_log = nn.Parameter(torch.empty(heads, p, n))
        self.D = nn.Parameter(torch.empty(heads, p))
        # every per-channel parameter: this rank's slice of its first dim (heads or channels)
        for param in (self.conv1d.weight, self.conv1d.bias, self.x_proj_weight):
            if param is not None:
                param.weight_loader = self._load_rows
        for param in (self.dt_proj_weight, self.dt_proj_bias, self.A_log, self.D):
            param.weight_loader = self._load_rows
        self.out_proj = RowParallelLinear(self.full_inner, spec.hidden_size, spec.proj_bias)
        self.conv_state: torch.Tensor | None = None  # [slots, inner, K - 1]
        self.ssm_state: torch.Tensor | None = None  # [slots, inner, N]: heads' rows in order

    def state_shapes(self, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (num_slots, self.inner, self.kernel - 1), (num_slots, self.inner, self.state_size)

    # ---- weight loading --------------------------------------------------------------------------
    def _load_in_proj(self, param, w: torch.Tensor, shard_id=None) -> None:
        # HF's [2I, ...] rows: (x_0, z_0, x_1, z_1, ...) -> x | z, each cut to this rank's heads
        pairs = w.unflatten(0, (self.full_inner, 2))
        xz = torch.cat([pairs[:, 0], pairs[:, 1]])
        rows = shard_segments(xz, [self.full_inner, self.full_inner], self.tp_rank, self.tp_size)
        copy_checked(param.data, rows, "in_proj")

    def _load_rows(self, param, w: torch.Tensor, shard_id=None) -> None:
        rows = shard_segments(w, [w.shape[0]], self.tp_rank, self.tp_size)
        copy_checked(param.data, rows, "Zamba mamba")

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, h: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:  # [T, D] -> [T, D]
        assert self.conv_state is not None and self.ssm_state is not None, "allocate_state() first"
        slots, has_state = md.state_rows()
        heads, p, n, r = self.num_heads, self.head_dim, self.state_size, self.rank
        x, z = self.in_proj(h).split([self.inner, self.inner], dim=-1)
        x = self.run_conv(self.conv1d, x, md, slots, has_state)  # [T, I]
        xh = x.unflatten(-1, (heads, p)).transpose(0, 1)  # [H, T, P]
        params = xh @ self.x_proj_weight.transpose(1, 2)  # [H, T, R + 2N]
        dt_r, b, c = params.split([r, n, n], dim=-1)
        dt = dt_r @ self.dt_proj_weight.transpose(1, 2)  # [H, T, P]
        # the bias added in float32 (as the reference kernels do)
        dt = F.softplus(dt.float() + self.dt_proj_bias.float()[:, None])
        A = -torch.exp(self.A_log.float())  # [H, P, N]
        y = torch.empty(x.shape, dtype=torch.float32, device=x.device)  # [T, I]
        for i in range(heads):  # head i: channels [i * P, (i + 1) * P), its state rows
            cols = slice(i * p, (i + 1) * p)
            y[:, cols] = md.backend.selective_scan(
                x[:, cols],
                dt[i],
                A[i],
                b[i],
                c[i],
                self.ssm_state[:, cols],
                md.cu_seqlens_q,
                slots,
                has_state,
            )
        y = (y + x.float() * self.D.float().flatten()) * F.silu(z.float())
        return self.out_proj(y.to(h.dtype))
