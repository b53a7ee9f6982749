"""DeepSeek-V4 (`DeepseekV4ForCausalLM`: V4-Flash, V4-Pro).

DeepSeek-V3's decoder (models/deepseek_v2.py) with every piece replaced, each as transformers
runs it:

    streams    the residual stream is hc_mult streams [T, N, D] (manifold-constrained
               hyper-connections, models/hyper_connections.py): each sublayer reads a weighted
               sum of them and the streams become post_j * out + sum_i comb_ij x_i, comb made
               doubly stochastic by Sinkhorn steps; `hc_head` collapses them before the norm
    attention  one key head that is also the value (K = V): kv = norm(wkv x); queries through a
               q_lora_rank bottleneck (wq_a, q_norm, wq_b), then RMS-normed per head without a
               weight; interleaved (GPT-J) rope on the last qk_rope_head_dim channels of q and
               kv, and the inverse rotation on the output's; a learned float32 sink logit per
               head; the output projection grouped: o_groups blocks of heads each to
               o_lora_rank (wo_a), then wo_b. Every layer sees its last sliding_window keys
    compressed `heavily_compressed_attention` layers also see one entry per complete window of
               m tokens (compress_rates): the float32 softmax over the window of
               wgate x + ape[position in window] weighs wkv x, normed, rotated at the window's
               first position; a query sees the windows it completes. The
               `compressed_sparse_attention` ones pool two series (channels [:d] of the previous
               window, [d:] of the current one) over 2m slots, and a Lightning indexer (its own
               compressor at index_head_dim, queries wq_b(q residual) rotated, head weights
               weights_proj x) keeps each query's index_topk best-scoring visible entries,
               score sum_h w_h n_h^-0.5 relu(q_h . k) c^-0.5
    ropes      sliding layers rope_theta (plain), the others compress_rope_theta with the
               config's scaling (YaRN with attention_factor 1)
    MoE        every layer: the router scores sqrtsoftplus / softmax / sigmoid of x W^T; `moe`
               layers choose the top-k of score + bias, `hash_moe` layers read the experts off
               tid2eid[token id]; the chosen scores are always renormalized, times
               routed_scaling_factor. Experts and the one shared expert of
               moe_intermediate_size clamp gate <= swiglu_limit and |up| <= swiglu_limit

The cache: a layer keeps, per token, one record of what its attention reads back: the rotated
kv, and the compressor's (and indexer's) wkv / wgate projections, split over the key and value
tensors of a one-head cache of ceil(width / 2) (`kv_cache_layout`). Each step the layer reads
its sequences' records back, recomputes the compressed entries and attends in float32 torch,
one sequence at a time (a reference, quadratic as transformers' is). Nothing lives outside the
paged cache, so prefix caching, chunked prefill, swapping and preemption need nothing more.
Under tensor parallelism the record, compressors and indexer are replicated and the heads
(and o_groups) split. The DSA indexer of models/deepseek_v32.py scores keys alike but over
every token; V4's scores compressed entries and is kept here.

Refused by name: pipeline parallelism (the streams), CUDA graphs and an fp8 KV cache (the
records are read back on the host's schedule, in the model dtype), hidden_act other than SiLU,
unknown scoring_func / layer_types / mlp_layer_types. Checkpoints: the names
transformers saves (the release's); the release's `mtp.*` layers are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.distributed.communication import tp_all_reduce
from paged_engine.distributed.parallel_state import get_parallel_state
from paged_engine.layers.activation import ClampedSiluAndMul
from paged_engine.layers.attention import Attention, AttentionMetadata
from paged_engine.layers.deepseek_moe import PartialRowLinear, num_routed_experts
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.fused_moe import ActExperts
from paged_engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from paged_engine.layers.rotary import RotaryEmbedding, context_len_or
from paged_engine.layers.torch_attention import TorchAttention, block_view, step_sequences
from paged_engine.models.hyper_connections import HyperConnection, HyperHead, fp32_param, unit_rms
from paged_engine.models.mixtral import check_silu, expert_rules
from paged_engine.models.olmo2 import Olmo2RMSNorm
from paged_engine.models.utils import CausalLMBase, cfg_get, make_layers

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
SCORE_FNS = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "softmax": lambda x: x.softmax(dim=-1),
    "sigmoid": torch.sigmoid,
}


def _layer_kinds(config) -> tuple[list[str], list[str]]:
    """(attention kind, MLP kind) of every layer, checked."""
    n = config.num_hidden_layers
    kinds = list(config.layer_types or [])
    mlps = list(config.mlp_layer_types or [])
    if len(kinds) != n or set(kinds) - {SLIDING, CSA, HCA}:
        raise ValueError(f"config.layer_types: unsupported {kinds}")
    if len(mlps) != n or set(mlps) - {"moe", "hash_moe"}:
        raise ValueError(f"config.mlp_layer_types: unsupported {mlps}")
    return kinds, mlps


def _record_widths(config, kind: str) -> list[int]:
    """The widths of a layer's per-token record: kv, then the compressor's wkv and wgate, then
    the indexer's."""
    d, c = int(config.head_dim), 2 if kind == CSA else 1
    widths = [d] if kind == SLIDING else [d, c * d, c * d]
    if kind == CSA:
        widths += [2 * int(config.index_head_dim)] * 2
    return widths


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] with its last 2 * cos.shape[-1] channels rotated in (even, odd) pairs, in
    float32 (cos, sin broadcast over x[..., :R / 2])."""
    r = 2 * cos.shape[-1]
    rot = x[..., -r:].float()
    x1, x2 = rot[..., 0::2], rot[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((x[..., :-r], out.to(x.dtype)), dim=-1)


def _rope(config, which: str) -> RotaryEmbedding:
    """The `main` or `compress` rope's tables over qk_rope_head_dim channels."""
    params = dict(config.rope_parameters[which])
    dim = int(int(config.head_dim) * float(params.get("partial_rotary_factor") or 1.0))
    kind = params.get("rope_type") or params.get("type") or "default"
    max_position = int(config.max_position_embeddings)
    return RotaryEmbedding(
        head_dim=dim,
        rotary_dim=dim,
        max_position=max_position,
        base=float(params["rope_theta"]),
        is_neox_style=False,
        rope_scaling=None if kind == "default" else params,
        num_positions=context_len_or(max_position),
    )


