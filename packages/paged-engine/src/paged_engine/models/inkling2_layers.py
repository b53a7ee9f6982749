"""The decoder layer of Thinking Machines' Inkling 2 (transformers' `Inkling2SlidingDecoderLayer`
/ `Inkling2FullDecoderLayer`, and Inkling 2 Loop's `*LoopDecoderLayer`s), the stack around it
being models/inkling2.py's. What differs from Inkling 1 (models/inkling.py, whose relative-bias
attention over the paged cache and float32 short conv this reuses):

    block residuals  a layer's input is not the residual stream alone: `attention_input` (absent
               on layer 0) and `mlp_input` attend, per token, over the stack [block states...,
               partial sum] (each unweighted-RMS-normed, eps 1e-6) with learned queries at scale
               1 / sqrt(hidden), the values being the normed rows; full layers take three queries
               (their q / k / v inputs), sliding ones one. The block states are the inputs of the
               layers at multiples of `n_layers_per_attn_res_block`; such a boundary layer
               restarts the partial sum (its residual is the attention output alone)
    attention  q = clip(scale * q_proj x), k = clip(sconv(k_proj x_k)), v = rms(sconv(v_proj
               x_v)): clip scales each head vector down to `qk_l2_clip_threshold` (a longer one
               only), rms is weightless; the relative states are clip(scale * r x) at
               `rel_l2_clip_threshold`; full layers multiply q and the relative states by
               Inkling's log-position tau. Scale 1 / sqrt(head_dim), a per-token per-head sink
               logit (`sink_proj x`), the output gated by sigmoid(gate_proj x) before o_proj
    convs      y = (x + conv(x)) / sqrt(K + 1); full layers' k / v convs are dynamic: each tap
               is a static per-channel weight plus a per-token, per-KV-head weight projected from
               the projection's input, y = (x + taps . window) / sqrt(2K + 1)
    mlp        every layer a MoE without shared experts: float32 sigmoid router, top-k of score +
               correction bias, weights score / sum * route_scale; the experts' SwiGLU is
               softcap(gate, mlp_gate_softcap) * sigmoid(gate) * softcap(up, mlp_up_softcap)
    loop       (Inkling 2 Loop's looped layers, passes after the first) gates mix a "message"
               from the previous pass into the q / k / v / mlp inputs: (1 - tanh f) * x +
               tanh(m) * message, f and m low-rank projections of [rms(x), rms(message)]

A looped layer runs once per pass; each pass after the first keeps its own conv windows
(`ConvState` rows, `pass_states`) and its own KV cache (models/inkling2.py), as transformers'
per-pass cache layers. Conv windows and sums run in float32, as HF keeps those weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.attention.backend import AttentionMetadata
from paged_engine.layers.fused_moe import ActExperts
from paged_engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from paged_engine.layers.linear_mixer import LinearMixer
from paged_engine.layers.norm import RMSNorm
from paged_engine.models.inkling import InklingShortConv, relative_attention

SLIDING, FULL = "hybrid_sliding", "hybrid"
F32 = torch.float32


class Inkling2RMSNorm(RMSNorm):
    round_before_weight = False  # HF multiplies by the weight in float32, then casts


def l2_clip(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Each last-dim vector scaled down to norm `threshold` if longer (float32)."""
    x = x.float()
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x * (threshold / (norm + 1e-6)).clamp(max=1.0)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS norm in float32."""
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def log_tau(positions: torch.Tensor, alpha: float, floor: float) -> torch.Tensor:  # [T] f32
    return 1.0 + alpha * torch.log(((positions + 1).float() / floor).clamp(min=1.0))


class ConvState(LinearMixer):
    """Conv windows [slots, C, K - 1] (float32) of a looped conv's later passes: state only,
    the weights are the conv's."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.channels, self.kernel = channels, kernel

    def state_shapes(self, num_slots: int) -> tuple[tuple[int, ...]]:
        return ((num_slots, self.channels, self.kernel - 1),)

    def allocate_state(self, num_slots, dtype, ssm_dtype, device) -> None:
        super().allocate_state(num_slots, F32, ssm_dtype, device)


