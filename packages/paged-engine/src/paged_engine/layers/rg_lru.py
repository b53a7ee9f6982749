"""Griffin's recurrent block (RecurrentGemma's `RecurrentGemmaRecurrentBlock`): a temporal conv
and the Real-Gated Linear Recurrent Unit (RG-LRU, `RecurrentGemmaRglru`), the token mixer of
RecurrentGemma's "recurrent" layers (models/recurrent_gemma.py).

    y = act(linear_y(x));  u = conv_1d(linear_x(x))          (causal depthwise, width K, bias)
    i_t = sigmoid(W_i u_t + b_i);  r_t = sigmoid(W_r u_t + b_r)    (block-diagonal: one
                                                                    [w, w] matrix per head)
    log a_t = -8 r_t softplus(recurrent_param);  a_t = exp(log a_t)
    h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t u_t)    (the sqrt is 1 at position 0, h_{-1} = 0)
    out = linear_out(h * y)

A sequence carries its conv window (the last K - 1 inputs u, [C, K - 1], the model dtype) and h
([C], float32 whatever the model dtype, as HF keeps it) in per-layer pools indexed by
`md.state_slots` (worker/recurrent_state.py), as LFM2's short conv and Mamba's mixer do. The
conv runs on `md.backend` (paged_kernels' Triton kernel or its torch reference); the recurrence
is a torch loop over the step's longest query (`rg_lru_scan`, vectorized over sequences and
channels; decode is one step). There is no Triton kernel for it: the scan is elementwise and
its cost is one small op per token position of the longest prefill chunk.

Tensor parallelism is not supported (the model refuses tensor_parallel_size > 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.attention.backend import AttentionMetadata
from paged_engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from paged_engine.layers.linear_mixer import DepthwiseConv, LinearMixer


def rg_lru_scan(
    x: torch.Tensor,  # [T, C] the normalized gated inputs
    a: torch.Tensor,  # [T, C] the decays
    state: torch.Tensor,  # [slots, C] float32, updated in place; the last row is scratch
    cu_seqlens: torch.Tensor,  # [S + 1]
    state_slots: torch.Tensor,  # [S], -1 = padding
    has_initial_state: torch.Tensor,  # [S] bool
    max_len: int,  # the longest sequence of the step (host int: no sync)
) -> torch.Tensor:  # [T, C] in x's dtype
    """h_t = a_t h_{t-1} + x_t per sequence in float32, from its slot's h (zeros without an
    initial state); each slot then holds its sequence's last h (padding rows write the scratch
    row; an empty sequence leaves its slot as it was)."""
    num_tokens = x.shape[0]
    cu = cu_seqlens.to(device=x.device, dtype=torch.long)
    starts, lens = cu[:-1], cu[1:] - cu[:-1]
    slots = state_slots.to(device=x.device, dtype=torch.long)
    rows = torch.where(slots >= 0, slots, state.shape[0] - 1)  # [S]
    use_ctx = (slots >= 0) & has_initial_state.to(x.device)
    before = state[rows]  # [S, C]
    h = torch.where(use_ctx[:, None], before, 0.0)  # not a product: a row may hold NaN
    x32, a32 = x.float(), a.float()
    # one spare output row (index T) takes the writes of sequences already done
    out = torch.empty(num_tokens + 1, x.shape[1], dtype=torch.float32, device=x.device)
    for i in range(max_len):
        live = i < lens  # [S]
        idx = torch.where(live, starts + i, num_tokens)  # [S]
        src = idx.clamp(max=max(num_tokens - 1, 0))
        h = torch.where(live[:, None], a32[src] * h + x32[src], h)
        out.index_copy_(0, idx, h)
    state.index_copy_(0, rows, torch.where((lens > 0)[:, None], h, before.float()).to(state.dtype))
    return out[:num_tokens].to(x.dtype)


class RgLru(nn.Module):
    """The RG-LRU's parameters under HF's names and its gates (module docstring)."""

    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        if width % num_heads:
            raise ValueError(
                f"lru_width={width} is not divisible by num_attention_heads={num_heads}"
            )
        self.num_heads, self.block_width = num_heads, width // num_heads
        w = self.block_width
        self.recurrent_param = nn.Parameter(torch.empty(width))
        self.input_gate_weight = nn.Parameter(torch.empty(num_heads, w, w))
        self.input_gate_bias = nn.Parameter(torch.empty(num_heads, w))
        self.recurrent_gate_weight = nn.Parameter(torch.empty(num_heads, w, w))
        self.recurrent_gate_bias = nn.Parameter(torch.empty(num_heads, w))

    def _gate(self, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """sigmoid(u_h @ W_h + b_h) per head h: [T, C] -> [T, C]."""
        t = u.shape[0]
        heads = u.view(t, self.num_heads, self.block_width).transpose(0, 1)  # [H, T, w]
        g = torch.baddbmm(bias[:, None, :], heads, weight)  # [H, T, w]
        return torch.sigmoid(g.transpose(0, 1).reshape(t, -1))

    def inputs_and_decays(
        self, u: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The scan's inputs sqrt(1 - a^2) i u (i u at position 0) and decays a: [T, C] each,
        in u's dtype (as HF computes them)."""
        input_gate = self._gate(u, self.input_gate_weight, self.input_gate_bias)
        recurrent_gate = self._gate(u, self.recurrent_gate_weight, self.recurrent_gate_bias)
        log_a = -8.0 * recurrent_gate * F.softplus(self.recurrent_param)
        a = torch.exp(log_a)
        multiplier = torch.sqrt(1 - torch.exp(2 * log_a))
        multiplier = torch.where((positions == 0)[:, None], 1.0, multiplier)
        return u * input_gate * multiplier.to(u.dtype), a


