"""Aleph Alpha Kolibri 1 and Kolibri 1.1 (`Kolibri1ForCausalLM`, `Kolibri1_1ForCausalLM`).

Kolibri 1 puts EXAONE 4.0's attention (models/exaone4.py) in GLM-4's four-norm layer
(models/glm4.py) over a DeepSeek-V3-style MoE in every layer, each piece as transformers runs it:

    attention  per-head q / k RMSNorms after the projections; the `sliding_attention` layers of
               config.layer_types see the last sliding_window keys (themselves included) and
               rotate q and k, the `full_attention` ones see the whole context without
               positional encoding (NoPE); without a window every layer is global and rotates
    layer      four RMSNorms (Llama's rounding), one on each side of each sublayer:
                   x += post_self_attn_layernorm(attn(input_layernorm(x)))
                   x += post_mlp_layernorm(mlp(post_attention_layernorm(x)))
    router     logits = x @ W_g^T in float32; a token's experts are the top num_experts_per_tok
               of logits + e_score_correction_bias (the balance bias is added to the logits, not
               to sigmoid scores as in DeepSeek-V3), weighted by the sigmoid of their logits,
               renormalized when norm_topk_prob (False by default), no scaling factor
    experts    of moe_intermediate_size, plus an ungated shared expert of
               shared_expert_intermediate_size (`shared_experts`) every token goes through

Kolibri 1.1 has `indexed_attention` layers where Kolibri 1 has full ones, and dense layers:

    indexed    NoPE and q / k norms as Kolibri 1's full layers, but attending to keys and values
               rounded to NVFP4 (`nvfp4_round`); a query that sees more than index_topk +
               index_num_sink_tokens + index_num_local_tokens keys attends only to the first
               sink keys, its last local ones (itself included) and the index_topk keys of its
               pool that score best (ties to the earlier key)
    score      of key j for a query: sum over the first index_num_heads query heads h of
               relu(nvfp4(q_h) . nvfp4(k_j)), times head_dim^-0.5 / index_num_heads, k_j the
               key's head of KV head 0
    pool       the `index_layers` (indexers) choose each query's pool: all its keys up to
               index_pool_size of them, beyond that the index_pool_size / index_compression
               blocks of index_compression keys whose NVFP4-rounded mean key scores best (the
               block holding its newest keys competes with score 0 while incomplete); the other
               indexed layers reuse the pool of the closest indexer before them
    KV sharing an indexed layer whose `kv_source_layers` entry names an earlier layer has
               queries only and attends over that layer's cache (Attention.set_kv_source)
    MLPs       `mlp_only_layers` have a gated SiLU MLP of mlp_only_intermediate_size

The cache holds the unrounded keys and values (a pool averages unrounded keys; an fp8 cache
holds them in fp8). The indexed layers read their sequences' keys back from it and choose and
attend in float32 torch, one sequence (and block of rows) at a time: a reference, quadratic in
the context as transformers' is. Under tensor parallelism rank 0, which holds KV head 0 and the
scoring heads, chooses, and an all-reduce hands its choice to the other ranks.

Refused by name: pipeline parallelism where layers share KV or reuse a pool (the source or
indexer of a layer must run on its stage), tensor parallelism that leaves rank 0 fewer query
heads than index_num_heads, CUDA graphs (the choice reads the batch's lengths on the host), and
(worker/kv_scales.py) an fp8 KV cache with KV sharing. Checkpoints: transformers' names, and the
release's `moe.router.expert_bias`, `post_attn_norm` and `post_ffn_norm` (transformers' renames).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.attention.cpu_backend import read_rows
from paged_engine.distributed.communication import tp_all_reduce
from paged_engine.distributed.parallel_state import get_parallel_state
from paged_engine.layers.attention import Attention, AttentionMetadata
from paged_engine.layers.deepseek_moe import DeepseekMoe, DeepseekRouter
from paged_engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.layers.torch_attention import (
    TorchAttention,
    attend,
    block_view,
    gather,
    step_sequences,
    top_k_mask,
)
from paged_engine.models.exaone4 import Exaone4Attention
from paged_engine.models.exaone_moe import ExaoneMoeForCausalLM
from paged_engine.models.glm4 import Glm4DecoderLayer
from paged_engine.models.llama import LlamaMLP, LlamaModel
from paged_engine.models.mixtral import check_silu, expert_rules, num_experts
from paged_engine.models.utils import CausalLMBase, cfg_get, layer_index

# Bound on the float32 scores [rows, H, keys] an indexed layer holds at once (64 MiB).
_MAX_SCORES = 2**24


class KolibriRouter(DeepseekRouter):
    """`mlp.gate`: experts ranked by logits + e_score_correction_bias, weighted by the sigmoid
    of their logits. x [T, H] -> (weights [T, k] float32, expert ids [T, k])."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)  # [T, E]
        assert self.e_score_correction_bias is not None
        ids = (logits + self.e_score_correction_bias).topk(self.top_k, dim=-1).indices
        weights = logits.gather(1, ids).sigmoid()
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