class Inkling2ShortConv(InklingShortConv):
    """Inkling's float32 short conv, output (x + conv(x)) / sqrt(K + 1); `state` a later
    pass's windows (default: the conv's own)."""

    def forward(self, x, md: AttentionMetadata, state: torch.Tensor | None = None):
        slots, has_state = md.state_rows()
        h = x.float()
        w = self.conv1d.weight.float().squeeze(1)
        window = self.conv_state if state is None else state
        y = md.backend.causal_conv1d(
            h, w, None, window, md.cu_seqlens_q, slots, has_state, activation=None
        )
        return ((h + y) / math.sqrt(self.kernel + 1)).to(x.dtype)


class Inkling2DynamicConv(LinearMixer):
    """HF's `Inkling2DynamicShortConvolution` in torch: taps [K, C] static (`static_weight`,
    tap 0 the current token) plus `weight_proj(input)` [T, heads, K] shared by each head's
    channels. x [T, C], input [T, hidden] -> [T, C]; the window state [slots, C, K - 1] f32."""

    def __init__(self, channels: int, hidden: int, heads: int, kernel: int) -> None:
        super().__init__()
        self.channels, self.kernel, self.heads = channels, kernel, heads
        self.static_weight = nn.Parameter(torch.zeros(kernel, channels, dtype=F32))
        self.weight_proj = ColumnParallelLinear(hidden, heads * kernel, bias=False)

    def state_shapes(self, num_slots: int) -> tuple[tuple[int, ...]]:
        return ((num_slots, self.channels, self.kernel - 1),)

    def allocate_state(self, num_slots, dtype, ssm_dtype, device) -> None:
        super().allocate_state(num_slots, F32, ssm_dtype, device)

    def forward(self, x, dyn_in, md: AttentionMetadata, state: torch.Tensor | None = None):
        state = self.conv_state if state is None else state
        assert state is not None, "allocate_state() first"
        slots, has_state = md.state_rows()
        t, c, k = x.shape[0], self.channels, self.kernel
        dev, h = x.device, x.float()
        cu = md.cu_seqlens_q.long()
        starts, counts = cu[:-1], cu[1:] - cu[:-1]
        s = starts.shape[0]
        tok = torch.arange(t, device=dev)
        seq = torch.searchsorted(cu[1:], tok, right=True).clamp(max=s - 1)
        prev = state[slots] * has_state[:, None, None]  # [S, C, K - 1]; zeros: a fresh start
        # window [T, K, C]: row lag = the input `lag` tokens back, from the step or the state
        src = (tok - starts[seq])[:, None] - torch.arange(k, device=dev)  # [T, K]
        from_step = h[(tok[:, None] - torch.arange(k, device=dev)).clamp(min=0)]
        idx = (k - 1 + src).clamp(0, k - 2)[:, None, :].expand(t, c, k)
        from_state = prev[seq].gather(2, idx).transpose(1, 2)
        window = torch.where((src >= 0)[..., None], from_step, from_state)
        dyn = self.weight_proj(dyn_in).float().view(t, self.heads, k)
        taps = self.static_weight.float() + dyn.transpose(1, 2).repeat_interleave(
            c // self.heads, dim=2
        )
        y = (window * taps).sum(1)
        # each sequence's new window: its last K - 1 inputs, old state first
        p = counts[:, None] - (k - 1) + torch.arange(k - 1, device=dev)  # [S, K - 1]
        new_step = h[(starts[:, None] + p).clamp(0, max(t - 1, 0))].transpose(1, 2)
        new_state = prev.gather(2, (k - 1 + p).clamp(0, k - 2)[:, None, :].expand(s, c, k - 1))
        state[slots] = torch.where((p >= 0)[:, None, :], new_step, new_state)
        return ((y + h) / math.sqrt(2 * k + 1)).to(x.dtype)


