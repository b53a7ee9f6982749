"""The gated short convolution of Liquid AI's LFM2 / LFM2-MoE (`Lfm2ShortConv`), the token mixer
of their "conv" layers.

Per token, one input projection gives three hidden-size vectors b | c | x; the product b * x goes
through a causal depthwise conv of width K (`conv_L_cache`, 3 in the released models; no
activation), and the output projection takes c times the conv's output:

    y = out_proj(c * conv(b * x))

The state a sequence carries is the conv window alone, its last K - 1 inputs b * x ([C, K - 1]
a layer), in a per-layer pool indexed by `md.state_slots` (worker/recurrent_state.py); there is
no ssm_state. The conv runs on `md.backend` (paged_kernels' Triton kernel or its torch
reference), as Mamba2's and Gated DeltaNet's do.

Tensor parallelism splits the channels (hidden_size divisible by tp_size): in_proj per segment
(b | c | x), the depthwise conv's channels with them, out_proj by rows (its all-reduce).
`conv_bias` puts a bias on all three (HF's `bias`), the row-parallel one added by rank 0 alone.
"""

from __future__ import annotations

import torch

from paged_engine.attention.backend import AttentionMetadata
from paged_engine.distributed.parallel_state import get_tp_rank, get_tp_size
from paged_engine.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_checked,
    shard_segments,
)
from paged_engine.layers.linear_mixer import DepthwiseConv, LinearMixer


class ShortConv(LinearMixer):
    def __init__(self, hidden_size: int, kernel: int, bias: bool) -> None:
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        if hidden_size % tp:
            raise ValueError(
                f"the short conv's hidden_size={hidden_size} is not divisible by "
                f"tensor_parallel_size={tp}"
            )
        if kernel < 2:
            raise ValueError(f"conv_L_cache={kernel}: the short conv needs a width of 2 or more")
        self.tp_size, self.tp_rank = tp, rank
        self.full_channels = hidden_size
        self.channels = hidden_size // tp  # this rank's
        self.kernel = kernel
        # built whole (tp_size 1) at this rank's size: the loader picks each segment's rows
        self.in_proj = ColumnParallelLinear(hidden_size, 3 * self.channels, bias, 0, 1)
        self.conv = DepthwiseConv(self.channels, kernel, bias)
        self.out_proj = RowParallelLinear(hidden_size, hidden_size, bias)
        for p in (self.in_proj.weight, self.in_proj.bias, self.conv.weight, self.conv.bias):
            if p is not None:
                p.weight_loader = self._load_channels
        # LoRA (lora/model.py): an adapter's B [b | c | x rows, r] loads as the weight
        self.in_proj.lora_segments = {None: (0, 3 * hidden_size)}
        self.in_proj.lora_b_loader = self._load_channels
        self.conv_state: torch.Tensor | None = None  # [slots, channels, K - 1]

    # ---- state -----------------------------------------------------------------------------------
    def state_shapes(self, num_slots: int) -> tuple[tuple[int, ...]]:
        return ((num_slots, self.channels, self.kernel - 1),)

    # ---- weight loading --------------------------------------------------------------------------
    def _load_channels(self, param, w: torch.Tensor, shard_id=None) -> None:
        """This rank's channels of in_proj's three segments, or of the conv's one."""
        segments = w.shape[0] // self.full_channels
        sizes = [self.full_channels] * segments
        copy_checked(param.data, shard_segments(w, sizes, self.tp_rank, self.tp_size), "conv")

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:  # [T, D] -> [T, D]
        assert self.conv_state is not None, "allocate_state() first"
        slots, has_state = md.state_rows()
        b, c, h = self.in_proj(x).split([self.channels] * 3, dim=-1)
        h = self.run_conv(self.conv, b * h, md, slots, has_state, activation=None)
        return self.out_proj(c * h)
