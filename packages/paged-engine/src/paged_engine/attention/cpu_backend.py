"""The CPU backend: batched varlen paged attention from torch ops, no per-sequence loop.

Sequence lengths are known on the host before the forward, so `build_metadata` turns them once
per step into a `CpuPlan` of index tensors and masks; every layer then runs the same few ops:

    write_kv   one index_copy_ per cache (padding slots -1 filtered once, in the plan)
    attend     per row group (decode rows, prefill / chunked-prefill rows): gather the group's
               K/V from the cache into [Hkv, S, L, D], one scaled_dot_product_attention over
               all its sequences and heads, scatter the rows back

Cache layout: [num_kv_heads, num_blocks, block_size, head_dim] (head planes, so a gather by slot
yields [Hkv, S*L, D] contiguous, the layout SDPA reads fastest). Grouped-query heads are folded
into the query dimension: query head kv*G + h attends as row (j*G + h) of KV head kv, so K/V are
never expanded. Everything stays in the model's dtype (SDPA accumulates in fp32).

An fp8 cache (kv_cache_dtype fp8 / fp8_e5m2) is written as the torch reference quantizes
(`ref_quantize`: x / scale, saturated, round to nearest even: the same bits) and the gathered
K/V are dequantized from their bits (`fp8_to_float`, exact and ~4x faster than torch's fp8
cast on CPU), times the layer's k_scale / v_scale, then cast to the query's dtype.

Attention sinks (gpt-oss: a raw logit per query head in each row's softmax denominator) keep
SDPA: its CPU flash kernel also returns each row's log-sum-exp, and the sink then scales the
row by e^lse / (e^lse + e^sink) = sigmoid(lse - sink) (`_sdpa`). The explicit-score paths
(soft cap, ALiBi, `attend_decode`) append the sink as one more score column and drop its
probability. Without sinks every path runs as before, bit for bit.

`attend_decode` is a decode step (every row one new token) written for `torch.compile` to trace
(worker/cpu_compile.py): the write, a gather of each sequence's whole blocks, two batched
matmuls and a masked softmax, which inductor runs from its generated code beside the layer's
other ops, where `attend` costs ~100-200 us of Python and dispatch a layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from paged_engine.attention.backend import AttentionBackend, AttentionMetadata, HostLengths
from paged_engine.attention.cpu_plan import (
    FULL,
    CpuPlan,
    LocalRange,
    RowGroup,
    build_plan,
    write_index,
)
from paged_kernels import FP8_DTYPES, check_kv_scales, fp8_to_float, ref_quantize

BATCH_INVARIANT_KV_MULTIPLE = 512


@dataclass(slots=True)
class DecodeRows:
    """`attend_decode`'s inputs: a step of S sequences that each add one token."""

    block_tables: torch.Tensor  # [S, B] int64, B >= 2 blocks covering every row, padding 0
    seq_lens: torch.Tensor  # [S] int64: each row's context, its new token included
    slots: torch.Tensor  # [S] int64 >= 0: where each new token's K/V go

    @classmethod
    def from_metadata(cls, md: AttentionMetadata, block_size: int) -> DecodeRows | None:
        """The step's rows, or None unless every row is one token that writes its K/V."""
        num_rows = md.seq_lens.shape[0]
        slots = md.slot_mapping
        if md.max_seqlen_q != 1 or slots.shape[0] != num_rows or bool((slots < 0).any()):
            return None
        # At least 2 blocks: a traced graph keeps B symbolic only from 2 up (dynamo
        # specializes sizes 0 and 1); keys past a row's length are masked, padding blocks too.
        num_blocks = max(2, -(-md.max_seqlen_k // block_size))
        tables = torch.zeros(num_rows, num_blocks, dtype=torch.int64)
        width = min(num_blocks, md.block_tables.shape[1])
        tables[:, :width] = md.block_tables[:, :width]
        return cls(tables, md.seq_lens.long(), slots.long())


class CpuBackend(AttentionBackend):
    name = "cpu"
    cuda_graph_capturable = False

    def __init__(self, batch_invariant: bool = False) -> None:
        # Batch invariance: SDPA's CPU kernel walks keys in blocks of min(L, 512) and reduces
        # each block's softmax with a vector tail that depends on the block's length, so the
        # keys of every group are padded to a multiple of 512: every block is then a full
        # 512 keys, and blocks past a row's context are fully masked (exact no-ops).
        self.kv_multiple = BATCH_INVARIANT_KV_MULTIPLE if batch_invariant else 1
        # (slot_mapping, slots to write, rows they come from or None for all): one per step.
        self._write_memo: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (num_kv_heads, num_blocks, block_size, head_dim)

    def build_metadata(self, *, host: HostLengths | None = None, **tensors) -> AttentionMetadata:
        md = super().build_metadata(**tensors)
        if md.block_tables.device.type != "cpu":
            raise ValueError(f"the cpu attention backend got {md.block_tables.device} tensors")
        md.plan = build_plan(md, host, self.kv_multiple)
        self._write_memo = (md.slot_mapping, md.plan.write_slots, md.plan.write_rows)
        return md

    def _plan(self, md: AttentionMetadata) -> CpuPlan:
        """The step's plan; built on first use for metadata made without `build_metadata`."""
        if md.plan is None:
            md.plan = build_plan(md, None, self.kv_multiple)
        return md.plan

    def write_kv(
        self, key, value, key_cache, value_cache, slot_mapping, *, k_scale=1.0, v_scale=1.0
    ) -> None:
        # key, value: [T, Hkv, D]; caches: [Hkv, num_blocks, block_size, D]
        check_kv_scales(key_cache.dtype, k_scale, v_scale)
        memo = self._write_memo
        if memo is None or memo[0] is not slot_mapping:  # metadata not from build_metadata
            memo = self._write_memo = (slot_mapping, *write_index(slot_mapping.numpy()))
        _, slots, rows = memo
        for src, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
            if rows is not None:
                src = src.index_select(0, rows)
            planes = cache.view(cache.shape[0], -1, cache.shape[-1])
            src = src.transpose(0, 1)
            if cache.dtype in FP8_DTYPES:
                planes, src = _bytes(planes), _bytes(ref_quantize(src, cache.dtype, scale))
            elif src.dtype != cache.dtype:
                src = src.to(cache.dtype)
            planes.index_copy_(1, slots, src)

    def attend(
        self,
        query: torch.Tensor,  # [T, H, D]
        key_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, D]
        value_cache: torch.Tensor,
        md: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None,
        soft_cap: float | None,
        attention_chunk_size: int | None = None,
        alibi_slopes: torch.Tensor | None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sinks: torch.Tensor | None = None,  # [H] float
    ) -> torch.Tensor:  # [T, H, D]
        check_kv_scales(key_cache.dtype, k_scale, v_scale)
        if sinks is not None and sinks.shape != (query.shape[1],):
            raise ValueError(f"sinks must be [num_heads={query.shape[1]}], got {sinks.shape}")
        plan = self._plan(md)
        num_kv_heads, head_dim = key_cache.shape[0], key_cache.shape[-1]
        group = query.shape[1] // num_kv_heads
        groups = plan.groups(key_cache.shape[2])
        local = LocalRange(sliding_window or 0, attention_chunk_size or 0)
        if (
            len(groups) == 1
            and groups[0].q_len == 1
            and groups[0].dst is None
            and groups[0].q_last is None
            and key_cache.dtype == query.dtype
            and not (sliding_window or attention_chunk_size or soft_cap or self.kv_multiple > 1)
            and alibi_slopes is None
        ):
            return self._decode(query, key_cache, value_cache, groups[0], scale, sinks)
        k_rows = key_cache.view(-1, head_dim)  # [Hkv * slots, D]: head planes one after another
        v_rows = value_cache.view(-1, head_dim)
        slots_per_head = k_rows.shape[0] // num_kv_heads
        outs = []
        for g in groups:
            q = g.fold_queries(query, num_kv_heads, group)  # [Hkv, S, Q*G, D]
            shape = (num_kv_heads, g.num_seqs, g.kv_len, head_dim)
            rows = g.head_kv_index(num_kv_heads, slots_per_head)
            k = read_rows(k_rows.index_select(0, rows).view(shape), k_scale, query.dtype)
            v = read_rows(v_rows.index_select(0, rows).view(shape), v_scale, query.dtype)
            if soft_cap or alibi_slopes is not None:
                mask = g.mask(local, group)  # [1, S, Q*G or 1, L] bool
                o = _attend_math(q, k, v, mask, g, scale, soft_cap, alibi_slopes, group, sinks)
            else:
                # Batch invariance keeps the mask always: one row, one code path in SDPA.
                exact = self.kv_multiple > 1
                masked = g.mask if exact else g.sdpa_mask
                mask = masked(local, group)
                o = _sdpa(q, k, v, mask, scale, sinks)
            outs.append(g.unfold_rows(o, group))  # [rows, H, D]
        return plan.scatter(outs, query)

    @staticmethod
    def _decode(
        query: torch.Tensor,  # [S, H, D]: one row per sequence, in order
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        g: RowGroup,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`attend` for a step of decode rows only in one group, with the cache in the query's
        dtype and nothing SDPA cannot express: the same ops on the same strides as the general
        path (the same bits), without its per-group bookkeeping (~20 us a layer)."""
        num_kv_heads, head_dim = key_cache.shape[0], key_cache.shape[-1]
        num_seqs, num_heads = query.shape[0], query.shape[1]
        group = num_heads // num_kv_heads
        rows = g.head_kv_index(num_kv_heads, key_cache.shape[1] * key_cache.shape[2])
        shape = (num_kv_heads, num_seqs, g.kv_len, head_dim)
        k = key_cache.view(-1, head_dim).index_select(0, rows).view(shape)
        v = value_cache.view(-1, head_dim).index_select(0, rows).view(shape)
        q = query.view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1)
        mask = g.sdpa_mask(FULL, group)
        o = _sdpa(q, k, v, mask, scale, sinks)
        return o.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)

    @staticmethod
    def attend_decode(
        query: torch.Tensor,  # [S, H*D]
        key: torch.Tensor,  # [S, Hkv*D]
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, D], not fp8
        value_cache: torch.Tensor,
        rows: DecodeRows,
        *,
        scale: float,
        sliding_window: int | None,
        soft_cap: float | None,
        attention_chunk_size: int | None = None,
        sinks: torch.Tensor | None = None,  # [H] float
    ) -> torch.Tensor:  # [S, H*D]
        """`write_kv` + `attend` of a decode step (one token per row), in ops `torch.compile`
        traces: row s (position seq_lens[s] - 1) attends to its keys 0 .. seq_lens[s] - 1
        (within the window or attention chunk), gathered by whole blocks; scores and softmax in
        fp32 as `_attend_math`, sinks too. No fp8 cache, no ALiBi (the compiled forward keeps those
        layers on the opaque operator)."""
        num_kv_heads, num_blocks, block_size, head_dim = key_cache.shape
        num_rows = query.shape[0]
        group = query.shape[-1] // (num_kv_heads * head_dim)
        for src, cache in ((key, key_cache), (value, value_cache)):
            planes = cache.view(num_kv_heads, num_blocks * block_size, head_dim)
            src = src.view(num_rows, num_kv_heads, head_dim).transpose(0, 1).to(cache.dtype)
            planes.index_copy_(1, rows.slots, src)
        k = key_cache[:, rows.block_tables].flatten(2, 3)  # [Hkv, S, B*block_size, D]
        v = value_cache[:, rows.block_tables].flatten(2, 3)
        # query head kv*G + g of row s -> [kv, s, g]
        q = query.view(num_rows, num_kv_heads, group, head_dim).transpose(0, 1)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [Hkv, S, G, L]
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        last = (rows.seq_lens - 1).view(1, num_rows, 1, 1)  # each row's query position
        key_pos = torch.arange(k.shape[2])
        visible = key_pos <= last
        if sliding_window:
            visible = visible & (last - key_pos < sliding_window)
        if attention_chunk_size:
            visible = visible & (key_pos >= last - last % attention_chunk_size)
        probs = _softmax(scores.masked_fill(~visible, float("-inf")), sinks)
        out = torch.matmul(probs, v.float()).to(query.dtype)  # [Hkv, S, G, D]
        return out.transpose(0, 1).reshape(num_rows, num_kv_heads * group * head_dim)

    def copy_blocks(self, key_caches, value_caches, mapping) -> None:
        if mapping.numel() == 0:
            return
        src, dst = mapping[:, 0], mapping[:, 1]
        for cache in (*key_caches, *value_caches):
            cache = _bytes(cache)
            cache[:, dst] = cache[:, src]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as uint8 (torch's CPU index_copy_ / index_put_ have no fp8 kernels)."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def read_rows(kv: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache entries in the query's dtype: an fp8 cache's dequantized (times scale)."""
    if kv.dtype in FP8_DTYPES:
        return fp8_to_float(kv, scale).to(dtype)
    return kv.to(dtype)


def _attend_math(
    q: torch.Tensor,  # [Hkv, S, Q*G, D]
    k: torch.Tensor,  # [Hkv, S, L, D]
    v: torch.Tensor,
    mask: torch.Tensor,  # [1, S, Q*G or 1, L]
    g: RowGroup,
    scale: float,
    soft_cap: float | None,
    alibi_slopes: torch.Tensor | None,
    group: int,
    sinks: torch.Tensor | None = None,  # [H] float
) -> torch.Tensor:
    """Explicit scores in fp32, for what SDPA cannot express (tanh soft cap, ALiBi)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    if alibi_slopes is not None:
        num_kv_heads = q.shape[0]
        dist = g.key_distance(group)  # [S, Q*G, L] float32: key pos - query pos
        slopes = alibi_slopes.float().view(num_kv_heads, 1, 1, group)
        slopes = slopes.expand(num_kv_heads, 1, dist.shape[1] // group, group).reshape(
            num_kv_heads, 1, -1, 1
        )
        scores = scores + slopes * dist
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = _softmax(scores, sinks).nan_to_num_(0.0)  # fully masked padding rows -> 0
    return torch.matmul(probs, v.float()).to(q.dtype)


def _sink_logits(sinks: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """[H] -> [Hkv, S, R, 1] fp32 for rows folded as [Hkv, S, R = Q*G]: row j*G + h of KV
    head kv is query head kv*G + h."""
    num_kv_heads, num_seqs, rows = shape
    group = sinks.shape[0] // num_kv_heads
    sink = sinks.float().view(num_kv_heads, 1, 1, group)
    sink = sink.expand(num_kv_heads, num_seqs, rows // group, group)
    return sink.reshape(num_kv_heads, num_seqs, rows, 1)


def _softmax(
    scores: torch.Tensor,  # [Hkv, S, R, L] fp32, masked keys -inf
    sinks: torch.Tensor | None,  # [H] float
) -> torch.Tensor:  # [Hkv, S, R, L] fp32
    """Softmax over the keys, and with sinks over one more column holding the row's sink,
    whose probability is then dropped."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = _sink_logits(sinks, scores.shape[:3])
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def _sdpa(
    q: torch.Tensor,  # [Hkv, S, R, D]
    k: torch.Tensor,  # [Hkv, S, L, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # bool, broadcast to [Hkv, S, R, L]; None = all visible
    scale: float,
    sinks: torch.Tensor | None,  # [H] float
) -> torch.Tensor:  # [Hkv, S, R, D]
    """SDPA; with sinks its CPU flash kernel, which also gives each row's fp32 log-sum-exp
    (the kernel SDPA runs here: the same output bits), scaled by sigmoid(lse - sink)."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if mask is not None:  # the additive mask SDPA makes of a boolean one
        mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, attn_mask=mask, scale=scale
    )  # lse: [Hkv, S, R] fp32
    keep = torch.sigmoid(lse.unsqueeze(-1) - _sink_logits(sinks, lse.shape))
    return (out.float() * keep).to(q.dtype)