class Inkling2BlockResidual(nn.Module):
    """HF's `Inkling2BlockAttentionResidual`: learned queries [n, D] over the normed stack
    [blocks..., partial]; ([T, D] list, [T, D]) -> [T, n, D] float32."""

    def __init__(self, hidden: int, num_queries: int = 1, shape: tuple[int, ...] | None = None):
        super().__init__()
        shape = shape or ((hidden,) if num_queries == 1 else (num_queries, hidden))
        self.query = nn.Parameter(torch.zeros(*shape, dtype=F32))

    def forward(self, blocks, partial, query: torch.Tensor | None = None) -> torch.Tensor:
        stacked = unit_rms(torch.stack([*blocks, partial], dim=1), 1e-6)  # [T, B + 1, D]
        d = stacked.shape[-1]
        q = (self.query if query is None else query).float().view(-1, d)
        probs = torch.softmax(torch.einsum("nd,tbd->tnb", q, stacked) * d**-0.5, dim=-1)
        return torch.einsum("tnb,tbd->tnd", probs, stacked)


class Inkling2MessageGate(nn.Module):
    """(1 - tanh(f)) * x + tanh(m) * message, [f | m] from down_proj [rms x, rms message]."""

    def __init__(self, hidden: int, rank: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.down_proj = ColumnParallelLinear(2 * hidden, rank, bias=False)
        self.forget_gate_proj = nn.Linear(rank, hidden, bias=False, dtype=F32)
        self.message_gate_proj = nn.Linear(rank, hidden, bias=False, dtype=F32)

    def forward(self, x: torch.Tensor, message: torch.Tensor) -> torch.Tensor:  # f32 [T, D]
        x, message = x.float(), message.float()
        both = torch.cat([unit_rms(x, self.eps), unit_rms(message, self.eps)], dim=-1)
        low = self.down_proj(both.to(self.down_proj.weight.dtype)).float()
        forget = torch.tanh(self.forget_gate_proj(low))
        return (1 - forget) * x + torch.tanh(self.message_gate_proj(low)) * message


class _Projection(nn.Module):
    """`linear` and, where given, the clip's learned per-head `norm.scale` [H, d]."""

    def __init__(self, hidden: int, heads: int, dim: int, scaled: bool) -> None:
        super().__init__()
        self.linear = ColumnParallelLinear(hidden, heads * dim, bias=False)
        if scaled:
            self.norm = nn.Module()
            self.norm.scale = nn.Parameter(torch.ones(heads, dim))


class Inkling2Attention(nn.Module):
    """The module docstring's attention. (q, k, v inputs [T, D]) -> [T, D]."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        sliding = config.layer_types[layer_idx] == SLIDING
        pre = "swa_" if sliding else ""
        self.num_heads = h = int(getattr(config, f"{pre}num_attention_heads"))
        self.num_kv_heads = hkv = int(getattr(config, f"{pre}num_key_value_heads"))
        self.head_dim = d = int(getattr(config, f"{pre}head_dim"))
        hidden, kernel = config.hidden_size, int(config.conv_kernel_size)
        self.d_rel, self.eps = int(config.d_rel), float(config.rms_norm_eps)
        self.window = int(config.sliding_window_size) if sliding else None
        extent = int(config.sliding_window_size) if sliding else int(config.rel_extent)
        self.qk_clip, self.rel_clip = config.qk_l2_clip_threshold, config.rel_l2_clip_threshold
        self.log_scaled = not sliding
        self.log_alpha, self.log_floor = config.log_scaling_alpha, config.log_scaling_n_floor
        self.q_proj = _Projection(hidden, h, d, scaled=True)
        self.k_proj = _Projection(hidden, hkv, d, scaled=False)
        self.v_proj = _Projection(hidden, hkv, d, scaled=False)
        for proj in (self.k_proj, self.v_proj):
            proj.sconv = (
                Inkling2ShortConv(hkv * d, kernel)
                if sliding
                else Inkling2DynamicConv(hkv * d, hidden, hkv, kernel)
            )
        self.o_proj = nn.Module()
        self.o_proj.gate_proj = ColumnParallelLinear(hidden, h * d, bias=False)
        self.o_proj.linear = RowParallelLinear(h * d, hidden, bias=False)
        self.sink_proj = ColumnParallelLinear(hidden, h, bias=False)
        self.relative_position_bias = _Projection(hidden, h, self.d_rel, scaled=True)
        self.relative_position_bias.proj = nn.Parameter(torch.empty(self.d_rel, extent))

    def _conv(self, proj: _Projection, x_in, md, state) -> torch.Tensor:
        y = proj.linear(x_in)
        if isinstance(proj.sconv, Inkling2DynamicConv):
            return proj.sconv(y, x_in, md, state)
        return proj.sconv(y, md, state)

    def forward(self, positions, q_in, k_in, v_in, kv_cache, md, states=None) -> torch.Tensor:
        t, d, dtype = q_in.shape[0], self.head_dim, q_in.dtype
        k_state, v_state = states if states is not None else (None, None)
        q = l2_clip(
            self.q_proj.linear(q_in).view(t, -1, d) * self.q_proj.norm.scale.float(), self.qk_clip
        )
        k = l2_clip(self._conv(self.k_proj, k_in, md, k_state).view(t, -1, d), self.qk_clip)
        v = unit_rms(self._conv(self.v_proj, v_in, md, v_state).view(t, -1, d), self.eps)
        rpb = self.relative_position_bias
        rel = rpb.linear(q_in).view(t, -1, self.d_rel) * rpb.norm.scale.float()
        rel = l2_clip(rel, self.rel_clip)
        if self.log_scaled:
            tau = log_tau(positions, self.log_alpha, self.log_floor)[:, None, None]
            q, rel = q * tau, rel * tau
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        rel = rel.to(dtype) @ rpb.proj.to(dtype)
        key_cache, value_cache = kv_cache
        md.backend.write_kv(k, v, key_cache, value_cache, md.slot_mapping, k_scale=1.0, v_scale=1.0)
        sinks = self.sink_proj(q_in)
        out = relative_attention(
            q, rel, positions, key_cache, value_cache, md, d**-0.5, self.window, sinks
        ).reshape(t, -1)
        gate = torch.sigmoid(self.o_proj.gate_proj(q_in).float())
        return self.o_proj.linear((out.float() * gate).to(dtype))


class SoftcappedSwiGLU(nn.Module):
    """[.., 2I] gate | up -> softcap(gate) * sigmoid(gate) * softcap(up), in float32."""

    def __init__(self, gate_cap: float, up_cap: float) -> None:
        super().__init__()
        self.gate_cap, self.up_cap = float(gate_cap), float(up_cap)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.float().chunk(2, dim=-1)
        capped = torch.tanh(gate / self.gate_cap) * self.gate_cap
        out = capped * torch.sigmoid(gate) * torch.tanh(up / self.up_cap) * self.up_cap
        return out.to(gate_up.dtype)


class Inkling2Router(nn.Module):
    """x [T, H] -> (weights [T, k], ids [T, k]), float32."""

    def __init__(self, config) -> None:
        super().__init__()
        n = int(config.n_routed_experts)
        self.top_k, self.route_scale = int(config.num_experts_per_tok), float(config.route_scale)
        self.weight = nn.Parameter(torch.empty(n, config.hidden_size, dtype=F32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(n, dtype=F32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        ids = torch.topk(scores + self.e_score_correction_bias.float(), self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        return weights / (weights.sum(-1, keepdim=True) + 1e-20) * self.route_scale, ids


class Inkling2MoE(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.gate = Inkling2Router(config)
        act = SoftcappedSwiGLU(config.mlp_gate_softcap, config.mlp_up_softcap)
        self.experts = ActExperts(
            act, int(config.n_routed_experts), config.hidden_size, int(config.moe_intermediate_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids)


class Inkling2DecoderLayer(nn.Module):
    """One layer: (positions, x [T, D], blocks, kv_cache, md, pass, messages [T, 4, D] or
    None) -> (x', blocks with x appended at a block boundary)."""

    def __init__(self, config, layer_idx: int, passes: int = 1) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, float(config.rms_norm_eps)
        kernel = int(config.conv_kernel_size)
        self.full = config.layer_types[layer_idx] == FULL
        self.is_block_boundary = layer_idx % int(config.n_layers_per_attn_res_block) == 0
        self.attention_input = (
            Inkling2BlockResidual(hidden, 3 if self.full else 1) if layer_idx > 0 else None
        )
        self.mlp_input = Inkling2BlockResidual(hidden)
        self.self_attn = Inkling2Attention(config, layer_idx)
        self.mlp = Inkling2MoE(config)
        norms = ("q_input_layernorm", "k_input_layernorm", "v_input_layernorm")
        for name in norms if self.full else ("input_layernorm",):
            setattr(self, name, Inkling2RMSNorm(hidden, eps))
        self.post_attention_layernorm = Inkling2RMSNorm(hidden, eps)
        self.post_attention_convolution = Inkling2ShortConv(hidden, kernel)
        self.post_mlp_convolution = Inkling2ShortConv(hidden, kernel)
        self.looped = passes > 1
        if self.looped:
            rank = int(config.loop_gate_rank)
            for name in ("q", "k", "v", "mlp"):
                setattr(self, f"{name}_message_gate", Inkling2MessageGate(hidden, rank, eps))
            # passes 1.. : windows of k / v sconv, post-attention and post-MLP convs
            kv = self.self_attn.num_kv_heads * self.self_attn.head_dim
            shapes = ((kv, kernel), (kv, kernel), (hidden, kernel), (hidden, kernel))
            self.pass_states = nn.ModuleList(
                nn.ModuleList(ConvState(c, k) for c, k in shapes) for _ in range(passes - 1)
            )

    def _windows(self, pass_idx: int) -> list[torch.Tensor | None]:
        if pass_idx == 0:
            return [None] * 4
        return [m.conv_state for m in self.pass_states[pass_idx - 1]]

    def forward(self, positions, x, blocks, kv_cache, md, pass_idx=0, messages=None):
        dtype, block_residual = x.dtype, x
        windows = self._windows(pass_idx)
        msg = messages.unbind(1) if messages is not None else None
        if self.full:
            if self.attention_input is None:
                ins = [x, x, x]
            else:
                ins = list(self.attention_input(blocks, x).unbind(1))
            if msg is not None:
                gates = (self.q_message_gate, self.k_message_gate, self.v_message_gate)
                ins = [g(h, m) for g, h, m in zip(gates, ins, msg[:3], strict=True)]
            norms = (self.q_input_layernorm, self.k_input_layernorm, self.v_input_layernorm)
            q_in, k_in, v_in = (n(h).to(dtype) for n, h in zip(norms, ins, strict=True))
        else:
            h = x if self.attention_input is None else self.attention_input(blocks, x)[:, 0]
            if msg is None:
                q_in = k_in = v_in = self.input_layernorm(h).to(dtype)
            else:
                gates = (self.q_message_gate, self.k_message_gate, self.v_message_gate)
                q_in, k_in, v_in = (
                    self.input_layernorm(g(h, m)).to(dtype) for g, m in zip(gates, msg[:3])
                )
        a = self.self_attn(positions, q_in, k_in, v_in, kv_cache, md, windows[:2])
        h = self.post_attention_convolution(a, md, windows[2]).float()
        if self.is_block_boundary:
            blocks = [*blocks, block_residual]
            residual = h
        else:
            residual = h = block_residual.float() + h
        h = self.mlp_input(blocks, h)[:, 0]
        if msg is not None:
            h = self.mlp_message_gate(h, msg[3])
        h = self.mlp(self.post_attention_layernorm(h).to(dtype))
        h = self.post_mlp_convolution(h, md, windows[3])
        return (residual + h).to(dtype), blocks