def _replicated(in_features: int, out_features: int) -> ColumnParallelLinear:
    return ColumnParallelLinear(in_features, out_features, bias=False, tp_rank=0, tp_size=1)


class Compressor(nn.Module):
    """A compressor's weights (`wkv`, `wgate`, `ape`, `norm`) and the pooling of its record
    columns into one entry a complete window (the module docstring)."""

    def __init__(self, config, dim: int, rate: int, overlap: bool) -> None:
        super().__init__()
        width = (2 if overlap else 1) * dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.wkv = _replicated(config.hidden_size, width)
        self.wgate = _replicated(config.hidden_size, width)
        self.ape = fp32_param(rate, width)
        self.norm = Olmo2RMSNorm(dim, float(config.rms_norm_eps))

    def entries(
        self, kv: torch.Tensor, gate: torch.Tensor, rope: RotaryEmbedding
    ) -> torch.Tensor:  # kv, gate [L, width] -> [L // rate, dim]
        r, d = self.rate, self.dim
        n = kv.shape[0] // r
        kv = kv[: n * r].reshape(n, r, kv.shape[1])
        gate = gate[: n * r].reshape(n, r, gate.shape[1]) + self.ape
        if self.overlap:  # slots [0, r): the previous window's [:d]; [r, 2r): this one's [d:]
            pooled_kv = kv.new_zeros(n, 2 * r, d)
            pooled_gate = gate.new_full((n, 2 * r, d), float("-inf"))
            pooled_kv[:, r:], pooled_gate[:, r:] = kv[..., d:], gate[..., d:]
            pooled_kv[1:, :r], pooled_gate[1:, :r] = kv[:-1, :, :d], gate[:-1, :, :d]
            kv, gate = pooled_kv, pooled_gate
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        out = self.norm((kv * weights).sum(dim=1))
        at = torch.arange(n, device=kv.device) * r
        return rope_tail(out, rope.cos[at], rope.sin[at])


