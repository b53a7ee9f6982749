"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`: DeepSeek-V3.2-Exp, V3.2) and GLM-5
(`GlmMoeDsaForCausalLM`): DeepSeek-V3's MLA and MoE (models/deepseek_v2.py, in GLM-4.7-Flash's
layout: `mlp_layer_types` names each layer's MLP) plus DeepSeek Sparse Attention (DSA), each
piece as transformers runs it:

    attention  V3's absorbed MLA, always through the q bottleneck; interleaved rope whatever
               the config says (transformers hard-codes it); YaRN's mscale_all_dim as V3's
    indexer    per layer, replicated weights: queries wq_b(q_resid) [index_n_heads,
               index_head_dim] from the MLA's normed bottleneck q_resid, one key
               k_norm(wk(x)) [index_head_dim] a token (a LayerNorm with bias, eps 1e-6); the
               first qk_rope_head_dim dims of both rotated with the model's cos / sin: NeoX
               halves in V3.2, (even, odd) pairs in GLM-5
    score      of key j for a query, in float32: sum_h w_h * relu(q_h . k_j) * index_head_dim
               ^-0.5, w = weights_proj(x) * index_n_heads^-0.5 (weights_proj kept in float32,
               as transformers keeps it)
    choice     a query attends to its index_topk best-scoring visible keys (all of them while
               it sees no more); ties go to the earlier key (transformers' topk leaves them open)
    GLM-5      `indexer_types`: a "shared" layer has no indexer and reuses the choice of the
               last "full" layer before it

The cache: a layer's MLA row [latent c | rope(k_pe)] widens to [c | rope(k_pe) | indexer key]
(`kv_cache_layout`; a shared layer keeps the plain row), one tensor a layer as every latent
cache. Everything the indexer reads is then per token and per layer in the paged blocks: prefix
caching, chunked prefill, preemption (recompute or swap: whole blocks move) and copy-on-write
carry it with the latent; an fp8 cache stores it with the row's scale. On a CUDA device the
sparse layers run paged_kernels' sparse_mla.py: `index_topk` scores the keys and keeps each query
row's choice for the whole batch (slots into the paged cache), `sparse_mla_attention` attends
over those slots alone. Elsewhere they read their sequences' rows back and choose and attend in
float32 torch, one sequence (and block of query rows) at a time, as models/kolibri.py's indexed
attention does (the reference the kernels are tested against). Under tensor parallelism
the latent, the indexer and its inputs are whole and alike on every rank (the hidden state is
all-reduced), so every rank makes the same choice with no collective.

Refused by name: `q_lora_rank` None (the indexer reads the q bottleneck), `index_head_dim`
below `qk_rope_head_dim`, `indexer_types` entries other than "full" / "shared" or a "shared"
first layer, pipeline stages that start on a shared layer, CUDA graphs (the torch path reads the
batch's lengths on the host; the kernel path reads none, but its capture is not yet enabled) and
speculative_config method "mtp" (the MTP layer's attention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.attention.cpu_backend import read_rows
from paged_engine.distributed.parallel_state import get_parallel_state, stage_layers
from paged_engine.layers.attention import AttentionMetadata, LatentAttention
from paged_engine.layers.deepseek_moe import num_routed_experts
from paged_engine.layers.linear import ColumnParallelLinear
from paged_engine.layers.norm import LayerNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.layers.torch_attention import (
    TorchAttention,
    attend,
    block_view,
    gather,
    step_sequences,
    top_k_mask,
)
from paged_engine.models.deepseek_v2 import (
    DeepseekDecoderLayer,
    DeepseekModel,
    Glm4MoeLiteForCausalLM,
    MlaAttention,
)
from paged_engine.models.mixtral import check_silu, expert_rules
from paged_engine.models.utils import CausalLMBase

_MAX_SCORES = 2**24  # float32 scores held at once: rows x (index or attention) heads x keys

# (sequence, first query row) -> that block of rows' choice [R, L], set by a full layer; on
# the kernel path KERNEL_CHOICE -> the batch's chosen slots [T, K] (-1 padding)
Choices = dict[tuple[int, int], torch.Tensor]
KERNEL_CHOICE = (-1, -1)


def indexer_types(config) -> list[str]:
    """Each layer's indexer, "full" or "shared" (GLM-5's `indexer_types`; all full without)."""
    n = int(config.num_hidden_layers)
    types = list(getattr(config, "indexer_types", None) or ["full"] * n)
    if len(types) != n or set(types) - {"full", "shared"} or types[0] != "full":
        raise ValueError(f"indexer_types must be 'full' / 'shared' a layer, layer 0 full: {types}")
    return types


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x [T, N, R] rotated by cos / sin [T, 1, R/2] float32: NeoX halves or (even, odd) pairs."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1) if neox else (xf[..., 0::2], xf[..., 1::2])
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    out = torch.cat((o1, o2), -1) if neox else torch.stack((o1, o2), -1).flatten(-2)
    return out.to(x.dtype)


class Float32Linear(nn.Module):
    """y = x @ W^T in float32 with W kept in float32 (no bias, replicated). [T, I] -> [T, O]."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class DsaIndexer(nn.Module):
    """The lightning indexer's projections: this step's keys and (queries, head weights)."""

    rope_tail = False  # True: rope on the last qk_rope_head_dim dims (Hy-V4), not the first

    def __init__(self, config, rope: RotaryEmbedding, neox: bool) -> None:
        super().__init__()
        self.heads, self.dim = int(config.index_n_heads), int(config.index_head_dim)
        self.rope_dim, self.rope, self.neox = int(config.qk_rope_head_dim), rope, neox
        if self.dim < self.rope_dim:
            raise ValueError(f"index_head_dim={self.dim} is below qk_rope_head_dim={self.rope_dim}")
        whole = {"tp_rank": 0, "tp_size": 1}  # replicated: every rank chooses alike
        self.wq_b = ColumnParallelLinear(
            int(config.q_lora_rank), self.heads * self.dim, bias=False, **whole
        )
        self.wk = ColumnParallelLinear(config.hidden_size, self.dim, bias=False, **whole)
        self.k_norm = LayerNorm(self.dim, eps=1e-6)
        self.weights_proj = Float32Linear(config.hidden_size, self.heads)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, D]
        q_resid: torch.Tensor,  # [T, q_lora_rank]: q_a_layernorm(q_a_proj(x))
    ) -> tuple[torch.Tensor, torch.Tensor]:  # keys [T, Di], [T, Hi * Di + Hi] float32
        t, r = x.shape[0], self.rope_dim
        q = self.wq_b(q_resid).view(t, self.heads, self.dim)
        k = self.k_norm(self.wk(x)).view(t, 1, self.dim)
        cos, sin = self.rope.cos[positions].unsqueeze(1), self.rope.sin[positions].unsqueeze(1)
        if self.rope_tail:
            p = self.dim - r
            q = torch.cat((q[..., :p], rotate(q[..., p:], cos, sin, self.neox)), dim=-1)
            k = torch.cat((k[..., :p], rotate(k[..., p:], cos, sin, self.neox)), dim=-1)
        else:
            q = torch.cat((rotate(q[..., :r], cos, sin, self.neox), q[..., r:]), dim=-1)
            k = torch.cat((rotate(k[..., :r], cos, sin, self.neox), k[..., r:]), dim=-1)
        w = self.weights_proj(x) * self.heads**-0.5  # [T, Hi]
        return k.view(t, self.dim), torch.cat((q.reshape(t, -1).float(), w), dim=-1)


class SparseLatentAttention(TorchAttention, LatentAttention):
    """MLA over the widened latent rows (module docstring), each query over the keys its
    layer's indexer (or, for a shared layer, the last full layer's) chose. Called with the
    absorbed queries q [T, H * (rank + rope)], the rows to write k [T, W] and the indexer's
    queries and weights v [T, Hi * Di + Hi] (a shared layer's v is unread). Never traced: a
    compiled forward runs it as the opaque attention operator.

    On a CUDA device (or wherever `kernel_path` is True: interpreter tests) the whole batch
    goes through paged_kernels' `index_topk` and `sparse_mla_attention`; elsewhere through
    the per-sequence torch reference (`_keep`, `attend_rows`). The kernel path honours
    `sinks` (Attention's; Hy-V4's subclass sets them and its own `attend_rows`)."""

    kernel_path: bool | None = None  # None: the kernels on CUDA, the torch reference elsewhere

    def __init__(
        self,
        num_heads: int,
        latent_width: int,  # rank + rope: the attended part of a row
        rank: int,
        scale: float,
        index_shape: tuple[int, int],  # (index_n_heads, index_head_dim)
        index_topk: int,
        full: bool,
        choices: Choices,
    ) -> None:
        index_dim = index_shape[1] if full else 0
        super().__init__(num_heads, latent_width + index_dim, rank, scale)
        self.latent_width, self.index_shape, self.topk = latent_width, index_shape, index_topk
        self.full, self.choices = full, choices

    def run(
        self,
        q: torch.Tensor,  # [T, H * (rank + rope)]
        k: torch.Tensor,  # [T, W]: the rows to cache
        v: torch.Tensor,  # [T, Hi * Di + Hi] float32 (full layers)
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # one tensor twice
        attn_metadata: AttentionMetadata,
        kv_written: bool = False,
    ) -> torch.Tensor:  # [T, H * (rank + rope)], each head's first `rank` columns defined
        md, cache = attn_metadata, kv_cache[0]
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise ValueError("DeepSeek sparse attention cannot run in a CUDA graph")
        t, lat = q.shape[0], self.latent_width
        row = k.view(t, 1, self.head_dim)
        md.backend.write_kv(row, row, cache, cache, md.slot_mapping, k_scale=self.k_scale,
                            v_scale=self.k_scale)  # fmt: skip
        rows_cache = block_view(cache, md.backend)  # [num_blocks, block_size, 1, W]
        q = q.view(t, self.num_heads, lat)
        if self.kernel_path or (self.kernel_path is None and q.is_cuda):
            return self._run_kernels(q, v, rows_cache, md).view(t, -1)
        out = torch.zeros_like(q)
        if self.full:
            self.choices.clear()
        for s, first, end, length, blocks in step_sequences(md, rows_cache.shape[1]):
            seq = read_rows(gather(rows_cache, blocks, length), self.k_scale, q.dtype)
            latent = seq[:, :, :lat]  # [L, 1, rank + rope]
            step = max(1, _MAX_SCORES // (max(self.index_shape[0], self.num_heads) * length))
            for row0 in range(first, end, step):
                rows = slice(row0, min(row0 + step, end))
                # row j sits at position length - end + j and sees its keys up to there
                lengths = torch.arange(rows.start, rows.stop, device=q.device)
                lengths = lengths + (length - end + 1)
                keep = self._keep(s, row0, v[rows], seq[:, 0, lat:], lengths)
                out[rows] = self.attend_rows(q[rows], latent, keep)
        return out.view(t, -1)

    def _run_kernels(
        self,
        q: torch.Tensor,  # [T, H, rank + rope]
        index_q: torch.Tensor,  # [T, Hi * Di + Hi] float32 (full layers)
        rows_cache: torch.Tensor,  # [num_blocks, block_size, 1, W]
        md: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, rank + rope], each head's first `rank` columns defined
        """The batch at once: a full layer's indexer picks each row's slots (kept in `choices`
        for the shared layers after it), the kernel attends over them. No host read."""
        # here, not at the top: the Triton kernels import triton (CPU-only hosts have none)
        from paged_kernels import index_topk, sparse_mla_attention

        if self.full:
            heads, dim = self.index_shape
            self.choices.clear()
            self.choices[KERNEL_CHOICE] = index_topk(
                index_q, rows_cache, md.block_tables, md.cu_seqlens_q, md.seq_lens,
                key_offset=self.latent_width, index_heads=heads, index_dim=dim,
                topk=self.topk, max_seqlen_k=md.max_seqlen_k, k_scale=self.k_scale,
            )  # fmt: skip
        return sparse_mla_attention(
            q, rows_cache, self.choices[KERNEL_CHOICE], self.scale, latent_dim=self.latent_dim,
            k_scale=self.k_scale, sinks=self.sinks, out=torch.empty_like(q),
        )  # fmt: skip

    def attend_rows(
        self,
        q: torch.Tensor,  # [R, H, rank + rope]
        latent: torch.Tensor,  # [L, 1, rank + rope]
        keep: torch.Tensor,  # [R, L] bool
    ) -> torch.Tensor:  # [R, H, rank + rope]
        """Rows of queries over the kept latent rows (keys and values alike), in float32."""
        return attend(q, latent, latent, keep, self.scale)

    def _keep(
        self,
        s: int,
        row0: int,
        index_q: torch.Tensor,  # [R, Hi * Di + Hi] float32: queries, then head weights
        keys: torch.Tensor,  # [L, Di] (a shared layer's: [L, 0])
        lengths: torch.Tensor,  # [R]: keys each row sees
    ) -> torch.Tensor:  # [R, L]
        visible = torch.arange(keys.shape[0], device=keys.device) < lengths[:, None]
        if keys.shape[0] <= self.topk:  # no row sees more keys than it may keep
            return visible
        if not self.full:
            return self.choices[(s, row0)]
        heads, dim = self.index_shape
        queries = index_q[:, : heads * dim].view(-1, heads, dim)
        weights = index_q[:, heads * dim :]  # [R, Hi]
        scores = torch.einsum("rhd,ld->rhl", queries, keys.float()) * dim**-0.5
        scores = torch.einsum("rh,rhl->rl", weights, F.relu(scores))
        chosen = top_k_mask(scores.masked_fill(~visible, float("-inf")), self.topk) & visible
        self.choices[(s, row0)] = chosen
        return chosen


class DsaAttention(MlaAttention):
    """V3's MLA (q bottleneck required) with an indexer on full layers; its cache row is
    [c | rope(k_pe) | indexer key] (a shared layer's [c | rope(k_pe)])."""

    indexer_cls: type[DsaIndexer] = DsaIndexer
    sparse_cls: type[SparseLatentAttention] = SparseLatentAttention

    # the indexer reads the normed q bottleneck (Mistral Large 4's reads x: False there)
    needs_q_bottleneck = True

    def __init__(
        self,
        config,
        rope: RotaryEmbedding,
        full: bool,
        choices: Choices,
        neox_index_rope: bool,
    ) -> None:
        if type(self).needs_q_bottleneck and getattr(config, "q_lora_rank", None) is None:
            raise ValueError("q_lora_rank None: DeepSeek sparse attention reads the q bottleneck")
        super().__init__(config, rope)
        cls = type(self)
        self.indexer = cls.indexer_cls(config, rope, neox_index_rope) if full else None
        shape = (int(config.index_n_heads), int(config.index_head_dim))
        self.attn = self.sparse_attention(config, shape, full, choices)

    def sparse_attention(
        self, config, index_shape: tuple[int, int], full: bool, choices: Choices
    ) -> SparseLatentAttention:
        """The layer's attention over its chosen latent rows, built from MLA's plain one (still
        `self.attn` here: its row width and scale)."""
        base = self.attn
        return type(self).sparse_cls(
            self.heads, base.head_dim, self.rank, base.scale, index_shape,
            int(config.index_topk), full, choices,
        )  # fmt: skip

    def cache_rows(
        self, positions: torch.Tensor, x: torch.Tensor, q_resid, latent: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A full layer's row [c | rope(k_pe) | indexer key] and its indexer queries (in the
        attention's value argument); a shared layer's plain row."""
        if self.indexer is None:
            return latent, latent
        index_k, index_q = self.indexer(positions, x, q_resid)
        return torch.cat((latent, index_k), dim=-1), index_q


class DeepseekV32ForCausalLM(Glm4MoeLiteForCausalLM):
    """DeepSeek-V3.2: every layer runs its own indexer, whose rope rotates NeoX halves."""

    neox_index_rope = True
    dsa_attention_cls: type[DsaAttention] = DsaAttention  # what every layer's attention is

    @staticmethod
    def attention_cls(config, rope: RotaryEmbedding) -> MlaAttention:  # type: ignore[override]
        """What an MTP draft layer (models/mtp.py) would build: refused."""
        raise ValueError(
            "speculative_config method 'mtp': the MTP layer of a DeepSeek sparse attention "
            "model (DeepSeek-V3.2, GLM-5) is not supported; use another method"
        )

    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        types = indexer_types(config)
        pp = get_parallel_state().pp_size
        n = int(config.num_hidden_layers)
        starts = [stage_layers(n, r, pp)[0] for r in range(pp)]
        if any(types[i] == "shared" for i in starts):
            raise ValueError(
                f"pipeline_parallel_size={pp}: a stage would start on a shared indexer layer "
                f"(indexer_types={types}), whose choice is made on the stage before"
            )
        choices: Choices = {}
        neox, attention_cls = type(self).neox_index_rope, type(self).dsa_attention_cls

        def layer(config, i, rope, mlp, _attention_cls) -> DeepseekDecoderLayer:
            def attention(config, rope) -> DsaAttention:
                return attention_cls(config, rope, types[i] == "full", choices, neox)

            return DeepseekDecoderLayer(config, i, rope, mlp, attention)  # type: ignore[arg-type]

        inner = DeepseekModel(
            config, type(self).build_mlp, DsaAttention, self.build_rope(config), layer
        )  # type: ignore[arg-type]
        CausalLMBase.__init__(self, config, inner)
        # Expert rules first: the dense and shared MLPs' ".gate_proj" also matches an expert's.
        rules = expert_rules(num_routed_experts(config), "gate_proj", "up_proj", "down_proj")
        self.stacked_params = (*rules, *type(self).stacked_params)

    @classmethod
    def build_rope(cls, config) -> RotaryEmbedding:
        """(even, odd) pairs for MLA whatever `rope_interleave` says (transformers' are)."""
        return get_rope(config, config.qk_rope_head_dim, is_neox_style=False)

    @classmethod
    def kv_cache_layout(cls, config) -> list[tuple[int, int]]:
        """One latent "head" a layer: [c | rope(k_pe) | indexer key], a shared layer's without
        the key."""
        width = int(config.kv_lora_rank) + int(config.qk_rope_head_dim)
        index = int(config.index_head_dim)
        return [(1, width + (index if t == "full" else 0)) for t in indexer_types(config)]


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-5: V3.2's computation with the indexer's rope on (even, odd) pairs and "shared"
    layers (`indexer_types`) that reuse the last full layer's choice."""

    neox_index_rope = False
