"""Zyphra ZAYA1 (`ZayaForCausalLM`, model_type "zaya": ZAYA1-8B).

transformers builds ZAYA's head on AFMoE's and its stack on Laguna's (a rope per layer type),
but the layers are their own. As transformers runs it, the residual stream stays in float32
between layers (each norm reads it cast to the model dtype) and:

    embed      x = (embed(ids) + input_hidden_states_bias) * input_hidden_states_scale
    layer      h = attn(input_layernorm(x));  x = rs1(h, x)
               h = moe(post_attention_layernorm(x));  x = rs2(h, x)
               where rs(h, r) = (h + hidden_states_bias) * hidden_states_scale
                                + (r + residual_bias) * residual_scale
    attention  "Compressed Convolutional Attention" (CCA): q | k projections go through a
               causal depthwise conv of width cca_time0, then a conv of width cca_time1 grouped
               by head (num_attention_heads + num_key_value_heads groups of head_dim
               channels), plus residual paths: q_res = (q + k of its KV head) / 2 per query
               head, k_res the mean of q_res over the KV head's group. The values are
               v_proj_current(x_t) | v_proj_delayed(x_{t-1}) side by side (x_{-1} = 0: the
               delayed projection's bias). q and k are L2-normalized to sqrt(head_dim), k times a
               learned `temp` per KV head; RoPE (NeoX style) rotates the first
               partial_rotary_factor of each head with the rope_parameters entry of the layer's
               type; "hybrid_sliding" layers see the last `sliding_window` keys, "hybrid" ones
               everything; scale head_dim ** -0.5
    moe        a router MLP picks one of num_experts + 1 classes (the last: a skip expert that
               outputs zeros): r = down_proj(x) (+ the previous layer's r times
               router_states_scale, every layer but the first), logits =
               out_proj(gelu(fc2(gelu(fc1(rmsnorm(r)))))), p = softmax(logits), the class of
               the largest p + balancing_biases (the skip class's -1.0: transformers sets it at
               load, whatever the checkpoint holds); the chosen expert (a gated SiLU MLP,
               Qwen3-MoE's fused layout) times its unbiased p

So each layer holds paged KV and, per sequence, a recurrent state (its layer type is "hybrid":
models/hybrid.py): the conv's last (cca_time0 - 1) + (cca_time1 - 1) inputs q | k and the last
token's delayed value projection, in the pools of worker/recurrent_state.py (prefix-cache
snapshots, speculative backups and chunked prefill work on them as on LFM2's conv windows).
The router state crosses layers within a token only.

Refused by name: num_experts_per_tok != 1 (transformers refuses it too), hidden_act other than
SiLU, tensor_parallel_size > 1 (transformers' ZAYA has no TP plan either: the value heads mix
two projections' halves), cca_time0 / cca_time1 below 1 or both 1 (a conv without context),
and layer_types without a "hybrid" layer (the engine keeps recurrent state for models with
one).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.attention.backend import AttentionMetadata
from paged_engine.distributed.parallel_state import get_tp_size
from paged_engine.layers.attention import Attention
from paged_engine.layers.fused_moe import FusedMoE
from paged_engine.layers.linear import ColumnParallelLinear, copy_checked
from paged_engine.layers.linear_mixer import LinearMixer
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.hybrid import HybridModel, layer_types
from paged_engine.models.llama import stage_input
from paged_engine.models.mixtral import check_silu
from paged_engine.models.utils import CausalLMBase, cfg_get

LAYER_TYPES = ("hybrid", "hybrid_sliding")


def _linear(n_in: int, n_out: int, bias: bool) -> ColumnParallelLinear:
    return ColumnParallelLinear(n_in, n_out, bias, 0, 1)  # replicated: no TP


def causal_windows(
    x: torch.Tensor,  # [T, C]
    pool: torch.Tensor,  # [slots, C, P], oldest input first; updated in place
    md: AttentionMetadata,
    first: torch.Tensor | None = None,  # [C]: what precedes a sequence's first input (0)
) -> torch.Tensor:  # [T, P + 1, C]
    """Each token's window of its sequence's last P + 1 inputs (itself last): the row's P
    stored inputs before the step's (`first` for a sequence starting at position 0). The row
    then holds its sequence's last P inputs. As paged_kernels' reference causal conv: entry q
    of a sequence's [context, inputs] is one row of the table [first, x, contexts]."""
    slots, has_state = md.state_rows()  # slot -1 (padding): the pool's last, scratch row
    num_tokens, channels = x.shape
    p = pool.shape[2]
    cu = md.cu_seqlens_q.to(torch.long)
    starts, lens = cu[:-1], cu[1:] - cu[:-1]
    num_seqs = slots.shape[0]
    use_ctx = has_state & (slots >= 0)
    ctx = pool[slots].transpose(1, 2).reshape(-1, channels).to(x.dtype)  # [S * P, C]
    head = x.new_zeros(1, channels) if first is None else first.to(x.dtype).view(1, channels)
    table = torch.cat([head, x, ctx])

    def rows(seq: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        from_x = 1 + starts[seq] + q - p
        from_ctx = torch.where(use_ctx[seq], 1 + num_tokens + seq * p + q, 0)
        return torch.where(q >= p, from_x, from_ctx)

    token = torch.arange(num_tokens, device=x.device)
    seq = torch.searchsorted(cu[1:], token, right=True).clamp(max=num_seqs - 1)
    span = torch.arange(p + 1, device=x.device)
    windows = table[rows(seq[:, None], (token - starts[seq])[:, None] + span)]
    every = torch.arange(num_seqs, device=x.device)[:, None]
    new = table[rows(every, lens[:, None] + span[:p])]  # [S, P, C]; an empty sequence: as was
    pool[slots] = new.transpose(1, 2).to(pool.dtype)
    return windows


class ZayaCCA(LinearMixer):
    """ZAYA's q / k / v (module docstring): [T, D] -> q [T, H, d], k [T, KV, d], v [T, KV, d].
    Its state: `conv_state` [slots, (H + KV) d, K - 1] the conv's last inputs q | k, and
    `ssm_state` [slots, KV d / 2, 1] the last token's delayed value projection."""

    def __init__(self, config) -> None:
        super().__init__()
        d, heads = int(config.head_dim), int(config.num_attention_heads)
        kv_heads = int(config.num_key_value_heads)
        self.head_dim, self.heads, self.kv_heads = d, heads, kv_heads
        t0, t1 = int(cfg_get(config, "cca_time0", 2)), int(cfg_get(config, "cca_time1", 2))
        if t0 < 1 or t1 < 1 or t0 + t1 < 3:  # the conv's context (a pool column) is >= 1
            raise ValueError(
                f"config.cca_time0={t0} / cca_time1={t1} are not supported: each must be 1 or "
                "more, and one of them 2 or more"
            )
        self.context = (t0 - 1) + (t1 - 1)
        bias, hidden = bool(getattr(config, "attention_bias", False)), config.hidden_size
        self.channels, self.half_v = (heads + kv_heads) * d, kv_heads * d // 2
        self.q_proj = _linear(hidden, heads * d, bias)
        self.k_proj = _linear(hidden, kv_heads * d, bias)
        self.v_proj_current = _linear(hidden, self.half_v, bias)
        self.v_proj_delayed = _linear(hidden, self.half_v, bias)
        c = self.channels
        self.conv_qk_depthwise = nn.Conv1d(c, c, t0, groups=c)
        self.conv_qk_grouped = nn.Conv1d(c, c, t1, groups=heads + kv_heads)

    def state_shapes(self, num_slots: int) -> tuple[tuple[int, ...], ...]:
        return ((num_slots, self.channels, self.context), (num_slots, self.half_v, 1))

    def allocate_state(
        self, num_slots: int, dtype: torch.dtype, ssm_dtype: torch.dtype, device: torch.device
    ) -> None:
        """Both pools hold projections: in the model dtype (not `ssm_dtype`)."""
        super().allocate_state(num_slots, dtype, dtype, device)

    def forward(
        self, x: torch.Tensor, md: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert self.conv_state is not None and self.ssm_state is not None, "allocate_state()"
        t, d, kv = x.shape[0], self.head_dim, self.kv_heads
        q, k = self.q_proj(x), self.k_proj(x)
        # the residual paths, per KV head's group of query heads: [T, KV, G, d]
        q_res = (q.view(t, kv, -1, d) + k.view(t, kv, 1, d)) * 0.5
        k_res = q_res.mean(dim=2)
        qk = torch.cat([q, k], dim=-1)
        win = causal_windows(qk, self.conv_state, md).transpose(1, 2)  # [T, C, K]
        qk = self.conv_qk_grouped(self.conv_qk_depthwise(win)).squeeze(-1)  # [T, C]
        q = qk[:, : self.heads * d].view(t, -1, d) + q_res.reshape(t, -1, d)
        k = qk[:, self.heads * d :].view(t, kv, d) + k_res
        delayed = self.v_proj_delayed(x)
        prev = causal_windows(delayed, self.ssm_state, md, self.v_proj_delayed.bias)[:, 0]
        v = torch.cat([self.v_proj_current(x), prev], dim=-1).view(t, kv, d)
        return q, k, v


class ZayaQKNorm(nn.Module):
    """q and k rescaled to L2 norm sqrt(head_dim) per head, k then times `temp` per KV head."""

    def __init__(self, config) -> None:
        super().__init__()
        self.scale = float(config.head_dim) ** 0.5
        self.temp = nn.Parameter(torch.zeros(int(config.num_key_value_heads)))

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        eps = torch.finfo(q.dtype).eps
        q = q * (self.scale / q.norm(p=2, dim=-1, keepdim=True).clamp_min(eps))
        k = k * (self.scale / k.norm(p=2, dim=-1, keepdim=True).clamp_min(eps))
        return q, k * self.temp[None, :, None]


class ZayaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        d, heads = int(config.head_dim), int(config.num_attention_heads)
        self.qkv_proj = ZayaCCA(config)
        self.qk_norm = ZayaQKNorm(config)
        self.rotary_emb = rope
        sliding = layer_types(config)[layer_idx] == "hybrid_sliding"
        window = int(config.sliding_window) if sliding else None
        self.attn = Attention(heads, d, int(config.num_key_value_heads), d**-0.5, window)
        bias = bool(getattr(config, "attention_bias", False))
        self.o_proj = _linear(heads * d, config.hidden_size, bias)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        t = x.shape[0]
        q, k, v = self.qkv_proj(x, md)
        q, k = self.qk_norm(q, k)
        q, k = self.rotary_emb(positions, q.reshape(t, -1), k.reshape(t, -1))
        return self.o_proj(self.attn(q, k, v.reshape(t, -1), kv_cache, md))


class ZayaResidualScaling(nn.Module):
    """(h + hidden_states_bias) * hidden_states_scale + (r + residual_bias) * residual_scale:
    the float32 residual stream r's update by a sublayer's output h."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.hidden_states_scale = nn.Parameter(torch.ones(hidden_size))
        self.hidden_states_bias = nn.Parameter(torch.zeros(hidden_size))
        self.residual_scale = nn.Parameter(torch.ones(hidden_size))
        self.residual_bias = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, h: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        h = (h + self.hidden_states_bias) * self.hidden_states_scale
        return h + (r + self.residual_bias) * self.residual_scale


class ZayaRouterMLP(nn.Module):
    def __init__(self, width: int, classes: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(width, eps)
        self.fc1 = _linear(width, width, True)
        self.fc2 = _linear(width, width, True)
        self.out_proj = _linear(width, classes, False)

    def forward(self, r: torch.Tensor) -> torch.Tensor:  # [T, R] -> logits [T, E + 1]
        return self.out_proj(F.gelu(self.fc2(F.gelu(self.fc1(self.norm(r))))))


def _load_balancing_biases(param: nn.Parameter, w: torch.Tensor) -> None:
    """The checkpoint's biases, the skip class's set to -1.0: transformers' init sets it after
    loading, whatever the checkpoint holds (the released one holds -1.0 there too)."""
    copy_checked(param.data, w, "balancing_biases")
    param.data[-1] = -1.0


class ZayaRouter(nn.Module):
    """One of num_experts + 1 classes a token (module docstring); the last, skip, class comes
    out as expert 0 with weight 0."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.num_experts = int(config.num_experts)
        width = int(config.router_hidden_size)
        self.down_proj = _linear(config.hidden_size, width, True)
        # "EDA": every layer but the first adds the previous layer's router state
        self.router_states_scale = nn.Parameter(torch.ones(width)) if layer_idx else None
        eps = float(cfg_get(config, "rms_norm_eps", 1e-5))
        self.router_mlp = ZayaRouterMLP(width, self.num_experts + 1, eps)
        # HF's (saved) buffer, float32 as HF adds it
        self.balancing_biases = nn.Parameter(
            torch.zeros(self.num_experts + 1, dtype=torch.float32), requires_grad=False
        )
        self.balancing_biases.weight_loader = _load_balancing_biases

    def forward(
        self, x: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D], the previous layer's state [T, R] -> (weights [T, 1] float32, expert ids
        [T, 1], this layer's state [T, R])."""
        r = self.down_proj(x)
        if self.router_states_scale is not None and state is not None:
            r = r + state * self.router_states_scale
        probs = torch.softmax(self.router_mlp(r), dim=-1)
        _, ids = torch.topk(probs.float() + self.balancing_biases, 1, dim=-1)
        weights = probs.gather(-1, ids)
        skip = ids == self.num_experts
        return weights.masked_fill(skip, 0).float(), ids.masked_fill(skip, 0), r


class ZayaSparseMoeBlock(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.gate = ZayaRouter(config, layer_idx)
        experts, inter = int(config.num_experts), int(config.moe_intermediate_size)
        self.experts = FusedMoE(experts, config.hidden_size, inter, 0, 1)

    def forward(
        self, x: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids, state = self.gate(x, state)
        return self.experts(x, weights, ids), state


class ZayaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        d, eps = config.hidden_size, float(cfg_get(config, "rms_norm_eps", 1e-5))
        self.self_attn = ZayaAttention(config, layer_idx, rope)
        self.mlp = ZayaSparseMoeBlock(config, layer_idx)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.post_attention_residual_scale = ZayaResidualScaling(d)
        self.post_mlp_residual_scale = ZayaResidualScaling(d)

    def forward(
        self, positions, x, kv_cache, md, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the float32 stream [T, D]; `state`: the previous layer's router state."""
        dtype = self.input_layernorm.weight.dtype
        h = self.self_attn(positions, self.input_layernorm(x.to(dtype)), kv_cache, md)
        x = self.post_attention_residual_scale(h, x)
        h, state = self.mlp(self.post_attention_layernorm(x.to(dtype)), state)
        return self.post_mlp_residual_scale(h, x), state


def zaya_rope(config, layer_type: str) -> RotaryEmbedding:
    """The rope of one layer type: rope_parameters' entry for it (transformers' per-type keys
    are ZAYA's own, "hybrid" / "hybrid_sliding")."""
    params = getattr(config, "rope_parameters", None) or {}
    if not isinstance(params.get(layer_type), dict):
        raise ValueError(f"config.rope_parameters has no entry for layer type {layer_type!r}")
    view = copy.copy(config)
    view.rope_parameters = dict(params[layer_type])
    return get_rope(view, int(config.head_dim))


class ZayaModel(HybridModel):
    """The embedding with its scale and bias, the layers passing the router state on, the
    final norm; one rope per layer type (`ropes`)."""

    def __init__(self, config) -> None:
        types = layer_types(config)
        ropes = {t: zaya_rope(config, t) for t in dict.fromkeys(types)}
        eps = float(cfg_get(config, "rms_norm_eps", 1e-5))
        super().__init__(
            config,
            lambda i: ZayaDecoderLayer(config, i, ropes[types[i]]),
            RMSNorm(config.hidden_size, eps),
            None,
        )
        self.ropes = nn.ModuleList(ropes.values())
        self.input_hidden_states_scale = nn.Parameter(torch.ones(config.hidden_size))
        self.input_hidden_states_bias = nn.Parameter(torch.zeros(config.hidden_size))

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        x = stage_input(self, input_ids, hidden)
        x = ((x + self.input_hidden_states_bias) * self.input_hidden_states_scale).float()
        for rope in self.ropes:
            rope.begin_forward(positions)
        state = None
        for layer, i in zip(self.layers, self.kv_index, strict=True):
            x, state = layer(positions, x, kv_caches[i], md, state)
        return self.norm(x.to(self.norm.weight.dtype))


class ZayaForCausalLM(CausalLMBase):
    tie_default = True
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config) -> None:
        name = type(self).__name__
        check_silu(config, name)
        if int(config.num_experts_per_tok) != 1:
            raise ValueError(
                f"{name}: config.num_experts_per_tok={config.num_experts_per_tok} is not "
                "supported (ZAYA routes each token to one expert; transformers refuses it too)"
            )
        if get_tp_size() > 1:
            raise ValueError(
                f"{name}: tensor_parallel_size > 1 is not supported (transformers' ZAYA has no "
                "TP plan either)"
            )
        types = layer_types(config)
        if any(t not in LAYER_TYPES for t in types) or "hybrid" not in types:
            raise ValueError(
                f"{name}: config.layer_types must be among {LAYER_TYPES} with at least one "
                f"'hybrid' layer (the engine keeps recurrent state for those), got {types!r}"
            )
        self.head_bias = bool(getattr(config, "lm_head_bias", False))
        super().__init__(config, ZayaModel(config))
