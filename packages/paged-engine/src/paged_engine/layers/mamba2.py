"""Mamba2 mixer: the state-space token mixer of IBM Granite 4.0-H (GraniteMoeHybrid), NVIDIA
Nemotron-H and TII Falcon-H1.

Per token, one input projection gives a gate z [I], the conv input x | B | C ([I], [G, N],
[G, N]) and a step dt per head. After a causal depthwise conv (width K) and SiLU, with
dt = softplus(dt + dt_bias) (clamped to the spec's dt_limit for prompt tokens) and
A = -exp(A_log), each head h (of H, head_dim P; group g = h // (H / G) supplies B and C) runs

    S = exp(dt * A) * S + dt * x (x) B;   y = S . C + D * x         (S: [P, N])

then y * silu(z) goes through an RMSNorm over groups of I / G channels and the output
projection. Falcon-H1's options (`Mamba2Spec`): multipliers on in_proj's five segments, the norm
before the gate (rmsnorm(y) * silu(z)) or no norm (y * silu(z)), out_proj's own bias flag. The
state a sequence carries: its conv window and S for every head, in per-layer pools indexed by
`md.state_slots` (worker/recurrent_state.py), exactly as Gated DeltaNet's
(layers/gated_delta_net.py), with whom it shares the conv op.

`Mamba2Spec` holds the sizes (each family names them differently in its config).
Tensor parallelism splits heads (divisible by tp_size) and groups: in_proj per segment
(z | x | B | C | dt), the conv channels, A_log / D / dt_bias and the norm weight with them;
out_proj by rows. A single group (Granite 4.0-H) is replicated instead: every rank holds B and C
whole, and the norm's one group, spread over the ranks, sums its squares with an all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.attention.backend import AttentionMetadata
from paged_engine.distributed.communication import tp_all_reduce
from paged_engine.distributed.parallel_state import get_tp_rank, get_tp_size
from paged_engine.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_checked,
    shard_segments,
)
from paged_engine.layers.linear_mixer import DepthwiseConv, LinearMixer, check_mixer


class GroupedGatedRMSNorm(nn.Module):
    """y = weight * rmsnorm_per_group(x * silu(z)) over groups of `group_size` channels, in
    float32 (the gate before the norm: Mamba2's norm_before_gate=False). `norm_before_gate`:
    y = weight * rmsnorm_per_group(x) * silu(z), weight and gate applied in float32 (Falcon-H1's
    FalconH1RMSNormGated)."""

    def __init__(
        self,
        size: int,
        group_size: int,
        eps: float,
        across_ranks: bool = False,
        norm_before_gate: bool = False,
    ) -> None:
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.across_ranks = across_ranks  # one group over every rank's channels (`size` of it)
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.norm_before_gate:
            h = self._normalize(x.float())
            return (self.weight * h * F.silu(z.float())).to(dtype)
        return self.weight * self._normalize(x.float() * F.silu(z.float())).to(dtype)

    def _normalize(self, h: torch.Tensor) -> torch.Tensor:  # float32 [T, C]
        t = h.shape[0]
        if self.across_ranks:  # the mean square over the whole group: its ranks' sums reduced
            sq = tp_all_reduce(h.square().sum(-1, keepdim=True))
            return h * torch.rsqrt(sq / self.group_size + self.eps)
        h = torch.rms_norm(h.view(t, -1, self.group_size), (self.group_size,), None, self.eps)
        return h.view(t, -1)


@dataclass(frozen=True, slots=True)
class Mamba2Spec:
    """A Mamba2 mixer's sizes and options (each model family names them differently)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    eps: float
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    # Falcon-H1's options (the defaults: Granite's and Nemotron-H's mixer)
    in_multipliers: tuple[float, float, float, float, float] | None = None  # z, x, B, C, dt
    rms_norm: bool = True  # False: y * silu(z), no norm (nor its weight)
    norm_before_gate: bool = False  # rmsnorm(y) * silu(z) instead of rmsnorm(y * silu(z))
    out_bias: bool | None = None  # out_proj's bias; None: proj_bias


class Mamba2Mixer(LinearMixer):
    def __init__(self, spec: Mamba2Spec) -> None:
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        self.tp_size, self.tp_rank = tp, rank
        heads, groups, head_dim = spec.num_heads, spec.num_groups, spec.head_dim
        inner = heads * head_dim
        if groups <= 0 or heads % groups:
            raise ValueError(f"Mamba2: n_groups={groups} must be positive and divide {heads} heads")
        check_mixer("Mamba2Mixer", None, tp, mamba_heads=heads)
        # Groups split over the ranks, or (one group) replicated on every rank: then the norm,
        # whose one group spans every rank's channels, sums its squares across them.
        if groups % tp and groups != 1:
            raise ValueError(
                f"mamba groups ({groups}) must be 1 or divisible by tensor_parallel_size={tp}"
            )
        self.replicated_group = groups % tp != 0
        self.state_size = spec.state_size
        self.kernel = spec.conv_kernel
        self.full_heads, self.full_groups, self.full_inner = heads, groups, inner
        self.num_heads = heads // tp  # this rank's
        self.num_groups = 1 if self.replicated_group else groups // tp
        self.head_dim = head_dim
        self.inner = inner // tp
        bc = self.num_groups * self.state_size
        self.conv_dim = self.inner + 2 * bc
        gn = groups * self.state_size
        # in_proj's rows: z | x | B | C | dt (full sizes, each split by heads / groups)
        self.proj_sizes = [inner, inner, gn, gn, heads]
        bias = spec.proj_bias
        local_rows = 2 * self.inner + 2 * bc + self.num_heads
        # built whole (tp_size 1) at this rank's size: the loaders pick each segment's rows
        self.in_proj = ColumnParallelLinear(spec.hidden_size, local_rows, bias, 0, 1)
        self.in_proj.weight.weight_loader = self._load_in_proj
        # LoRA (lora/model.py): an adapter's B [z | x | B | C | dt rows, r] loads as the weight
        self.in_proj.lora_segments = {None: (0, sum(self.proj_sizes))}
        self.in_proj.lora_b_loader = self._load_in_proj
        if bias:
            self.in_proj.bias.weight_loader = self._load_in_proj
        self.conv1d = DepthwiseConv(self.conv_dim, self.kernel, spec.conv_bias)
        self.conv1d.weight.weight_loader = self._load_conv
        if self.conv1d.bias is not None:
            self.conv1d.bias.weight_loader = self._load_conv
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.empty(self.num_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        for p in (self.A_log, self.D, self.dt_bias):
            p.weight_loader = self._load_heads
        self.norm: GroupedGatedRMSNorm | None = None
        if spec.rms_norm:
            self.norm = GroupedGatedRMSNorm(
                self.inner,
                inner // groups,
                spec.eps,
                across_ranks=self.replicated_group and tp > 1,
                norm_before_gate=spec.norm_before_gate,
            )
            self.norm.weight.weight_loader = self._load_heads
        out_bias = bias if spec.out_bias is None else spec.out_bias
        self.out_proj = RowParallelLinear(inner, spec.hidden_size, bias=out_bias)
        # in_proj's output times each segment's multiplier (this rank's rows: z | x | B | C | dt)
        scale = None
        if spec.in_multipliers is not None and any(m != 1 for m in spec.in_multipliers):
            sizes = [self.inner, self.inner, bc, bc, self.num_heads]
            pairs = zip(sizes, spec.in_multipliers, strict=True)
            scale = torch.cat([torch.full((n,), float(m)) for n, m in pairs])
        self.register_buffer("in_scale", scale, persistent=False)
        limit = tuple(spec.dt_limit)
        if len(limit) != 2:
            raise ValueError(f"time_step_limit={list(limit)} must be two numbers (min, max)")
        self.dt_limit = None if limit == (0.0, float("inf")) else (float(limit[0]), float(limit[1]))
        # A token's update differs as a prompt token (clamped) and as a generated one: neither
        # the state nor the KV above it after generated tokens stand for a prompt of the same
        # tokens, so the engine caches prompt tokens only (core/block_manager.py, state_slots.py).
        self.state_depends_on_prompt = self.dt_limit is not None
        self.conv_state: torch.Tensor | None = None  # [slots, conv_dim, K - 1]
        self.ssm_state: torch.Tensor | None = None  # [slots, heads, head_dim, state_size]

    # ---- state -----------------------------------------------------------------------------------
    def state_shapes(self, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        conv = (num_slots, self.conv_dim, self.kernel - 1)
        return conv, (num_slots, self.num_heads, self.head_dim, self.state_size)

    # ---- weight loading --------------------------------------------------------------------------
    def _local_rows(self, w: torch.Tensor, sizes: list[int], bc_segments: set[int]) -> torch.Tensor:
        """This rank's rows of each segment; B / C segments (indices `bc_segments`) whole when
        their one group is replicated."""
        parts = []
        for i, seg in enumerate(w.split(sizes, dim=0)):
            if i in bc_segments and self.replicated_group:
                parts.append(seg)
            else:
                parts.append(shard_segments(seg, [seg.shape[0]], self.tp_rank, self.tp_size))
        return torch.cat(parts, dim=0)

    def _load_in_proj(self, param, w: torch.Tensor, shard_id=None) -> None:
        copy_checked(param.data, self._local_rows(w, self.proj_sizes, {2, 3}), "in_proj")

    def _load_conv(self, param, w: torch.Tensor, shard_id=None) -> None:
        gn = self.full_groups * self.state_size
        copy_checked(param.data, self._local_rows(w, [self.full_inner, gn, gn], {1, 2}), "conv1d")

    def _load_heads(self, param, w: torch.Tensor, shard_id=None) -> None:
        copy_checked(
            param.data, shard_segments(w, [w.shape[0]], self.tp_rank, self.tp_size), "mamba"
        )

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:  # [T, D] -> [T, D]
        assert self.conv_state is not None and self.ssm_state is not None, "allocate_state() first"
        t = x.shape[0]
        slots, has_state = md.state_rows()
        zxbcdt = self.in_proj(x)
        if self.in_scale is not None:
            zxbcdt = zxbcdt * self.in_scale
        z, xbc, dt = zxbcdt.split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        backend = md.backend
        xbc = self.run_conv(self.conv1d, xbc, md, slots, has_state)
        bc = self.num_groups * self.state_size
        xs, b, c = xbc.split([self.inner, bc, bc], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        if self.dt_limit is not None:
            dt = self._clamp_dt(dt, md)
        xs = xs.reshape(t, self.num_heads, self.head_dim)
        y = backend.ssd_scan(
            xs,
            dt,
            -torch.exp(self.A_log.float()),
            b.reshape(t, self.num_groups, self.state_size),
            c.reshape(t, self.num_groups, self.state_size),
            self.ssm_state,
            md.cu_seqlens_q,
            slots,
            has_state,
        )
        y = (y.float() + xs.float() * self.D.float()[:, None]).reshape(t, self.inner)
        if self.norm is None:
            y = (y * F.silu(z.float())).to(x.dtype)
        else:
            y = self.norm(y, z, x.dtype)
        return self.out_proj(y)

    def _clamp_dt(self, dt: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """time_step_limit as the reference implementations apply it (mamba_ssm, transformers):
        in the chunked scan over a prompt, not in the one-token updates of generated tokens.
        Told apart by position (from `md.prompt_lens`), so every chunking of a prompt, a
        prefix-cache resume and a recompute after preemption clamp the same tokens."""
        if md.prompt_lens is None:  # a stand-alone forward (profiling): prompts only
            return dt.clamp(*self.dt_limit)
        t, cu = dt.shape[0], md.cu_seqlens_q
        lens = cu[1:] - cu[:-1]
        # the step's local index of each sequence's first generated token (<= 0: all are)
        first_generated = md.prompt_lens - (md.seq_lens - lens)
        local = torch.arange(t, device=dt.device) - torch.repeat_interleave(
            cu[:-1], lens, output_size=t
        )
        keep = local >= torch.repeat_interleave(first_generated, lens, output_size=t)
        return torch.where(keep[:, None], dt, dt.clamp(*self.dt_limit))