class Indexer(nn.Module):
    """The Lightning indexer of a `compressed_sparse_attention` layer: its compressor, query
    projection `wq_b` and head weights `weights_proj` (replicated on every rank)."""

    def __init__(self, config, rate: int) -> None:
        super().__init__()
        self.heads, self.dim = int(config.index_n_heads), int(config.index_head_dim)
        self.topk = int(config.index_topk)
        self.compressor = Compressor(config, self.dim, rate, overlap=True)
        self.weights_proj = _replicated(config.hidden_size, self.heads)
        self.wq_b = _replicated(int(config.q_lora_rank), self.heads * self.dim)

    def choose(
        self, extra: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """Rows' [n, heads * (dim + 1)] rotated queries and head weights, the sequence's index
        keys [W, dim] and what each row sees [n, W] -> the entries it attends [n, W]."""
        n, h = extra.shape[0], self.heads
        q, w = extra.float().split([h * self.dim, h], dim=-1)
        scores = torch.einsum("nhc,wc->nhw", q.view(n, h, self.dim), keys.float())
        scores = scores.relu() * self.dim**-0.5
        scores = (scores * (w * h**-0.5).unsqueeze(-1)).sum(dim=1)  # [n, W]
        picked = scores.masked_fill(~visible, float("-inf"))
        picked = picked.topk(min(self.topk, keys.shape[0]), dim=-1).indices
        chosen = torch.zeros_like(visible).scatter_(1, picked, True)
        return chosen & visible


class CompressedAttention(TorchAttention, Attention):
    """The attention core of a V4 layer over its records in the paged cache (the module
    docstring): writes the step's records, then per sequence reads them back and attends over
    the window keys and the visible compressed entries with the sinks. Never traced: a
    compiled forward runs it as the opaque attention operator.

    q [T, H * D] rotated queries; k [T, width] the step's records; v [T, ...] the indexer's
    rows (`Indexer.choose`), unread without one."""

    def __init__(self, owner: V4Attention, heads: int, cache_dim: int) -> None:
        super().__init__(heads, cache_dim, 1, owner.head_dim**-0.5)
        self.__dict__["owner"] = owner  # not a submodule: its weights are the owner's

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
        kv_written: bool = False,
    ) -> torch.Tensor:
        md, (key_cache, value_cache), owner = attn_metadata, kv_cache, self.owner
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise ValueError(
                "DeepSeek-V4's attention cannot run in a CUDA graph (enforce_eager=True)"
            )
        t, c = q.shape[0], self.head_dim
        record = F.pad(k, (0, 2 * c - k.shape[1])).view(t, 2, 1, c)
        md.backend.write_kv(record[:, 0], record[:, 1], key_cache, value_cache, md.slot_mapping)
        keys, values = block_view(key_cache, md.backend), block_view(value_cache, md.backend)
        q = q.view(t, self.num_heads, owner.head_dim)
        out = torch.zeros_like(q)
        for _, first, end, length, blocks in step_sequences(md, keys.shape[1]):
            seq = torch.cat(
                (keys[blocks].flatten(0, 1)[:length, 0], values[blocks].flatten(0, 1)[:length, 0]),
                dim=-1,
            )[:, : k.shape[1]]
            out[first:end] = owner.attend(q[first:end], seq, v[first:end])
        return out.view(t, -1)