class RecurrentBlock(LinearMixer):
    """Griffin's recurrent block (module docstring): [T, D] -> [T, D]."""

    def __init__(
        self, hidden_size: int, width: int, num_heads: int, kernel: int, act: nn.Module
    ) -> None:
        """`act`: the y branch's activation (the config's hidden_activation)."""
        super().__init__()
        if kernel < 2:
            raise ValueError(f"conv1d_width={kernel}: the temporal conv needs a width of 2 or more")
        self.channels, self.kernel = width, kernel
        self.linear_y = ColumnParallelLinear(hidden_size, width, bias=True)
        self.linear_x = ColumnParallelLinear(hidden_size, width, bias=True)
        self.linear_out = RowParallelLinear(width, hidden_size, bias=True)
        self.conv_1d = DepthwiseConv(width, kernel, bias=True)
        self.rg_lru = RgLru(width, num_heads)
        self.act_fn = act

    # ---- state -----------------------------------------------------------------------------------
    def state_shapes(self, num_slots: int) -> tuple[tuple[int, ...], ...]:
        return (num_slots, self.channels, self.kernel - 1), (num_slots, self.channels)

    def allocate_state(
        self, num_slots: int, dtype: torch.dtype, ssm_dtype: torch.dtype, device: torch.device
    ) -> None:
        # h in float32 whatever mamba_ssm_cache_dtype says: HF's recurrence accumulates there
        super().allocate_state(num_slots, dtype, torch.float32, device)

    # ---- forward ---------------------------------------------------------------------------------
    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:  # [T, D] -> [T, D]
        assert self.conv_state is not None and self.ssm_state is not None, "allocate_state() first"
        slots, has_state = md.state_rows()
        y = self.act_fn(self.linear_y(x))
        u = self.run_conv(self.conv_1d, self.linear_x(x), md, slots, has_state, activation=None)
        inputs, decays = self.rg_lru.inputs_and_decays(u, positions)
        h = rg_lru_scan(
            inputs, decays, self.ssm_state, md.cu_seqlens_q, slots, has_state, md.max_seqlen_q
        )
        return self.linear_out(h * y)
