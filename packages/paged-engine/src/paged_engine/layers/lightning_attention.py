"""Lightning attention: the linear-attention token mixer of MiniMax-01 (MiniMax-Text-01,
MiniMax-M1; models/minimax.py), as transformers runs it.

Per token, H heads of D channels: q | k | v = silu(qkv_proj(x)) (the projection's rows are
per head [q_h | k_h | v_h]), no query scaling. Each head keeps one [D, D] matrix S that decays
by a fixed rate a head and layer:

    S = exp(-slope_h) S + k v^T;  o = q^T S

    slope_h = b^(h+1) * (1 - layer_idx / (L - 1 + 1e-5) + 1e-5),  b = 2^(-8/H),  h = 0..H-1

(transformers computes a prefill in blocks of `block_size` tokens, which is the same sum). o of
all heads, [H * D], goes through one RMSNorm over the whole width (eps 1e-6, Llama's rounding),
is gated by sigmoid(output_gate(x)) and projected by out_proj.

This is Mamba2's scan with a step size of 1, A = -slope, B = k, C = q and x = v, one group per
head, so it runs on `md.backend.ssd_scan` (float32, the state in the pool's dtype). A sequence
carries S per head (`ssm_state` [slots, H, D, D]) and no conv window.

Tensor parallelism splits heads: qkv_proj and output_gate column-wise (whole heads, as the
per-head row layout keeps each head's q | k | v together), the slopes with them, out_proj
row-wise; the norm adds up the ranks' sums of squares (its weight sharded like the heads).
transformers saves its slopes and the decay tables derived from them (`slope_rate`,
`query_decay`, `key_decay`, `diagonal_decay`) with the weights; they are recomputed here from the
formula above (which made them), never read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_engine.attention.backend import AttentionMetadata
from paged_engine.distributed.communication import tp_all_reduce
from paged_engine.distributed.parallel_state import get_tp_rank, get_tp_size
from paged_engine.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
)
from paged_engine.layers.linear_mixer import LinearMixer, check_mixer
from paged_engine.models.olmo2 import ShardedNorm

# transformers' lightning attention buffers (recomputed here, not loaded).
DECAY_BUFFERS = (".slope_rate", ".query_decay", ".key_decay", ".diagonal_decay")


def lightning_slopes(num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    """Each head's decay rate in layer `layer_idx` of `num_layers` (float32 [H])."""
    base = 1 / (2 ** (8 / num_heads))
    rate = base ** (torch.arange(num_heads, dtype=torch.float32) + 1)
    return rate * (1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5)


class LightningAttention(LinearMixer):
    def __init__(self, config, layer_idx: int, head_dim: int) -> None:
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        self.tp_size, self.tp_rank = tp, rank
        hidden = config.hidden_size
        heads = int(config.num_attention_heads)
        check_mixer(
            "MiniMax's lightning attention",
            getattr(config, "hidden_act", "silu"),
            tp,
            num_attention_heads=heads,
        )
        self.full_heads, self.full = heads, heads * head_dim  # whole-model (checkpoint layout)
        self.heads, self.head_dim = heads // tp, head_dim  # this rank's
        self.dim = self.heads * head_dim
        self.qkv_proj = ColumnParallelLinear(hidden, 3 * self.full, bias=False)
        self.output_gate = ColumnParallelLinear(hidden, self.full, bias=False)
        self.out_proj = RowParallelLinear(self.full, hidden, bias=False)
        self.norm = ShardedNorm(self.dim, 1e-6, rank)
        slopes = lightning_slopes(heads, layer_idx, int(config.num_hidden_layers))
        # -slope of this rank's heads: the scan's A (float32, built like transformers' buffer).
        decay = -slopes[rank * self.heads : (rank + 1) * self.heads]
        self.register_buffer("decay", decay, persistent=False)
        self.ssm_state: torch.Tensor | None = None  # [slots, heads, D, D], allocate_state

    # ---- state -----------------------------------------------------------------------------------
    def state_shapes(self, num_slots: int) -> tuple[tuple[int, ...], ...]:
        return ((num_slots, self.heads, self.head_dim, self.head_dim),)

    def allocate_state(
        self, num_slots: int, dtype: torch.dtype, ssm_dtype: torch.dtype, device: torch.device
    ) -> None:
        (shape,) = self.state_shapes(num_slots)
        self.ssm_state = torch.zeros(shape, dtype=ssm_dtype, device=device)

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:  # [T, D] -> [T, D]
        assert self.ssm_state is not None, "allocate_state() first"
        t, h, d = x.shape[0], self.heads, self.head_dim
        slots, has_state = md.state_rows()
        q, k, v = F.silu(self.qkv_proj(x)).view(t, h, 3 * d).split(d, dim=-1)
        step = torch.ones(t, h, dtype=torch.float32, device=x.device)
        o = md.backend.ssd_scan(
            v, step, self.decay, k, q, self.ssm_state, md.cu_seqlens_q, slots, has_state
        )  # [T, h, D] float32
        o = o.reshape(t, self.dim)
        sums = o.pow(2).sum(-1, keepdim=True)
        if self.tp_size > 1:  # this rank's heads only: add up the other ranks' squares
            sums = tp_all_reduce(sums)
        o = (o * (sums / self.full + self.norm.eps).rsqrt()).to(x.dtype) * self.norm.weight
        return self.out_proj(torch.sigmoid(self.output_gate(x)) * o)