class V4Attention(nn.Module):
    """One layer's attention (checkpoint names `attn.*`): projections, ropes, compressor and
    indexer, the grouped output projection; `attend` is the per-sequence core."""

    def __init__(self, config, kind: str, ropes: dict[str, RotaryEmbedding]) -> None:
        super().__init__()
        state = get_parallel_state()
        hidden, heads = config.hidden_size, config.num_attention_heads
        groups, tp = int(config.o_groups), state.tp_size
        if heads % tp or groups % tp or heads % groups:
            raise ValueError(
                f"num_attention_heads={heads} and o_groups={groups} must divide evenly over "
                f"tensor_parallel_size={tp} (and o_groups divide the heads)"
            )
        self.kind, self.heads = kind, heads // tp
        self.head_dim, self.window = int(config.head_dim), int(config.sliding_window)
        self.eps, rank = float(config.rms_norm_eps), int(config.q_lora_rank)
        self.groups, self.o_rank = groups // tp, int(config.o_lora_rank)
        self.main_rope = ropes["main" if kind == SLIDING else "compress"]
        self.compress_rope = ropes["compress"]
        self.wq_a = _replicated(hidden, rank)
        self.q_norm = Olmo2RMSNorm(rank, self.eps)
        self.wq_b = ColumnParallelLinear(rank, heads * self.head_dim, bias=False)
        self.wkv = _replicated(hidden, self.head_dim)
        self.norm = Olmo2RMSNorm(self.head_dim, self.eps)
        group_width = heads * self.head_dim // groups
        self.wo_a = ColumnParallelLinear(group_width, groups * self.o_rank, bias=False)
        self.wo_b = RowParallelLinear(groups * self.o_rank, hidden, bias=False)
        self.attn_sink = fp32_param(self.heads)
        self.attn_sink.weight_loader = self._load_sinks
        self.tp_rank = state.tp_rank
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if kind != SLIDING:
            self.rate = int(config.compress_rates[kind])
            self.compressor = Compressor(config, self.head_dim, self.rate, overlap=kind == CSA)
        if kind == CSA:
            self.indexer = Indexer(config, self.rate)
        self.widths = _record_widths(config, kind)
        self.attn = CompressedAttention(self, self.heads, -(-sum(self.widths) // 2))

    def _load_sinks(self, param: nn.Parameter, w: torch.Tensor) -> None:
        n = param.shape[0]
        if w.shape[0] < (self.tp_rank + 1) * n:
            raise ValueError(f"attn_sink: {tuple(w.shape)} holds fewer than {n} heads a rank")
        param.data.copy_(w[self.tp_rank * n : (self.tp_rank + 1) * n])

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        t, d = x.shape[0], self.head_dim
        rope = self.main_rope
        cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
        q_res = self.q_norm(self.wq_a(x))
        q = unit_rms(self.wq_b(q_res).view(t, self.heads, d), self.eps)
        q = rope_tail(q, cos, sin)
        kv = rope_tail(self.norm(self.wkv(x)), cos[:, 0], sin[:, 0])
        record = [kv]
        if self.compressor is not None:
            record += [self.compressor.wkv(x), self.compressor.wgate(x)]
        extra = q_res
        if self.indexer is not None:
            idx = self.indexer
            record += [idx.compressor.wkv(x), idx.compressor.wgate(x)]
            cr = self.compress_rope
            ccos, csin = cr.cos[positions].unsqueeze(1), cr.sin[positions].unsqueeze(1)
            iq = rope_tail(idx.wq_b(q_res).view(t, idx.heads, idx.dim), ccos, csin)
            extra = torch.cat((iq.flatten(1), idx.weights_proj(x)), dim=-1)
        out = self.attn(q.flatten(1), torch.cat(record, dim=-1), extra, kv_cache, md)
        out = rope_tail(out.view(t, self.heads, d), cos, -sin)  # undo the values' rotation
        grouped = out.view(t, self.groups, -1).transpose(0, 1)  # [G, T, H*D / G]
        w = self.wo_a.weight.view(self.groups, self.o_rank, -1)
        y = torch.bmm(grouped, w.transpose(1, 2)).transpose(0, 1).reshape(t, -1)
        return self.wo_b(y)

    def attend(self, q: torch.Tensor, seq: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        """One sequence's last n rows: queries q [n, H, D] over its records seq [L, width]
        -> [n, H, D]."""
        n, length = q.shape[0], seq.shape[0]
        parts = seq.split(self.widths, dim=-1)
        pos = torch.arange(length - n, length, device=q.device)
        lo = max(0, length - n - self.window + 1)
        key_pos = torch.arange(lo, length, device=q.device)
        keys = parts[0][lo:]
        keep = (key_pos <= pos[:, None]) & (key_pos > pos[:, None] - self.window)
        if self.compressor is not None:
            entries = self.compressor.entries(parts[1], parts[2], self.compress_rope)
            windows = torch.arange(entries.shape[0], device=q.device)
            visible = windows < ((pos + 1) // self.rate)[:, None]
            if self.indexer is not None and entries.shape[0]:
                index_keys = self.indexer.compressor.entries(parts[3], parts[4], self.compress_rope)
                visible = self.indexer.choose(extra, index_keys, visible)
            keys = torch.cat((keys, entries), dim=0)
            keep = torch.cat((keep, visible), dim=-1)
        scores = torch.einsum("nhd,kd->nhk", q.float(), keys.float()) * self.attn.scale
        scores = scores.masked_fill(~keep[:, None], float("-inf"))
        sink = self.attn_sink.float().view(1, -1, 1).expand(n, -1, 1)
        probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("nhk,kd->nhd", probs, keys.float()).to(q.dtype)


class SharedExpert(nn.Module):
    """`shared_experts` (w1 | w3 stacked as gate_up_proj, w2 as down_proj) with the clamp;
    [T, H] -> this rank's partial sum."""

    def __init__(self, hidden: int, inter: int, limit: float, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias)
        self.down_proj = PartialRowLinear(inter, hidden, bias)
        self.act = ClampedSiluAndMul(limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Router(nn.Module):
    """`ffn.gate`: weight [E, H], and `bias` (top-k layers) or `tid2eid` [V, k] (hash layers).
    (x [T, H], token ids [T]) -> (weights [T, k] float32, expert ids [T, k])."""

    def __init__(self, config, hashed: bool) -> None:
        super().__init__()
        experts, self.top_k = num_routed_experts(config), int(config.num_experts_per_tok)
        scoring = str(config.scoring_func)
        if scoring not in SCORE_FNS:
            raise ValueError(f"scoring_func={scoring!r}; supported: {list(SCORE_FNS)}")
        self.score, self.hashed = SCORE_FNS[scoring], hashed
        self.scale = float(config.routed_scaling_factor)
        self.weight = fp32_param(experts, config.hidden_size)
        if hashed:
            table = torch.zeros(config.vocab_size, self.top_k, dtype=torch.int64)
            self.tid2eid = nn.Parameter(table, requires_grad=False)
        else:
            self.bias = fp32_param(experts)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.score(F.linear(x.float(), self.weight.float()))
        if self.hashed:
            chosen = self.tid2eid[ids]
        else:
            chosen = (scores + self.bias).topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, chosen


class V4Moe(nn.Module):
    """`ffn`: router, routed experts, the shared expert; one all-reduce."""

    def __init__(self, config, hashed: bool) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, int(config.moe_intermediate_size)
        limit = float(config.swiglu_limit)
        self.gate = Router(config, hashed)
        experts = num_routed_experts(config)
        self.experts = ActExperts(ClampedSiluAndMul(limit), experts, hidden, inter)
        # mlp_bias: the shared expert's three projections alone (as transformers')
        bias = bool(cfg_get(config, "mlp_bias", False))
        self.shared_experts = SharedExpert(hidden, inter, limit, bias)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.gate(x, ids)
        out = self.experts(x, weights, chosen) + self.shared_experts(x)
        return tp_all_reduce(out) if self.experts.tp_size > 1 else out


class DeepseekV4DecoderLayer(nn.Module):
    """`attn_norm` -> attention and `ffn_norm` -> MoE, each between hyper-connections."""

    def __init__(self, config, kind: str, mlp: str, ropes: dict[str, RotaryEmbedding]) -> None:
        super().__init__()
        eps = float(config.rms_norm_eps)
        self.attn = V4Attention(config, kind, ropes)
        self.ffn = V4Moe(config, hashed=mlp == "hash_moe")
        self.attn_norm = Olmo2RMSNorm(config.hidden_size, eps)
        self.ffn_norm = Olmo2RMSNorm(config.hidden_size, eps)
        self.hc_attn = HyperConnection(config)
        self.hc_ffn = HyperConnection(config)

    def forward(self, positions, streams, kv_cache, md, input_ids) -> torch.Tensor:
        dtype = streams.dtype  # streams: [T, N, D]
        post, comb, x = self.hc_attn(streams)
        out = self.attn(positions, self.attn_norm(x), kv_cache, md)
        streams = post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )
        post, comb, x = self.hc_ffn(streams)
        out = self.ffn(self.ffn_norm(x), input_ids)
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )


class DeepseekV4Model(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        if get_parallel_state().pp_size > 1:
            raise ValueError(
                "DeepSeek-V4 does not support pipeline parallelism (its hyper-connection "
                "streams stay on one stage)"
            )
        kinds, mlps = _layer_kinds(config)
        self.ropes = nn.ModuleDict({k: _rope(config, k) for k in ("main", "compress")})
        ropes = dict(self.ropes.items())
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers, self.stage = make_layers(
            config.num_hidden_layers,
            lambda i: DeepseekV4DecoderLayer(config, kinds[i], mlps[i], ropes),
        )
        self.hc_head = HyperHead(config)
        self.norm = Olmo2RMSNorm(config.hidden_size, float(config.rms_norm_eps))
        self.streams = int(config.hc_mult)

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if hidden is None else hidden  # [T, D]
        streams = x.unsqueeze(1).expand(-1, self.streams, -1).contiguous()
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            streams = layer(positions, streams, kv_cache, md, input_ids)
        return self.norm(self.hc_head(streams))


class DeepseekV4ForCausalLM(CausalLMBase):
    head_name = "head"
    fp8_kv_cache = False
    fp8_kv_refusal = "its cache rows hold the compressor's inputs, not keys and values"
    renames = (
        (".hc_attn_", ".hc_attn."),
        (".hc_ffn_", ".hc_ffn."),
        (".shared_experts.w2.", ".shared_experts.down_proj."),
    )
    ignored_weights = ("inv_freq",)

    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        super().__init__(config, DeepseekV4Model(config))
        rules = expert_rules(num_routed_experts(config), "w1", "w3", "w2")
        shared = (
            (".shared_experts.gate_up_proj.", ".shared_experts.w1.", 0),
            (".shared_experts.gate_up_proj.", ".shared_experts.w3.", 1),
        )
        self.stacked_params = (*rules, *shared)

    @classmethod
    def kv_cache_layout(cls, config) -> list[tuple[int, int]]:
        """One head a layer, of half its record's width (rounded up)."""
        kinds, _ = _layer_kinds(config)
        return [(1, -(-sum(_record_widths(config, kind)) // 2)) for kind in kinds]

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        kept = ((n, w) for n, w in weights if not n.startswith("mtp."))  # the release's MTP
        return super().load_weights(kept, strict)
