"""Preferred Networks PLaMo 2 (`Plamo2ForCausalLM`, remote code: pfnet/plamo-2-1b, plamo-2-8b):
Mamba-style mixer layers among sliding-window attention layers, each layer with four
"sandwich" RMSNorms whose stored weights are offsets from a constant:

    x += post_mixer_norm(mixer(pre_mixer_norm(x)))       offsets 1 and 1/5
    x += post_mlp_norm(mlp(pre_mlp_norm(x)))             offsets 1 and 1/5^1.5

(final norm: offset 1; norm(x) = rmsnorm(x) * (offset + weight)). Layer i is attention when
i % mamba_step == mamba_step // 2 (the last layer, when there are at most mamba_step // 2), a
mixer otherwise; the translation below writes that as `layer_types` for models/hybrid.py.

The mixer (the remote code's `Mamba`, vLLM's `Plamo2MambaMixer`), H heads of P channels:
in_proj gives per head z_h | x_h (interleaved in the checkpoint; split into z | x at load);
x goes through a causal depthwise conv (no bias) and SiLU; B | C | dt_in = bcdt_proj(x), each
RMS-normed with a plain weight (dt_norm_weight, B_norm_weight, C_norm_weight; no offset);
dt = softplus(dt_proj(dt_in) + dt_bias) per head; one group's B, C shared by every head; the
scan is Mamba2's (layers/mamba2.py: `backend.ssd_scan`), then y = (y + D x) * silu(z) and
out_proj. Attention: a fused qkv_proj, per-head RMSNorm of q and k (eps 1e-6) times per-head
weights q_weight [H, D] / k_weight [Hkv, D], RoPE (NeoX, base 10000), grouped KV heads. A layer
not in `full_attention_idx` sees its `attention_window_size` previous positions and its own
(paged's window counts the own position: attention_window_size + 1, the remote code's mask and
cache). The MLP: down(silu(gate) * up) from a fused gate_up_proj.

Checkpoint names: model.layers.layers.{i}.* (the remote decoder nests its layer list). The
remote config raises max_position_embeddings to at least 10M (the releases say 10485760): pass a
max_model_len the KV cache holds; the rope tables are built that long only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from paged_engine.attention.backend import AttentionMetadata
from paged_engine.distributed.parallel_state import get_tp_rank, get_tp_size
from paged_engine.layers.attention import Attention
from paged_engine.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    copy_checked,
    shard_segments,
)
from paged_engine.layers.linear_mixer import DepthwiseConv, LinearMixer, check_mixer
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, context_len_or
from paged_engine.models.hybrid import LINEAR_LAYER_TYPES, HybridModel
from paged_engine.models.llama import LlamaForCausalLM, LlamaMLP
from paged_engine.models.phi3 import Phi3ForCausalLM
from paged_engine.models.remote_aliases import common_fields, field, refuse_unless
from paged_engine.models.utils import CausalLMBase, layer_sliding_window

ARCH = "Plamo2ForCausalLM"
QK_NORM_EPS = 1e-6  # the remote attention's fixed q / k norm epsilon
ROPE_BASE = 10000.0  # the remote RotaryEmbedding's base (its config has no rope_theta)
# the remote config raises max_position_embeddings to at least this (length extrapolation)
MIN_POSITIONS = 10 * 1024 * 1024
# the sandwich norms' offsets (the remote decoder layer's)
NORM_OFFSETS = {
    "pre_mixer_norm": 1.0,
    "post_mixer_norm": 1.0 / 5,
    "pre_mlp_norm": 1.0,
    "post_mlp_norm": 1.0 / 5**1.5,
}


def plamo2_layer_types(layers: int, step: int, full_idx: list[int]) -> list[str]:
    """Each layer's kind (mamba, sliding_attention or full_attention), as the remote is_mamba."""

    def is_mamba(i: int) -> bool:
        if layers <= step // 2:
            return i != layers - 1
        return i % step != step // 2

    kinds = []
    for i in range(layers):
        kinds.append(
            "mamba" if is_mamba(i) else "full_attention" if i in full_idx else "sliding_attention"
        )
    return kinds