def kolibri_moe(config) -> DeepseekMoe:
    """DeepSeek's MoE block (routed + shared experts, one all-reduce) with Kolibri's router."""
    experts, top_k = num_experts(config), int(config.num_experts_per_tok)
    renormalize = bool(cfg_get(config, "norm_topk_prob", False))
    moe = DeepseekMoe(
        experts,
        top_k,
        config.hidden_size,
        int(config.moe_intermediate_size),
        int(config.shared_expert_intermediate_size),
        renormalize=renormalize,
    )
    moe.gate = KolibriRouter(experts, config.hidden_size, top_k, renormalize=renormalize)
    return moe


class KolibriDecoderLayer(Glm4DecoderLayer):
    """GLM-4's four-norm layer (its forward) around any attention and MLP."""

    def __init__(self, config, attention: nn.Module, mlp: nn.Module) -> None:
        nn.Module.__init__(self)
        d, eps = config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-6)
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = RMSNorm(d, eps)
        self.post_self_attn_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.post_mlp_layernorm = RMSNorm(d, eps)


def nvfp4_round(x: torch.Tensor) -> torch.Tensor:
    """x rounded to NVFP4 and back, in x's dtype: each 16 consecutive values of the last dim
    share an E4M3 scale amax / 6 (clamped to [2^-9, 448]); value / scale goes to the nearest
    E2M1 magnitude (0, 0.5, 1, 1.5, 2, 3, 4, 6; ties to even), clamped at 6."""
    blocks = x.float().unflatten(-1, (-1, 16))
    scale = blocks.abs().amax(-1, keepdim=True) / 6
    scale = scale.clamp(2**-9, 448).to(torch.float8_e4m3fn).float()
    scaled = blocks / scale
    magnitude = scaled.abs().clamp(max=6)
    step = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    rounded = torch.round(magnitude / step) * step
    return (rounded.copysign(scaled) * scale).flatten(-2).to(x.dtype)


