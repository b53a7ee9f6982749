"""GLM-5.3-Flash's language model (`Glm5NextForConditionalGeneration` served text-only: our
`Glm5NextTextForCausalLM`, HF's `Glm5NextTextModel` plus `lm_head`), model_type
"glm5_next_text".

Kimi Linear's hybrid (models/kimi_linear.py: KDA layers among NoPE MLA layers, DeepSeek-V3's
MoE after dense layers) with these differences, each as transformers runs it:

    streams    DeepSeek-V4's manifold-constrained hyper-connections
               (models/hyper_connections.py; `attn_hc` / `ffn_hc` per layer) carry hc_mult
               residual streams [T, N, D], the embedding copied into each; the final collapse
               is their plain mean (no `hc_head` weights), then the norm
    linear     `linear_attention` layers: KDA whose forget gate is bounded below by
               `linear_lower_bound` (layers/glm5_next_attention.py)
    MLA        `indexed_attention` layers: MLA with qk_rope_head_dim 0 (HF refuses any other),
               its latent norms at rms_norm_eps (not DeepSeek's fixed 1e-6), softmax scale
               qk_nope_head_dim^-0.5; a DSA indexer (kpool-compressed keys, `indexer_types`
               full / shared) keeps index_topk tokens a query
    SwiGLU     the dense MLPs, the shared expert and the routed experts clamp the gate to
               <= swiglu_limit and the up projection to [-swiglu_limit, swiglu_limit]

The indexer (`indexed_attention` layers whose `indexer_types` entry is "full"; a "shared" one
reuses the last full layer's choice), as transformers runs it: keys k_norm(wk(x)) and gate
scores x @ index_kpool_compress_gate^T [index_head_dim] a token; the tokens fall into pools of
index_kpool from position 0, and a complete pool's key is the per-channel softmax (over its
tokens) of gate + index_kpool_compress_ape weighting its tokens' keys; a query scores the pools
it sees whole as DeepSeek-V3.2's indexer scores keys (sum_h w_h relu(q_h . key) Di^-0.5, no
rope) and keeps its index_topk / index_kpool best pools plus the tokens after its last whole
pool (index_kpool_always_select_tail), so a query that sees at most index_topk tokens keeps
them all. A full layer's cache row is [c | indexer key | gate scores] (`kv_cache_layout`), so
the paged blocks hold everything the choice reads; the choice and the attention run in float32
torch per sequence (models/deepseek_v32.py's reference path; no kernel pools keys yet).

The clamped routed experts run grouped in torch (`ActExperts`), eagerly: CUDA graphs are
refused when captured (enforce_eager=True). Refused by name: index_topk not a multiple of
index_kpool, index_kpool_always_select_tail=False (a sequence's first tokens would see no key),
an indexed layer "shared" before any full one, qk_rope_head_dim > 0, pipeline
parallelism (the streams), a hidden_act other than SiLU. The checkpoint's MTP layer (index
num_hidden_layers) is skipped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.distributed.parallel_state import get_parallel_state
from paged_engine.layers.activation import ClampedSiluAndMul
from paged_engine.layers.attention import AttentionMetadata
from paged_engine.layers.deepseek_moe import DeepseekMoe, num_routed_experts
from paged_engine.layers.fused_moe import ActExperts
from paged_engine.layers.glm5_next_attention import Glm5NextDeltaAttention
from paged_engine.layers.kda import KDA_CONV_RULES
from paged_engine.layers.linear import ColumnParallelLinear
from paged_engine.layers.norm import LayerNorm, RMSNorm
from paged_engine.layers.torch_attention import top_k_mask
from paged_engine.models.deepseek_v32 import Choices, DsaAttention, SparseLatentAttention
from paged_engine.models.hybrid import LINEAR_LAYER_TYPES, HybridModel, layer_types
from paged_engine.models.hyper_connections import HyperConnection
from paged_engine.models.kimi_linear import NoRope
from paged_engine.models.llama import LlamaMLP, stage_input
from paged_engine.models.mixtral import check_silu, expert_rules
from paged_engine.models.utils import CausalLMBase


def with_activation(
    moe: DeepseekMoe, routed: nn.Module | None, shared: nn.Module | None
) -> DeepseekMoe:
    """`moe` with its routed experts' and shared experts' activations replaced (None: kept;
    the routed experts then run grouped in torch, `ActExperts`)."""
    if routed is not None:
        e = moe.experts
        moe.experts = ActExperts(routed, e.num_experts, e.hidden_size, e.intermediate_size,
                                 e.tp_rank, e.tp_size)  # fmt: skip
    if shared is not None and moe.shared_experts is not None:
        moe.shared_experts.act_fn = shared
    return moe


def clamped_mlp(config, layer_idx: int) -> nn.Module:
    """`mlp_layer_types[i]`: "dense" (a SwiGLU MLP) or "sparse" (DeepSeek-V3's MoE), both with
    the swiglu_limit clamp."""
    kinds = list(config.mlp_layer_types)
    if len(kinds) != config.num_hidden_layers or kinds[layer_idx] not in ("dense", "sparse"):
        raise ValueError(f"mlp_layer_types must be 'dense' / 'sparse' a layer, got {kinds}")
    act = ClampedSiluAndMul(float(config.swiglu_limit))
    if kinds[layer_idx] == "dense":
        mlp = LlamaMLP(config, bias=False)
        mlp.act_fn = act
        return mlp
    return with_activation(DeepseekMoe.from_config(config), act, act)


class PoolIndexer(nn.Module):
    """The indexer's projections (replicated): this step's cache columns [k | gate scores]
    [T, 2 Di] and its queries and head weights [T, Hi * Di + Hi] float32."""

    def __init__(self, config, _rope=None, _neox: bool = False) -> None:
        super().__init__()
        self.heads, self.dim = int(config.index_n_heads), int(config.index_head_dim)
        whole = {"tp_rank": 0, "tp_size": 1}  # every rank chooses alike
        self.wq_b = ColumnParallelLinear(
            int(config.q_lora_rank), self.heads * self.dim, bias=False, **whole
        )
        hidden = config.hidden_size
        self.wk = ColumnParallelLinear(hidden, self.dim, bias=False, **whole)
        self.k_norm = LayerNorm(self.dim, eps=1e-6)
        self.weights_proj = ColumnParallelLinear(hidden, self.heads, bias=False, **whole)
        self.index_kpool_compress_gate = nn.Parameter(torch.empty(self.dim, hidden))

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, q_resid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        k = self.k_norm(self.wk(x))
        gate = F.linear(x, self.index_kpool_compress_gate)
        q = self.wq_b(q_resid).view(t, -1).float()
        w = self.weights_proj(x).float() * self.heads**-0.5
        return torch.cat((k, gate), dim=-1), torch.cat((q, w), dim=-1)


class PooledSparseAttention(SparseLatentAttention):
    """SparseLatentAttention whose choice is made over pools of index_kpool tokens (module
    docstring); a full layer's row is [c | k | gate scores]. The choice has no kernel: the
    torch reference path runs on every device."""

    kernel_path = False

    def __init__(self, num_heads, latent_width, rank, scale, index_shape, index_topk, full,
                 choices, *, pool: int) -> None:  # fmt: skip
        heads, dim = index_shape
        super().__init__(
            num_heads, latent_width, rank, scale, (heads, 2 * dim), index_topk, full, choices
        )
        self.index_dim, self.pool = dim, pool
        if full:  # the pools' position weights (the checkpoint's indexer.index_kpool_compress_ape)
            self.index_kpool_compress_ape = nn.Parameter(torch.empty(pool, dim))

    def _keep(
        self,
        s: int,
        row0: int,
        index_q: torch.Tensor,  # [R, Hi * Di + Hi] float32: queries, then head weights
        keys: torch.Tensor,  # [L, 2 Di]: k, then gate scores (a shared layer's: [L, 0])
        lengths: torch.Tensor,  # [R]: keys each row sees
    ) -> torch.Tensor:  # [R, L]
        n_keys, pool = keys.shape[0], self.pool
        positions = torch.arange(n_keys, device=keys.device)
        visible = positions < lengths[:, None]
        whole = (lengths // pool) * pool  # [R]: the end of each row's last whole pool
        tail = visible & (positions >= whole[:, None])  # after the row's last whole pool
        if n_keys <= self.topk:  # no row sees more whole pools than it may keep
            return visible
        if not self.full:
            return self.choices[(s, row0)]
        heads, dim = self.index_shape[0], self.index_dim
        n = n_keys // pool  # the sequence's whole pools
        k, gate = keys[: n * pool].view(n, pool, 2 * dim).split(dim, dim=-1)
        weights = (gate.float() + self.index_kpool_compress_ape.float()).softmax(dim=1)
        pooled = (weights.to(k.dtype) * k).sum(dim=1).float()  # [n, Di]
        queries = index_q[:, : heads * dim].view(-1, heads, dim)
        scores = torch.einsum("rhd,pd->rhp", queries, pooled) * dim**-0.5
        scores = torch.einsum("rh,rhp->rp", index_q[:, heads * dim :], F.relu(scores))
        seen = (torch.arange(1, n + 1, device=keys.device) * pool) <= lengths[:, None]
        chosen = top_k_mask(scores.masked_fill(~seen, float("-inf")), self.topk // pool) & seen
        keep = F.pad(chosen.repeat_interleave(pool, dim=1), (0, n_keys - n * pool)) | tail
        self.choices[(s, row0)] = keep
        return keep


class Glm5NextMlaAttention(DsaAttention):
    """NoPE MLA (qk_rope_head_dim 0, softmax scale qk_nope_head_dim^-0.5) whose latent norms
    use rms_norm_eps, with the pooled indexer on full layers."""

    indexer_cls = PoolIndexer  # type: ignore[assignment]

    def __init__(self, config, full: bool, choices: Choices) -> None:
        if int(config.qk_rope_head_dim):
            raise ValueError(f"qk_rope_head_dim={config.qk_rope_head_dim}: GLM-5 MLA is NoPE (0)")
        pool, topk = int(config.index_kpool), int(config.index_topk)
        if pool < 1 or topk % pool:  # (sparse_attention builds the pools)
            raise ValueError(f"index_topk={topk} must be a multiple of index_kpool={pool}")
        if not config.index_kpool_always_select_tail:
            raise ValueError(
                "index_kpool_always_select_tail=False is not supported (a sequence's first "
                "index_kpool - 1 tokens would attend to nothing)"
            )
        super().__init__(config, NoRope(), full, choices, False)  # type: ignore[arg-type]
        eps = float(config.rms_norm_eps)
        self.q_a_layernorm = RMSNorm(int(config.q_lora_rank), eps)
        self.kv_a_layernorm = RMSNorm(self.rank, eps)

    def sparse_attention(
        self, config, index_shape: tuple[int, int], full: bool, choices: Choices
    ) -> PooledSparseAttention:
        scale = int(config.qk_nope_head_dim) ** -0.5  # NoPE: no rope part in the row
        return PooledSparseAttention(
            self.heads, self.rank, self.rank, scale, index_shape, int(config.index_topk), full,
            choices, pool=int(config.index_kpool),
        )  # fmt: skip


def indexed_types(config) -> list[str]:
    """Each layer's indexer, "full" / "shared" ("" on linear layers); the first indexed layer
    must be full."""
    kinds = layer_types(config)
    types = list(getattr(config, "indexer_types", None) or ["full"] * len(kinds))
    if len(types) != len(kinds) or set(types) - {"full", "shared"}:
        raise ValueError(f"indexer_types must be 'full' / 'shared' a layer, got {types}")
    out = ["" if k in LINEAR_LAYER_TYPES else t for k, t in zip(kinds, types, strict=True)]
    if next((t for t in out if t), "full") != "full":
        raise ValueError(f"indexer_types={types}: the first indexed layer must be 'full'")
    return out


class Glm5NextDecoderLayer(nn.Module):
    """`attn_hc` -> norm -> KDA or MLA, `ffn_hc` -> norm -> MLP; streams [T, N, D]."""

    def __init__(self, config, layer_idx: int, choices: Choices) -> None:
        super().__init__()
        self.is_linear = layer_types(config)[layer_idx] in LINEAR_LAYER_TYPES
        if self.is_linear:
            self.self_attn = Glm5NextDeltaAttention(config, layer_idx, config.linear_lower_bound)
        else:
            full = indexed_types(config)[layer_idx] == "full"
            self.self_attn = Glm5NextMlaAttention(config, full, choices)
        self.mlp = clamped_mlp(config, layer_idx)
        eps = float(config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(self, positions, streams, kv_cache, md: AttentionMetadata) -> torch.Tensor:
        dtype = streams.dtype
        post, comb, x = self.attn_hc(streams)
        h = self.input_layernorm(x)
        h = self.self_attn(h, md) if self.is_linear else self.self_attn(positions, h, kv_cache, md)
        streams = post.to(dtype).unsqueeze(-1) * h.unsqueeze(1) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )
        post, comb, x = self.ffn_hc(streams)
        h = self.mlp(self.post_attention_layernorm(x))
        return post.to(dtype).unsqueeze(-1) * h.unsqueeze(1) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )


class Glm5NextModel(HybridModel):
    """HybridModel's stack over hc_mult streams: copied in, averaged out before the norm."""

    def __init__(self, config) -> None:
        if get_parallel_state().pp_size > 1:
            raise ValueError(
                "GLM-5.3-Flash does not support pipeline parallelism (its hyper-connection "
                "streams stay on one stage)"
            )
        norm = RMSNorm(config.hidden_size, float(config.rms_norm_eps))
        choices: Choices = {}  # the last full indexer's choice, for the shared layers after it
        super().__init__(config, lambda i: Glm5NextDecoderLayer(config, i, choices), norm, None)
        self.streams = int(config.hc_mult)

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        x = stage_input(self, input_ids, hidden)  # [T, D]
        streams = x.unsqueeze(1).expand(-1, self.streams, -1).contiguous()
        for layer, i in zip(self.layers, self.kv_index, strict=True):
            streams = layer(positions, streams, kv_caches[i] if i >= 0 else None, md)
        return self.norm(streams.mean(dim=1))


class Glm5NextTextForCausalLM(CausalLMBase):
    stacked_params = (
        *KDA_CONV_RULES,
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )
    # The release's names (hc_attn_fn, ...) and transformers' in-memory ones (attn_hc.fn) load.
    renames = (
        (".hc_attn_", ".attn_hc."),
        (".hc_ffn_", ".ffn_hc."),
        (".self_attn.forget_gate.", ".self_attn."),
        (".indexer.index_kpool_compress_ape", ".attn.index_kpool_compress_ape"),
    )

    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        super().__init__(config, Glm5NextModel(config))
        # Expert rules first: the dense and shared MLPs' ".gate_proj" also matches an expert's.
        rules = expert_rules(num_routed_experts(config), "gate_proj", "up_proj", "down_proj")
        self.stacked_params = (*rules, *type(self).stacked_params)

    @classmethod
    def kv_cache_layout(cls, config) -> list[tuple[int, int]]:
        """One latent "head" an indexed layer: [c | k | gate scores], a shared layer's [c]."""
        width, index = int(config.kv_lora_rank), 2 * int(config.index_head_dim)
        return [(1, width + (index if t == "full" else 0)) for t in indexed_types(config) if t]
