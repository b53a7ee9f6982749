"""Thinking Machines' Inkling (`InklingForCausalLM`, model_type "inkling_text"), served as
transformers runs it: a hybrid stack whose every layer is attention beside four short causal
convolutions, without rotary embeddings (positions enter through a learned relative bias).

    embedding  the token row, then an RMSNorm (`embed_tokens.embed_norm`)
    layer      x += attn_sconv(attn(input_layernorm(x)));
               x += mlp_sconv(mlp(post_attention_layernorm(x)))
    sconv      y = x + conv(x): a depthwise causal conv of `conv_kernel_size` taps, no bias, run
               in float32 (HF keeps these weights float32); each carries its last K - 1 inputs
               per sequence as recurrent state (`k_sconv`, `v_sconv` on the key / value
               projections, `attn_sconv` / `mlp_sconv` on the sublayers' outputs)
    attention  "hybrid" (full) layers: num_attention_heads / num_key_value_heads / head_dim;
               "hybrid_sliding" ones: the swa_* counts and sizes and a window of
               `sliding_window_size` keys. q = q_norm(q_proj x), k = k_norm(k_sconv(k_proj x)),
               v = v_sconv(v_proj x), scale 1 / head_dim (q and k are RMS-normalized). Each
               score gains a bias rel[t, h, d] = (r_proj x)[t, h] @ proj[:, d] at backward
               distance d = pos_q - pos_k for 0 <= d < extent (`rel_extent` on full layers, the
               window on sliding ones), zero beyond. With `log_scaling_n_floor` set, full layers
               scale q and the bias by tau = 1 + log_scaling_alpha * log(max((pos + 1) / floor, 1))
    mlp        `mlp_layer_types` "dense": a gated SiLU MLP of intermediate_size times a learned
               `global_scale`; "sparse": routed experts (moe_intermediate_size) plus
               n_shared_experts shared ones. The router (float32) scores all n_routed +
               n_shared experts with one matrix: the top num_experts_per_tok of
               sigmoid(routed logits) + e_score_correction_bias are chosen; the chosen routed
               and all shared logits get weights sigmoid(l) / sum of those sigmoids (the
               shared experts act as a sink), times route_scale and the router's global_scale;
               the shared experts' outputs are weighted by theirs
    head       the final norm, hidden / logits_mup_width_multiplier, an untied lm_head; logits
               past `unpadded_vocab_size` are -inf (HF drops them)

The paged backends have no relative-bias attention, so this module attends in torch over the
paged cache (any backend's layout, read through its `kv_cache_shape`; the backend still writes
K / V and runs the convolutions): each step's queries are padded per sequence to [S, max_q]
against [S, max_seqlen_k] keys gathered from the block table, without a host sync (a CUDA
graph's metadata gives max_model_len keys). That costs S * H * max_q * max_seqlen_k scores a
layer: a reference path, exact rather than fast. An fp8 cache is written and read with a scale
of 1 (there is no `Attention` layer for worker/kv_scales.py to calibrate).

Every layer holds a KV cache and conv state (models/hybrid.py counts "hybrid" as such a
type), so the engine runs it as a hybrid model: no pipeline parallelism, swap, CPU offload or
batch-invariant mode (worker/recurrent_state.py refuses them by name); prefix caching resumes
from state snapshots. Refused here by name: a `layer_types` without a "hybrid" (full) layer
(the engine would then make no state pools), other `mlp_layer_types`, hidden_act other than
SiLU, and head counts or intermediate sizes that tensor parallelism does not split. The
multi-token-prediction layers (`model.mtp.*`) are not loaded, as in HF; `shared_expert_sink`
is not read (HF's router always scores the shared experts with the routed ones). The release's
names (`model.llm.*`, as transformers saves `InklingForConditionalGeneration`) map to ours by
models/inkling_names.py.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.attention.backend import AttentionMetadata
from paged_engine.distributed.communication import tp_all_reduce
from paged_engine.distributed.parallel_state import get_tp_rank, get_tp_size
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.fused_moe import FusedMoE
from paged_engine.layers.linear import ColumnParallelLinear, RowParallelLinear, copy_checked
from paged_engine.layers.linear_mixer import DepthwiseConv, LinearMixer, check_mixer
from paged_engine.layers.norm import RMSNorm
from paged_engine.models.hybrid import HybridModel
from paged_engine.models.inkling_names import inkling_weights
from paged_engine.models.lfm2 import Lfm2MLP
from paged_engine.models.utils import CausalLMBase, StackedRule, cfg_get

SLIDING, FULL = "hybrid_sliding", "hybrid"

_MLP_RULES: tuple[StackedRule, ...] = (
    (".mlp.gate_up_proj.", ".mlp.gate_proj.", 0),
    (".mlp.gate_up_proj.", ".mlp.up_proj.", 1),
)


def _shard(w: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    n = w.shape[dim] // tp
    return w.narrow(dim, rank * n, n)


class InklingShortConv(LinearMixer):
    """y = x + causal_depthwise_conv(x) in float32 over C channels (this rank's: the loader
    takes rows [rank * C, (rank + 1) * C) of a channel-split conv), state [slots, C, K - 1]
    float32. [T, C] -> [T, C] in x's dtype."""

    def __init__(self, channels: int, kernel: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.channels, self.kernel = channels, kernel
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.conv1d = DepthwiseConv(channels, kernel, bias=False)
        self.conv1d.weight.data = self.conv1d.weight.data.float()
        self.conv1d.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, w: torch.Tensor) -> None:
        copy_checked(param.data, _shard(w, 0, self.tp_rank, self.tp_size), "sconv")

    def state_shapes(self, num_slots: int) -> tuple[tuple[int, ...]]:
        return ((num_slots, self.channels, self.kernel - 1),)

    def allocate_state(self, num_slots, dtype, ssm_dtype, device) -> None:
        # float32 whatever the model dtype, as HF's conv runs
        super().allocate_state(num_slots, torch.float32, ssm_dtype, device)

    def forward(self, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        assert self.conv_state is not None, "allocate_state() first"
        slots, has_state = md.state_rows()
        h = x.float()
        w = self.conv1d.weight.float().squeeze(1)
        y = md.backend.causal_conv1d(
            h, w, None, self.conv_state, md.cu_seqlens_q, slots, has_state, activation=None
        )
        return (h + y).to(x.dtype)


def canonical_cache(cache: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
    """A layer's key or value cache as a [num_blocks, block_size, Hkv, D] view, whatever
    order the backend lays its axes out in (`kv_cache_shape` of distinct sizes tells)."""
    probe = (2, 3, 5, 7)
    shape = tuple(md.backend.kv_cache_shape(*probe))
    return cache.permute([shape.index(n) for n in probe])


def relative_attention(
    q: torch.Tensor,  # [T, H, D], scaled by tau where log scaling applies
    rel: torch.Tensor,  # [T, H, R]: bias at backward distance 0..R-1
    positions: torch.Tensor,  # [T]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None = None,  # [T, H]: a per-token logit with no value (Inkling 2)
) -> torch.Tensor:  # [T, H, D]
    """softmax(q.k * scale + bias) v over each token's context in the paged cache; keys at
    distance d see bias rel[d] for d < R and none beyond; a window W keeps d < W. A sink
    logit joins each softmax and takes its share of the mass to no value."""
    t, h, d = q.shape
    kc, vc = canonical_cache(key_cache, md), canonical_cache(value_cache, md)
    block_size, hkv = kc.shape[1], kc.shape[2]
    s, qm, lk, r = md.seq_lens.shape[0], md.max_seqlen_q, md.max_seqlen_k, rel.shape[-1]
    dev = q.device
    # queries padded per sequence: token index [S, Qm] (clamped; rows past a sequence unused)
    starts = md.cu_seqlens_q[:-1].long()
    idx = (starts[:, None] + torch.arange(qm, device=dev)).clamp(max=t - 1)
    qp, rp, pos = q[idx], rel[idx], positions[idx].long()  # [S, Qm, H, D], [S, Qm, H, R]
    # keys 0..Lk-1 of each sequence through its block table: [S, Lk, Hkv, D]
    j = torch.arange(lk, device=dev)
    table = md.block_tables.long()
    blocks = table[:, (j // block_size).clamp(max=table.shape[1] - 1)]
    k = kc[blocks, j % block_size].to(q.dtype)
    v = vc[blocks, j % block_size].to(q.dtype)
    g = h // hkv
    scores = torch.einsum("sqkgd,slkd->skgql", qp.view(s, qm, hkv, g, d), k) * scale
    scores = scores.reshape(s, h, qm, lk)
    dist = pos[:, None, :, None] - j  # [S, 1, Qm, Lk]
    bias = rp.permute(0, 2, 1, 3).gather(-1, dist.clamp(0, r - 1).expand(s, h, qm, lk))
    scores = scores + bias.masked_fill((dist < 0) | (dist >= r), 0.0)
    hidden = dist < 0 if window is None else (dist < 0) | (dist >= window)
    scores = scores.float().masked_fill(hidden, float("-inf"))
    if sinks is not None:  # [S, H, Qm, 1] beside the keys, dropped after the softmax
        sink = sinks[idx].permute(0, 2, 1)[..., None].float()
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("skgql,slkd->sqkgd", probs.to(v.dtype).view(s, hkv, g, qm, lk), v)
    # back to tokens: token i of sequence n is row (n, i - start_n)
    seq = torch.searchsorted(md.cu_seqlens_q[1:].long(), torch.arange(t, device=dev), right=True)
    seq = seq.clamp(max=s - 1)
    row = (torch.arange(t, device=dev) - starts[seq]).clamp(0, qm - 1)
    return out.reshape(s, qm, h, d)[seq, row]


class InklingAttention(nn.Module):
    """The module docstring's attention on this rank's heads (q / k / v / r column-parallel by
    head, o_proj row-parallel). [T, D] -> [T, D]."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        sliding = config.layer_types[layer_idx] == SLIDING
        pre = "swa_" if sliding else ""
        heads = int(getattr(config, f"{pre}num_attention_heads"))
        kv_heads = int(getattr(config, f"{pre}num_key_value_heads"))
        self.head_dim = d = int(getattr(config, f"{pre}head_dim"))
        check_mixer(
            "Inkling attention",
            None,
            tp,
            **{f"{pre}num_attention_heads": heads, f"{pre}num_key_value_heads": kv_heads},
        )
        self.num_heads, self.num_kv_heads = heads // tp, kv_heads // tp
        self.d_rel = int(config.d_rel)
        self.window = int(config.sliding_window_size) if sliding else None
        extent = int(config.sliding_window_size) if sliding else int(config.rel_extent)
        floor = getattr(config, "log_scaling_n_floor", None)
        self.log_floor = None if sliding or floor is None else float(floor)
        self.log_alpha = float(cfg_get(config, "log_scaling_alpha", 0.1))
        self.scale = 1.0 / d
        hidden, eps = config.hidden_size, float(config.rms_norm_eps)
        kernel = int(config.conv_kernel_size)
        self.q_proj = ColumnParallelLinear(hidden, heads * d, bias=False)
        self.k_proj = ColumnParallelLinear(hidden, kv_heads * d, bias=False)
        self.v_proj = ColumnParallelLinear(hidden, kv_heads * d, bias=False)
        self.r_proj = ColumnParallelLinear(hidden, heads * self.d_rel, bias=False)
        self.o_proj = RowParallelLinear(heads * d, hidden, bias=False)
        self.k_sconv = InklingShortConv(self.num_kv_heads * d, kernel, rank, tp)
        self.v_sconv = InklingShortConv(self.num_kv_heads * d, kernel, rank, tp)
        self.q_norm, self.k_norm = RMSNorm(d, eps), RMSNorm(d, eps)
        self.rel_logits_proj = nn.Module()
        self.rel_logits_proj.proj = nn.Parameter(torch.empty(self.d_rel, extent))

    def forward(self, positions, x, kv_cache, md: AttentionMetadata) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q = self.q_norm(self.q_proj(x).view(t, self.num_heads, d))
        k = self.k_norm(self.k_sconv(self.k_proj(x), md).view(t, self.num_kv_heads, d))
        v = self.v_sconv(self.v_proj(x), md).view(t, self.num_kv_heads, d)
        rel = self.r_proj(x).view(t, self.num_heads, self.d_rel) @ self.rel_logits_proj.proj
        if self.log_floor is not None:  # in float32, as HF
            n = (positions.float() + 1) / self.log_floor
            tau = (1.0 + self.log_alpha * torch.log(n.clamp(min=1.0)))[:, None, None]
            q, rel = (q.float() * tau).to(q.dtype), (rel.float() * tau).to(rel.dtype)
        key_cache, value_cache = kv_cache
        md.backend.write_kv(k, v, key_cache, value_cache, md.slot_mapping, k_scale=1.0, v_scale=1.0)
        out = relative_attention(
            q, rel, positions, key_cache, value_cache, md, self.scale, self.window
        )
        return self.o_proj(out.reshape(t, -1))


class InklingMLP(Lfm2MLP):
    """The gated SiLU MLP times a learned scalar `global_scale` (after the all-reduce)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(hidden_size, intermediate_size)
        self.global_scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.global_scale


class InklingRouter(nn.Module):
    """HF's `mlp.gate` (module docstring's routing), float32 and replicated: x [T, H] ->
    (routed weights [T, k], routed ids [T, k], shared weights [T, n_shared]), float32."""

    def __init__(self, config) -> None:
        super().__init__()
        self.num_routed = int(config.n_routed_experts)
        self.num_shared = int(config.n_shared_experts)
        self.top_k, self.route_scale = int(config.num_experts_per_tok), float(config.route_scale)
        total, f32 = self.num_routed + self.num_shared, torch.float32
        self.weight = nn.Parameter(torch.empty(total, config.hidden_size, dtype=f32))
        self.global_scale = nn.Parameter(torch.ones(1, dtype=f32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_routed, dtype=f32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())  # [T, E + S]
        routed, shared = logits.split([self.num_routed, self.num_shared], dim=-1)
        choice = routed.sigmoid() + self.e_score_correction_bias.float()
        ids = torch.topk(choice, self.top_k, dim=-1)[1]
        chosen = F.logsigmoid(torch.cat([routed.gather(-1, ids), shared], dim=-1))
        weights = torch.softmax(chosen, dim=-1) * (self.route_scale * self.global_scale.float())
        return weights[:, : self.top_k], ids, weights[:, self.top_k :]


class InklingSharedExperts(nn.Module):
    """n_shared gated SiLU experts under HF's stacked names (`gate_proj` / `up_proj` [S, I, H],
    `down_proj` [S, H, I]; this rank's I / tp), each weighted per token: x [T, H], gammas
    [T, S] -> this rank's partial sum [T, H] (not all-reduced)."""

    def __init__(self, num: int, hidden: int, intermediate: int, rank: int, tp: int) -> None:
        super().__init__()
        i = intermediate // tp
        self.rank, self.tp = rank, tp
        self.gate_proj = nn.Parameter(torch.empty(num, i, hidden))
        self.up_proj = nn.Parameter(torch.empty(num, i, hidden))
        self.down_proj = nn.Parameter(torch.empty(num, hidden, i))
        for p, dim in ((self.gate_proj, 1), (self.up_proj, 1), (self.down_proj, 2)):
            p.weight_loader = lambda param, w, dim=dim: copy_checked(
                param.data, _shard(w, dim, self.rank, self.tp), "shared experts"
            )

    def forward(self, x: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
        gate = torch.einsum("th,sih->sti", x, self.gate_proj)
        up = torch.einsum("th,sih->sti", x, self.up_proj)
        act = F.silu(gate) * up * gammas.to(x.dtype).t()[:, :, None]
        return torch.einsum("sti,shi->sth", act, self.down_proj).float().sum(0).to(x.dtype)


class InklingMoE(nn.Module):
    """Router, FusedMoE routed experts (split by I), shared experts, one all-reduce."""

    def __init__(self, config) -> None:
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        hidden, inter = config.hidden_size, int(config.moe_intermediate_size)
        check_mixer("Inkling MoE", None, tp, moe_intermediate_size=inter)
        self.gate = InklingRouter(config)
        self.experts = FusedMoE(int(config.n_routed_experts), hidden, inter)
        self.shared_experts = InklingSharedExperts(
            int(config.n_shared_experts), hidden, inter, rank, tp
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids, gammas = self.gate(x)
        out = self.experts(x, weights, ids) + self.shared_experts(x, gammas)
        return tp_all_reduce(out) if self.experts.tp_size > 1 else out


class InklingDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, float(config.rms_norm_eps)
        kernel = int(config.conv_kernel_size)
        self.self_attn = InklingAttention(config, layer_idx)
        if config.mlp_layer_types[layer_idx] == "sparse":
            self.mlp: nn.Module = InklingMoE(config)
        else:
            inter = int(config.intermediate_size)
            check_mixer("Inkling MLP", None, get_tp_size(), intermediate_size=inter)
            self.mlp = InklingMLP(hidden, inter)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        # replicated: they see the whole (all-reduced) hidden state
        self.attn_sconv = InklingShortConv(hidden, kernel)
        self.mlp_sconv = InklingShortConv(hidden, kernel)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        h = self.self_attn(positions, self.input_layernorm(x), kv_cache, md)
        x = x + self.attn_sconv(h, md)
        h = self.mlp(self.post_attention_layernorm(x))
        return x + self.mlp_sconv(h, md)


class InklingEmbedding(VocabParallelEmbedding):
    """The token row, RMS-normalized (`embed_norm`)."""

    def __init__(self, vocab_size: int, hidden_size: int, eps: float) -> None:
        super().__init__(vocab_size, hidden_size)
        self.embed_norm = RMSNorm(hidden_size, eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(super().forward(input_ids))


class InklingForCausalLM(CausalLMBase):
    stacked_params = _MLP_RULES
    ties_head = False  # HF keeps lm_head apart whatever tie_word_embeddings says

    def __init__(self, config) -> None:
        types = list(config.layer_types)
        if any(t not in (SLIDING, FULL) for t in types) or FULL not in types:
            raise ValueError(
                f"Inkling layer_types must be {SLIDING!r} / {FULL!r} with at least one "
                f"{FULL!r} layer, got {types!r}"
            )
        mlp_types = list(config.mlp_layer_types)
        if any(t not in ("dense", "sparse") for t in mlp_types):
            raise ValueError(f"Inkling mlp_layer_types must be 'dense' / 'sparse': {mlp_types!r}")
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"Inkling supports hidden_act 'silu' only, got {config.hidden_act!r}")
        eps = float(config.rms_norm_eps)
        inner = HybridModel(
            config,
            lambda i: InklingDecoderLayer(config, i),
            RMSNorm(config.hidden_size, eps),
            None,
        )
        inner.embed_tokens = InklingEmbedding(config.vocab_size, config.hidden_size, eps)
        super().__init__(config, inner)
        self.mup_width = float(config.logits_mup_width_multiplier)
        unpadded = getattr(config, "unpadded_vocab_size", None)
        self.unpadded_vocab = None if unpadded is None else int(unpadded)

    @staticmethod
    def kv_cache_layout(config) -> list[tuple[int, int]]:
        """(num_kv_heads, head_dim) of each layer: the swa_* geometry on sliding layers."""
        full = (int(config.num_key_value_heads), int(config.head_dim))
        swa = (int(config.swa_num_key_value_heads), int(config.swa_head_dim))
        return [swa if t == SLIDING else full for t in config.layer_types]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        logits = super().compute_logits(hidden / self.mup_width)
        if self.unpadded_vocab is not None and self.unpadded_vocab < logits.shape[-1]:
            logits[:, self.unpadded_vocab :] = float("-inf")
        return logits

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        # the release's names (`model.llm.*`, what transformers saves for the Inkling wrapper)
        pairs = inkling_weights(name, w) if name.startswith("model.llm.") else [(name, w)]
        # multi-token prediction: unused, as in HF
        return [(n, t) for n, t in pairs if not n.startswith("model.mtp.")]


__all__ = ["InklingForCausalLM"]