def plamo2_config(raw: dict[str, Any]) -> PretrainedConfig:
    """PLaMo 2's config.json as our fields; ValueError naming any field this module does not
    serve (fp8 linears, evaluation quantization, image inputs, another rope)."""
    refuse_unless(raw, ARCH, "mamba_enabled", (True, None))
    refuse_unless(raw, ARCH, "linear_type", ("normal", None))
    for name in ("eval_attention_n_bit", "eval_mlp_n_bit", "image_token_id", "rope_scaling"):
        refuse_unless(raw, ARCH, name, (None,))
    refuse_unless(raw, ARCH, "rope_theta", (None, 10000, ROPE_BASE))
    layers = field(raw, "num_hidden_layers", int)
    step = field(raw, "mamba_step", int, 2)
    if step < 2:
        raise ValueError(f"{ARCH}: config.json field 'mamba_step'={step} must be at least 2")
    full_idx = raw.get("full_attention_idx") or []
    if not isinstance(full_idx, list) or not all(isinstance(i, int) for i in full_idx):
        raise ValueError(f"{ARCH}: config.json field 'full_attention_idx' must list layer indices")
    heads = field(raw, "num_attention_heads", int)
    kv_heads = field(raw, "num_key_value_heads", int, heads)
    if heads % kv_heads:
        raise ValueError(
            f"{ARCH}: config.json field 'num_key_value_heads' ({kv_heads}) must divide "
            f"num_attention_heads ({heads})"
        )
    head_dim = field(raw, "hidden_size_per_head", int, 128)
    fields = {
        **common_fields(raw),
        "vocab_size": field(raw, "vocab_size", int),
        "hidden_size": field(raw, "hidden_size", int),
        "intermediate_size": field(raw, "intermediate_size", int),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_size_per_head": head_dim,
        "rms_norm_eps": field(raw, "rms_norm_eps", float, 1e-6),
        "max_position_embeddings": max(
            MIN_POSITIONS, field(raw, "max_position_embeddings", int, MIN_POSITIONS)
        ),
        "sliding_window": field(raw, "attention_window_size", int, 2048) + 1,
        "layer_types": plamo2_layer_types(layers, step, full_idx),
        "mamba_d_state": field(raw, "mamba_d_state", int, 64),
        "mamba_d_conv": field(raw, "mamba_d_conv", int, 4),
        "mamba_num_heads": field(raw, "mamba_num_heads", int, 64),
        "mamba_step": step,
        "hidden_act": "silu",
        "tie_word_embeddings": field(raw, "tie_word_embeddings", bool, True),
    }
    config = PretrainedConfig(**fields)
    config.model_type = "plamo2"
    return config


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) in float32, cast back, times `weight` (the remote `_rms_norm`, offset 0)."""
    return torch.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight


class Plamo2Mixer(LinearMixer):
    """The PLaMo 2 mixer (module docstring): [T, D] -> [T, D]. Tensor parallelism splits the
    heads (in_proj's z / x rows, the conv channels, dt_proj's rows, A_log / D / dt_bias);
    bcdt_proj and out_proj split their inputs (summed across ranks), the norms' weights are
    whole on every rank."""

    def __init__(self, config) -> None:
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        heads, head_dim = int(config.mamba_num_heads), int(config.hidden_size_per_head)
        check_mixer("PLaMo 2's mixer", None, tp, mamba_num_heads=heads)
        self.tp_rank, self.tp_size = rank, tp
        self.full_heads, self.num_heads, self.head_dim = heads, heads // tp, head_dim
        self.inner = self.num_heads * head_dim  # this rank's channels
        self.state_size = int(config.mamba_d_state)
        self.kernel = int(config.mamba_d_conv)
        self.dt_dim = max(64, config.hidden_size // 16)
        self.eps = float(config.rms_norm_eps)
        hidden, inner = config.hidden_size, heads * head_dim
        # rows z | x of this rank's heads (built whole at this rank's size: _load_in_proj)
        self.in_proj = ColumnParallelLinear(hidden, 2 * self.inner, False, 0, 1)
        self.in_proj.weight.weight_loader = self._load_in_proj
        self.conv1d = DepthwiseConv(self.inner, self.kernel, False)
        self.conv1d.weight.weight_loader = self._load_heads
        self.bcdt_proj = RowParallelLinear(inner, 2 * self.state_size + self.dt_dim, bias=False)
        self.dt_proj = ColumnParallelLinear(self.dt_dim, heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.empty(self.num_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        for p in (self.A_log, self.D, self.dt_bias):
            p.weight_loader = self._load_heads
        self.dt_norm_weight = nn.Parameter(torch.ones(self.dt_dim))
        self.B_norm_weight = nn.Parameter(torch.ones(self.state_size))
        self.C_norm_weight = nn.Parameter(torch.ones(self.state_size))
        self.out_proj = RowParallelLinear(inner, hidden, bias=False)

    def state_shapes(self, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        conv = (num_slots, self.inner, self.kernel - 1)
        return conv, (num_slots, self.num_heads, self.head_dim, self.state_size)

    def _load_in_proj(self, param, w: torch.Tensor, shard_id=None) -> None:
        # checkpoint rows per head: [z_h (P) | x_h (P)] -> ours: z of our heads | x of our heads
        d = w.shape[-1]
        per_head = w.reshape(self.full_heads, 2, self.head_dim, d)
        mine = per_head.narrow(0, self.tp_rank * self.num_heads, self.num_heads)
        copy_checked(param.data, mine.transpose(0, 1).reshape(-1, d), "in_proj")

    def _load_heads(self, param, w: torch.Tensor, shard_id=None) -> None:
        copy_checked(
            param.data, shard_segments(w, [w.shape[0]], self.tp_rank, self.tp_size), "mixer"
        )

    def forward(self, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:  # [T, D]
        assert self.conv_state is not None and self.ssm_state is not None, "allocate_state() first"
        t = x.shape[0]
        slots, has_state = md.state_rows()
        z, xs = self.in_proj(x).split([self.inner, self.inner], dim=-1)
        xs = self.run_conv(self.conv1d, xs, md, slots, has_state)  # [T, inner] after SiLU
        n = self.state_size
        b, c, dt = self.bcdt_proj(xs).split([n, n, self.dt_dim], dim=-1)
        b, c = _rms(b, self.B_norm_weight, self.eps), _rms(c, self.C_norm_weight, self.eps)
        dt = self.dt_proj(_rms(dt, self.dt_norm_weight, self.eps))  # [T, heads]
        dt = F.softplus(dt.float() + self.dt_bias.float())
        xs = xs.reshape(t, self.num_heads, self.head_dim)
        y = md.backend.ssd_scan(
            xs,
            dt,
            -torch.exp(self.A_log.float()),
            b.reshape(t, 1, n),
            c.reshape(t, 1, n),
            self.ssm_state,
            md.cu_seqlens_q,
            slots,
            has_state,
        )
        y = (y.float() + xs.float() * self.D.float()[:, None]).reshape(t, self.inner)
        return self.out_proj((y * F.silu(z.float())).to(x.dtype))


class Plamo2Attention(nn.Module):
    """Fused qkv, per-head q / k RMSNorm times per-head weights, RoPE, paged attention."""

    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = d = int(config.hidden_size_per_head)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, heads, kv_heads, bias=False)
        proj = self.qkv_proj
        self.q_size, self.kv_size = proj.num_heads * d, proj.num_kv_heads * d
        self.o_proj = RowParallelLinear(heads * d, config.hidden_size, bias=False)
        self.q_weight = nn.Parameter(torch.ones(proj.num_heads, d))
        self.k_weight = nn.Parameter(torch.ones(proj.num_kv_heads, d))
        self.q_weight.weight_loader = self._load_q_weight
        self.k_weight.weight_loader = self._load_k_weight
        self.rotary_emb = rope
        window = layer_sliding_window(config, layer_idx)
        self.attn = Attention(proj.num_heads, d, proj.num_kv_heads, d**-0.5, sliding_window=window)

    def _load_q_weight(self, param, w: torch.Tensor, shard_id=None) -> None:
        n = param.shape[0]
        copy_checked(param.data, w.narrow(0, self.qkv_proj.tp_rank * n, n), "q_weight")

    def _load_k_weight(self, param, w: torch.Tensor, shard_id=None) -> None:
        n, proj = param.shape[0], self.qkv_proj
        rank = proj.tp_rank // proj.kv_replicas  # kv heads replicated past their count
        copy_checked(param.data, w.narrow(0, rank * n, n), "k_weight")

    def forward(self, positions, x, kv_cache, md: AttentionMetadata) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = _rms(q.reshape(t, -1, d), self.q_weight, QK_NORM_EPS).reshape(t, -1)
        k = _rms(k.reshape(t, -1, d), self.k_weight, QK_NORM_EPS).reshape(t, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, md))


class Plamo2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.is_mamba = config.layer_types[layer_idx] in LINEAR_LAYER_TYPES
        self.mixer: nn.Module = (
            Plamo2Mixer(config) if self.is_mamba else Plamo2Attention(config, layer_idx, rope)
        )
        self.mlp = LlamaMLP(config, False)
        eps = float(config.rms_norm_eps)
        for name, offset in NORM_OFFSETS.items():
            setattr(self, name, RMSNorm(config.hidden_size, eps, weight_offset=offset))

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        h = self.pre_mixer_norm(x)
        h = self.mixer(h, md) if self.is_mamba else self.mixer(positions, h, kv_cache, md)
        x = x + self.post_mixer_norm(h)
        return x + self.post_mlp_norm(self.mlp(self.pre_mlp_norm(x)))


class Plamo2ForCausalLM(CausalLMBase):
    stacked_params = LlamaForCausalLM.stacked_params
    renames = (("model.layers.layers.", "model.layers."),)
    ignored_weights = ("rotary_emb.inv_freq",)
    tie_default = True

    def __init__(self, config) -> None:
        d = int(config.hidden_size_per_head)
        # tables as long as the engine's sequences (the config allows 10M positions)
        rows = min(int(config.max_position_embeddings), context_len_or(MIN_POSITIONS))
        rope = RotaryEmbedding(d, d, rows, ROPE_BASE)
        inner = HybridModel(
            config,
            lambda i: Plamo2DecoderLayer(config, i, rope),
            RMSNorm(config.hidden_size, float(config.rms_norm_eps), weight_offset=1.0),
            rope,
        )
        super().__init__(config, inner)

    # fused qkv_proj / gate_up_proj split into the pieces our layers shard (Phi-3's layout)
    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return Phi3ForCausalLM.convert_weight(self, name, w)  # type: ignore[arg-type]