class KeyIndex:
    """One indexed layer's choice of keys (see the module docstring). `pools` is shared by
    the model's indexed layers: an indexer fills it for the forward, keyed by the first token
    row of each block of rows, and the reindexers after it read it."""

    def __init__(self, config, is_indexer: bool, pools: dict[int, torch.Tensor]) -> None:
        self.is_indexer, self.pools = is_indexer, pools
        self.num_heads = int(config.index_num_heads)
        self.topk = int(config.index_topk)
        self.pool_size = int(config.index_pool_size)
        self.compression = int(config.index_compression)
        self.sinks = int(config.index_num_sink_tokens)
        self.local = int(config.index_num_local_tokens)
        self.budget = self.topk + self.sinks + self.local
        self.head_weight = int(config.head_dim) ** -0.5 / self.num_heads

    def score(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Rounded float32 queries [heads, R, D] against keys [N, D] -> [R, N] (HF's order)."""
        scores = queries.new_zeros(queries.shape[1], keys.shape[0])
        for head in queries:
            scores += (head @ keys.T).relu()
        return scores * self.head_weight

    def choose(
        self, row0: int, q: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """The keys [R, L] that rows R of one sequence attend to (block `row0`), given their
        queries [R, H, D], the sequence's keys of KV head 0 [L, D] and each row's visible
        count `lengths` [R] (its position + 1; some row sees all L keys)."""
        n = lengths[:, None]
        positions = torch.arange(keys.shape[0], device=keys.device)
        visible = positions < n
        queries = nvfp4_round(q[:, : self.num_heads].transpose(0, 1)).float()
        if self.is_indexer:
            pool = self._pool(queries, keys, visible, n)
            self.pools[row0] = pool
        else:
            pool = self.pools[row0]
        scores = self.score(queries, nvfp4_round(keys).float())
        sinks = positions < self.sinks
        local = (positions >= n - self.local) & visible
        candidates = pool & ~sinks & (positions < n - self.local)
        chosen = top_k_mask(scores.masked_fill(~candidates, float("-inf")), self.topk)
        chosen = (chosen | sinks | local) & visible
        return torch.where(n > self.budget, chosen, visible)

    def _pool(
        self, queries: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, n: torch.Tensor
    ) -> torch.Tensor:  # -> [R, L]
        c = self.compression
        if keys.shape[0] <= self.pool_size:
            return visible
        num_blocks = keys.shape[0] // c
        means = keys[: num_blocks * c].float().unflatten(0, (num_blocks, c)).sum(1) / c
        scores = F.pad(self.score(queries, nvfp4_round(means)), (0, 1))  # [R, blocks + 1]
        blocks = torch.arange(num_blocks + 1, device=keys.device)
        # complete blocks keep their score, the row's incomplete newest block scores 0
        scores = torch.where(blocks < n // c, scores, 0.0)
        scores = scores.masked_fill(blocks >= (n + c - 1) // c, float("-inf"))
        chosen = top_k_mask(scores, self.pool_size // c).repeat_interleave(c, dim=-1)
        chosen = chosen[:, : keys.shape[0]] & visible
        return torch.where(n > self.pool_size, chosen, visible)


class IndexedAttention(TorchAttention, Attention):
    """Kolibri 1.1's sparse attention over the paged cache: writes the step's unrounded K/V
    (unless it reads another layer's cache), then per sequence gathers its keys and values
    and attends over their NVFP4 roundings where `index` says. Never traced: a compiled
    forward runs it as the opaque attention operator."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, index: KeyIndex):
        super().__init__(num_heads, head_dim, num_kv_heads, head_dim**-0.5)
        self.index = index
        state = get_parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size

    def run(
        self,
        q: torch.Tensor,  # [T, H*D]
        k: torch.Tensor,  # [T, Hkv*D] (unread with a kv_source)
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
        kv_written: bool = False,
    ) -> torch.Tensor:  # [T, H*D]
        md, (key_cache, value_cache) = attn_metadata, kv_cache
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise ValueError("Kolibri 1.1's indexed attention cannot run in a CUDA graph")
        t, d, hkv = q.shape[0], self.head_dim, self.num_kv_heads
        source = self if self.kv_source is None else self.kv_source
        scales = {"k_scale": source.k_scale, "v_scale": source.v_scale}
        if self.kv_source is None:
            k, v = k.view(t, hkv, d), v.view(t, hkv, d)
            md.backend.write_kv(k, v, key_cache, value_cache, md.slot_mapping, **scales)
        keys, values = block_view(key_cache, md.backend), block_view(value_cache, md.backend)
        q = q.view(t, self.num_heads, d)
        out = torch.zeros_like(q)
        if self.index.is_indexer:
            self.index.pools.clear()
        for _, first, end, length, blocks in step_sequences(md, keys.shape[1]):
            seq_k = read_rows(gather(keys, blocks, length), scales["k_scale"], q.dtype)
            seq_v = read_rows(gather(values, blocks, length), scales["v_scale"], q.dtype)
            seq_v = nvfp4_round(seq_v)  # [L, Hkv, D]
            rounded_k = nvfp4_round(seq_k)
            step = max(1, _MAX_SCORES // (self.num_heads * length))
            for row0 in range(first, end, step):
                rows = slice(row0, min(row0 + step, end))
                # the sequence's last queries: row j sits at position length - end + j and
                # sees its keys up to there
                lengths = torch.arange(rows.start, rows.stop, device=q.device)
                lengths = lengths + (length - end + 1)
                keep = self._keep(row0, q[rows], seq_k[:, 0], lengths)
                out[rows] = attend(q[rows], rounded_k, seq_v, keep, self.scale)
        return out.view(t, -1)

    def _keep(self, row0: int, q, keys0, lengths: torch.Tensor) -> torch.Tensor:
        """The index's choice [R, L] (rank 0's, all-reduced to the other ranks); causal where
        no row sees more keys than the budget (every rank decides that alike)."""
        visible = torch.arange(keys0.shape[0], device=q.device) < lengths[:, None]
        if keys0.shape[0] <= self.index.budget:
            return visible
        if self.tp_size == 1:
            return self.index.choose(row0, q, keys0, lengths)
        keep = torch.zeros(visible.shape, dtype=torch.int32, device=q.device)
        if self.tp_rank == 0:
            keep += self.index.choose(row0, q, keys0, lengths)
        return tp_all_reduce(keep).bool()


class SharedKvAttention(nn.Module):
    """An indexed layer that reads another layer's keys and values: its query projection
    (`q_proj` in checkpoints; `q_heads` here, with no k / v to stack), per-head q norm,
    o_proj."""

    def __init__(self, config, attn_factory: Callable[[int, int], IndexedAttention]) -> None:
        super().__init__()
        hidden, heads, d = config.hidden_size, config.num_attention_heads, int(config.head_dim)
        self.head_dim = d
        self.q_heads = ColumnParallelLinear(hidden, heads * d, bias=False)
        self.q_norm = RMSNorm(d, cfg_get(config, "rms_norm_eps", 1e-6))
        self.o_proj = RowParallelLinear(heads * d, hidden, bias=False)
        kv_heads = max(1, int(config.num_key_value_heads) // self.q_heads.tp_size)
        self.attn = attn_factory(heads // self.q_heads.tp_size, kv_heads)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        t = x.shape[0]
        q = self.q_norm(self.q_heads(x).view(t, -1, self.head_dim)).view(t, -1)
        return self.o_proj(self.attn(q, q, q, kv_cache, md))  # k, v unread: shared


class IndexLayout:
    """Kolibri 1.1's layers: types, KV sources, indexers; refuses what we cannot run."""

    def __init__(self, config) -> None:
        n = config.num_hidden_layers
        self.types = list(config.layer_types)
        if len(self.types) != n or set(self.types) - {"sliding_attention", "indexed_attention"}:
            raise ValueError(f"config.layer_types: unsupported {self.types}")
        self.sources = [int(s) for s in config.kv_source_layers]
        self.indexers = {int(i) for i in config.index_layers}
        indexed = [i for i, kind in enumerate(self.types) if kind == "indexed_attention"]
        if indexed and indexed[0] not in self.indexers:
            raise ValueError("config.index_layers must hold the first indexed-attention layer")
        for i, s in enumerate(self.sources):
            if not 0 <= s <= i or self.sources[s] != s or self.types[s] != self.types[i]:
                raise ValueError(f"config.kv_source_layers[{i}]={s}: not a layer it can read")
        self.own = [i for i in range(n) if self.sources[i] == i]  # layers with their own KV
        self.spans_layers = self.own != list(range(n)) or any(
            i not in self.indexers for i in indexed
        )


class Kolibri1ForCausalLM(ExaoneMoeForCausalLM):
    """EXAONE 4.0's attention (`build_attention`, K-EXAONE's) in KolibriDecoderLayer."""

    renames = (
        ("moe.router.expert_bias", "mlp.gate.e_score_correction_bias"),
        ("post_attn_norm", "post_self_attn_layernorm"),
        ("post_ffn_norm", "post_mlp_layernorm"),
    )
    rename_weight = CausalLMBase.rename_weight  # the renames above, not K-EXAONE's

    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        CausalLMBase.__init__(self, config, self.build_model(config))
        # Expert rules first: the shared / dense rules' ".gate_proj" would match an expert's.
        rules = expert_rules(num_experts(config), *self.expert_names)
        self.stacked_params = (*rules, *type(self).stacked_params)

    @classmethod
    def build_model(cls, config) -> nn.Module:
        flags = cls.layer_flags(config)

        def build(i: int, rope: RotaryEmbedding) -> KolibriDecoderLayer:
            attention = cls.build_attention(config, i, flags, rope)
            return KolibriDecoderLayer(config, attention, cls.build_mlp(config, i))

        return LlamaModel(config, flags, build)

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        return kolibri_moe(config)


class Kolibri1_1Model(LlamaModel):
    """The Llama stack of KolibriDecoderLayers: sliding layers as Kolibri 1's, indexed ones
    IndexedAttention (queries only where they read another layer's KV). `kv_caches` holds the
    stage's layers with their own KV; each layer gets its source's."""

    def __init__(self, config, flags: dict[str, bool], build_mlp) -> None:
        layout = IndexLayout(config)
        state = get_parallel_state()
        if state.pp_size > 1 and layout.spans_layers:
            raise ValueError(
                "Kolibri 1.1 with kv_source_layers or index_layers that make layers read "
                "another layer's KV or pool does not support pipeline parallelism"
            )
        heads, index_heads = config.num_attention_heads, int(config.index_num_heads)
        if index_heads > heads // state.tp_size:
            raise ValueError(
                f"index_num_heads={index_heads}: tensor_parallel_size={state.tp_size} leaves "
                f"rank 0 {heads // state.tp_size} query heads to score keys with"
            )
        window, d = int(config.sliding_window or 0) or None, int(config.head_dim)
        pools: dict[int, torch.Tensor] = {}

        def build(i: int, rope: RotaryEmbedding) -> KolibriDecoderLayer:
            if layout.types[i] == "sliding_attention":
                attention: nn.Module = Exaone4Attention(config, i, flags, rope)
                attention.attn.sliding_window = window
            else:
                index = KeyIndex(config, i in layout.indexers, pools)

                def make(heads: int, kv_heads: int) -> IndexedAttention:
                    return IndexedAttention(heads, d, kv_heads, index)

                if layout.sources[i] != i:
                    attention = SharedKvAttention(config, make)
                else:
                    attention = Exaone4Attention(config, i, flags, None)  # NoPE
                    proj = attention.qkv_proj
                    attention.attn = make(proj.num_heads, proj.num_kv_heads)
            return KolibriDecoderLayer(config, attention, build_mlp(config, i))

        super().__init__(config, flags, build)
        start, end = self.stage.start, self.stage.end
        for i in range(start, end):
            if layout.sources[i] != i:
                source = self.layers[layout.sources[i]].self_attn.attn
                self.layers[i].self_attn.attn.set_kv_source(source)
        slot = {layer: j for j, layer in enumerate(layout.own)}
        self.cache_slots = [slot[layout.sources[i]] - start for i in range(start, end)]

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        caches = [kv_caches[j] for j in self.cache_slots]
        return super().forward(input_ids, positions, caches, md, hidden)


class Kolibri1_1ForCausalLM(Kolibri1ForCausalLM):
    @classmethod
    def build_model(cls, config) -> nn.Module:
        return Kolibri1_1Model(config, cls.layer_flags(config), cls.build_mlp)

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        if layer_idx in (config.mlp_only_layers or ()):
            return LlamaMLP(config, False, int(config.mlp_only_intermediate_size))
        return kolibri_moe(config)

    @classmethod
    def kv_cache_layout(cls, config) -> list[tuple[int, int]]:
        """(num_kv_heads, head_dim) of each layer with its own KV, in layer order."""
        shape = (int(config.num_key_value_heads), int(config.head_dim))
        return [shape for _ in IndexLayout(config).own]

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        layer = layer_index(name)
        shared = layer is not None and self.config.kv_source_layers[layer] != layer
        if shared and ".self_attn.q_proj." in name:
            name = name.replace(".self_attn.q_proj.", ".self_attn.q_heads.")
        return super().convert_weight(name, w)
