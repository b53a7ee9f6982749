"""Gated DeltaNet: the linear-attention token mixer of Qwen3-Next and Qwen3.5 (3 of every 4 layers).

Per token: project to q, k, v (one causal depthwise conv of width K over q | k | v, then SiLU), a
gate z, and per value head a write strength beta = sigmoid(b) and a log-decay
g = -exp(A_log) * softplus(a + dt_bias). The recurrence keeps one [Dk, Dv] matrix S per value
head (q and k L2-normalised, q scaled by Dk^-0.5; value head h reads key head h // (Hv / Hk)):

    S = exp(g) * S;  S += k (beta * (v - k^T S))^T;  o = q^T S

o goes through an RMSNorm gated by silu(z) and the output projection. A config with
`linear_allow_neg_eigval` true (OLMo Hybrid's) doubles beta (range [0, 2]: the state's
transition I - beta k k^T may have negative eigenvalues).

What a sequence carries instead of a KV cache: its conv window ([C, K - 1], the last K - 1 conv
inputs) and S for every value head. Both live in per-layer pools, `conv_state` and `ssm_state`,
one row per slot (the worker's InputBatch rows, worker/recurrent_state.py); `md.state_slots` says
which row each sequence of the step uses and `md.has_initial_state` whether it continues that
row's state (False: a sequence starting at position 0, whose row may hold a previous occupant's).
The two ops run on `md.backend` (Triton kernels on CUDA, paged_kernels' torch references
elsewhere).

Tensor parallelism splits key and value heads (Hk and Hv divisible by tp_size): the projections
column-wise per segment (q | k | v | z, b | a), the conv channels and A_log / dt_bias with them,
the output projection row-wise; the gated norm's weight (one [Dv] vector) is replicated.

Checkpoint layouts: Qwen3.5's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a load as segments
of our in_proj_qkvz (q | k | v | z) and in_proj_ba (b | a); Qwen3-Next's in_proj_qkvz / in_proj_ba
interleave those per key head ([Hk, q | k | v-group | z-group]) and are regrouped as they load.
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

# Stacked rules routing Qwen3.5's separate projections into the merged ones (the trailing dot
# keeps ".in_proj_qkv." from matching Qwen3-Next's ".in_proj_qkvz.").
GDN_PROJ_RULES = (
    (".in_proj_qkvz.", ".in_proj_qkv.", "qkv"),
    (".in_proj_qkvz.", ".in_proj_z.", "z"),
    (".in_proj_ba.", ".in_proj_b.", "b"),
    (".in_proj_ba.", ".in_proj_a.", "a"),
)


class GatedRMSNorm(nn.Module):
    """y = weight * rmsnorm(x) (rounded to x's dtype) * silu(z), per value head: x, z [T, H, D]."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = torch.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)
        return (self.weight * y * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(LinearMixer):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        self.tp_size, self.tp_rank = tp, rank
        hidden = config.hidden_size
        num_k, num_v = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
        if num_k <= 0 or num_v % num_k:
            raise ValueError(
                f"linear_num_value_heads={num_v} must be a multiple of linear_num_key_heads={num_k}"
                " (a positive integer)"
            )
        check_mixer(
            type(self).__name__,
            getattr(config, "hidden_act", "silu"),
            tp,
            linear_num_key_heads=num_k,
            linear_num_value_heads=num_v,
        )
        self.head_k, self.head_v = (
            int(config.linear_key_head_dim),
            int(config.linear_value_head_dim),
        )
        self.full_k, self.full_v = num_k, num_v  # whole-model head counts (checkpoint layout)
        self.num_k, self.num_v = num_k // tp, num_v // tp  # this rank's
        self.key_dim, self.value_dim = self.num_k * self.head_k, self.num_v * self.head_v
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = int(config.linear_conv_kernel_dim)
        self.allow_neg_eigval = bool(getattr(config, "linear_allow_neg_eigval", False))
        full_key, full_value = num_k * self.head_k, num_v * self.head_v
        # Our merged layouts: q | k | v | z and b | a, each segment split by heads across ranks.
        self.qkvz_sizes = [full_key, full_key, full_value, full_value]
        self.in_proj_qkvz = ColumnParallelLinear(hidden, sum(self.qkvz_sizes), bias=False)
        self.in_proj_ba = ColumnParallelLinear(hidden, 2 * num_v, bias=False)
        self.in_proj_qkvz.weight.weight_loader = self._load_qkvz
        self.in_proj_ba.weight.weight_loader = self._load_ba
        # LoRA (lora/model.py): an adapter's B loads as the weight does, Qwen3.5's projections
        # as two parts (qkv | z, b | a) of our merged ones, Qwen3-Next's interleaved ones whole.
        self.in_proj_qkvz.lora_segments = {
            None: (0, sum(self.qkvz_sizes)),
            "qkv": (0, 2 * full_key + full_value),
            "z": (1, full_value),
        }
        self.in_proj_qkvz.lora_b_loader = self._load_qkvz
        self.in_proj_ba.lora_segments = {None: (0, 2 * num_v), "b": (0, num_v), "a": (1, num_v)}
        self.in_proj_ba.lora_b_loader = self._load_ba
        self.conv1d = DepthwiseConv(self.conv_dim, self.kernel, bias=False)
        self.conv1d.weight.weight_loader = self._load_conv
        self.A_log = nn.Parameter(torch.empty(self.num_v))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v))
        self.A_log.weight_loader = self.dt_bias.weight_loader = self._load_heads
        self.norm = GatedRMSNorm(self.head_v, float(getattr(config, "rms_norm_eps", 1e-6)))
        self.out_proj = RowParallelLinear(full_value, hidden, bias=False)
        # The state pools (plain tensors, not buffers: no state_dict entry, allocated by the
        # worker before the KV cache is sized; `allocate_state`).
        self.conv_state: torch.Tensor | None = None  # [slots, conv_dim, K - 1]
        self.ssm_state: torch.Tensor | None = None  # [slots, num_v, head_k, head_v]

    # ---- state -----------------------------------------------------------------------------------
    def state_shapes(self, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (num_slots, self.conv_dim, self.kernel - 1), (
            num_slots,
            self.num_v,
            self.head_k,
            self.head_v,
        )

    # ---- weight loading --------------------------------------------------------------------------
    def _load_qkvz(self, param, w: torch.Tensor, shard_id: str | None = None) -> None:
        fk, fv = self.qkvz_sizes[0], self.qkvz_sizes[2]
        if shard_id is None:  # Qwen3-Next: [Hk, q | k | v-group | z-group] per key head
            r = self.full_v // self.full_k
            grouped = w.reshape(self.full_k, 2 * self.head_k + 2 * r * self.head_v, -1)
            sizes = [self.head_k, self.head_k, r * self.head_v, r * self.head_v]
            w = torch.cat([s.reshape(-1, w.shape[-1]) for s in grouped.split(sizes, dim=1)])
            copy_checked(
                param.data,
                shard_segments(w, self.qkvz_sizes, self.tp_rank, self.tp_size),
                "in_proj_qkvz",
            )
            return
        local = [n // self.tp_size for n in self.qkvz_sizes]
        if shard_id == "qkv":
            src = shard_segments(w, [fk, fk, fv], self.tp_rank, self.tp_size)
            copy_checked(param.data.narrow(0, 0, sum(local[:3])), src, "in_proj_qkv")
        elif shard_id == "z":
            src = shard_segments(w, [fv], self.tp_rank, self.tp_size)
            copy_checked(param.data.narrow(0, sum(local[:3]), local[3]), src, "in_proj_z")
        else:
            raise ValueError(f"bad in_proj_qkvz shard {shard_id!r}")

    def _load_ba(self, param, w: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id is None:  # Qwen3-Next: [Hk, b-group | a-group] per key head
            r = self.full_v // self.full_k
            b, a = w.reshape(self.full_k, 2 * r, -1).split([r, r], dim=1)
            w = torch.cat([b.reshape(-1, w.shape[-1]), a.reshape(-1, w.shape[-1])])
            copy_checked(
                param.data,
                shard_segments(w, [self.full_v] * 2, self.tp_rank, self.tp_size),
                "in_proj_ba",
            )
            return
        if shard_id not in ("b", "a"):
            raise ValueError(f"bad in_proj_ba shard {shard_id!r}")
        src = shard_segments(w, [self.full_v], self.tp_rank, self.tp_size)
        copy_checked(
            param.data.narrow(0, 0 if shard_id == "b" else self.num_v, self.num_v),
            src,
            f"in_proj_{shard_id}",
        )

    def _load_conv(self, param, w: torch.Tensor, shard_id=None) -> None:
        fk, fv = self.qkvz_sizes[0], self.qkvz_sizes[2]
        copy_checked(
            param.data, shard_segments(w, [fk, fk, fv], self.tp_rank, self.tp_size), "conv1d"
        )

    def _load_heads(self, param, w: torch.Tensor, shard_id=None) -> None:
        copy_checked(
            param.data,
            shard_segments(w, [self.full_v], self.tp_rank, self.tp_size),
            "A_log / dt_bias",
        )

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:  # [T, D] -> [T, D]
        assert self.conv_state is not None and self.ssm_state is not None, "allocate_state() first"
        t = x.shape[0]
        slots, has_state = md.state_rows()
        mixed, z = self.in_proj_qkvz(x).split([self.conv_dim, self.value_dim], dim=-1)
        b, a = self.in_proj_ba(x).split([self.num_v, self.num_v], dim=-1)
        backend = md.backend
        mixed = self.run_conv(self.conv1d, mixed, md, slots, has_state)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = b.sigmoid() * 2.0 if self.allow_neg_eigval else b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        o = backend.gated_delta_rule(
            q.reshape(t, self.num_k, self.head_k),
            k.reshape(t, self.num_k, self.head_k),
            v.reshape(t, self.num_v, self.head_v),
            g,
            beta,
            self.ssm_state,
            md.cu_seqlens_q,
            slots,
            has_state,
        )
        o = self.norm(o, z.reshape(t, self.num_v, self.head_v))
        return self.out_proj(o.reshape(t, self.value_dim))
