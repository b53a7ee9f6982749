"""Qwen4-Exp's Per-Layer Embedding (PLE, transformers' `Qwen4ExpTextPLELayer`) over paged
state, and the grouped (1 + w) RMSNorm it shares with the hyper-connections (models/qwen4_exp.py).

A PLE layer adds to each of the hc_count residual streams ([T, n * D]) a value of hashed
n-grams, as transformers runs it:

    ids        each token and its ngram_size - 1 predecessors, a predecessor across an eos token
               (or before the sequence) read as eos; for order k = 2..ngram_size the XOR of
               the first k ids times per-layer odd multipliers (splitmix64 of seed + 10007 *
               the layer's PLE index), modulo heads_per_ngram prime table sizes (the primes from
               ngram_vocab_size_base on, each PLE layer continuing after the previous ones),
               offset into one table (rows padded to make_ngram_vocab_size_divisible_by)
    gate       the heads' rows concatenated (E = ple_embed_dim) give one value v = value_proj(e)
               and a key per stream; g_i = (norm(key_i) . norm(stream_i)) / sqrt(D), then
               sign(g) * sqrt(max(|g|, 1e-6)); stream i gets sigmoid(g_i) * v
    conv       plus silu of a depthwise conv of width ple_conv_kernel_size dilated by ngram_size
               over the normalized gated values (per-stream norm_conv), causal

State per sequence (worker/recurrent_state.py's pools): conv_state [slots, n * D, W] the conv's
last W = (K - 1) * ngram_size inputs; ssm_state [slots, ngram_size - 1] int64 the last token
ids. A sequence starting at position 0 starts from zeros and eos ids. Tensor parallelism: the
projections are replicated, the table split by rows (VocabParallelEmbedding); checkpoints hold
it as split_ngram_parts `torch.chunk` pieces (`ngram_embedding.shard_<i>.weight`), loaded in
place, or whole.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.attention import AttentionMetadata
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.linear import ColumnParallelLinear
from paged_engine.layers.linear_mixer import DepthwiseConv, LinearMixer
from paged_engine.models.utils import cfg_get


def replicated(n_in: int, n_out: int) -> ColumnParallelLinear:
    """A bias-free linear layer every tensor-parallel rank holds whole."""
    return ColumnParallelLinear(n_in, n_out, False, 0, 1)


class GroupRMSNorm(nn.Module):
    """(1 + w) RMSNorm over each `group`-wide slice of the last dim, in float32."""

    def __init__(self, size: int, group: int, eps: float) -> None:
        super().__init__()
        self.group, self.eps = group, eps
        self.weight = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size]
        xf = x.float().unflatten(-1, (-1, self.group))
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


def _lookback(
    cur: torch.Tensor,  # [T, ...] this step's rows
    past: torch.Tensor,  # [S, W, ...] each sequence's last W rows before the step, oldest first
    seq: torch.Tensor,  # [T] each row's sequence
    local: torch.Tensor,  # [T] each row's index within its sequence's step
    offset: int,  # 1 <= offset <= W
) -> torch.Tensor:
    """Row t - offset of each row's sequence: from the step where it lies there, else from
    `past`."""
    w = past.shape[1]
    here = cur[(torch.arange(cur.shape[0], device=cur.device) - offset).clamp_min(0)]
    before = past[seq, (w + local - offset).clamp(0, w - 1)]
    inside = (local >= offset).view(-1, *[1] * (cur.dim() - 1))
    return torch.where(inside, here, before)


def _tail(cur: torch.Tensor, past: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """Each sequence's last W rows after the step ([S, W, ...]): `past` [S, W, ...] followed by
    its rows of `cur` [T, ...] (cu: [S + 1] row offsets)."""
    s, w = past.shape[:2]
    n = (cu[1:] - cu[:-1]).long()  # [S]
    src = n[:, None] - w + torch.arange(w, device=cur.device)  # [S, W] index in the step
    here = cur[(cu[:-1, None].long() + src).clamp(0, max(cur.shape[0] - 1, 0))]
    before = past[torch.arange(s, device=cur.device)[:, None], (w + src).clamp(0, w - 1)]
    inside = (src >= 0).view(s, w, *[1] * (cur.dim() - 1))
    return torch.where(inside, here, before)


_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def ngram_multipliers(vocab: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """The odd hash multiplier of each of a PLE layer's n-gram positions (transformers'
    `_build_layer_multipliers`)."""
    half = max(1, ((1 << 63) - 1) // max(vocab, 1) // 2)
    base = seed + 10007 * ple_index
    return [
        2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)
    ]


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % p for p in range(2, math.isqrt(n) + 1))


@functools.lru_cache
def _primes_from(base: int, count: int) -> tuple[int, ...]:
    """The first `count` primes >= base (the PLE layers share one list)."""
    primes: list[int] = []
    n = base
    while len(primes) < count:
        if _is_prime(n):
            primes.append(n)
        n += 1
    return tuple(primes)


def ngram_table_sizes(base: int, num_heads: int, ple_index: int) -> list[int]:
    """Each n-gram head's table size: the primes from `base` on, num_heads per PLE layer in
    layer order (a layer's heads continue after the previous layers')."""
    return list(_primes_from(base, (ple_index + 1) * num_heads)[ple_index * num_heads :])


class NGramEmbedding(nn.Module):
    """transformers' `Qwen4ExpTextNGramEmbedding`: token ids and their predecessors -> the
    concatenated rows of the hashed n-gram heads [T, ple_embed_dim]."""

    def __init__(self, config, ple_index: int, eos_id: int) -> None:
        super().__init__()
        self.ngram_size = int(config.ngram_size)
        self.per_order = int(config.heads_per_ngram)
        num_heads = (self.ngram_size - 1) * self.per_order
        self.eos_id = eos_id
        sizes = ngram_table_sizes(int(config.ngram_vocab_size_base), num_heads, ple_index)
        offsets = [sum(sizes[:i]) for i in range(num_heads)]
        mults = ngram_multipliers(config.vocab_size, self.ngram_size, ple_index, int(config.seed))
        self.register_buffer("sizes", torch.tensor(sizes), persistent=False)
        self.register_buffer("offsets", torch.tensor(offsets), persistent=False)
        self.register_buffer("multipliers", torch.tensor(mults), persistent=False)
        div = int(config.make_ngram_vocab_size_divisible_by)
        self.rows = -(-sum(sizes) // div) * div
        self.ngram_embedding = VocabParallelEmbedding(
            self.rows, int(config.ple_embed_dim) // num_heads
        )
        # checkpoints hold the table as torch.chunk(table, split_ngram_parts) pieces
        self.chunk_rows = -(-self.rows // int(config.split_ngram_parts))
        self.ngram_embedding.weight.weight_loader = self._load_rows
        # torch.chunk makes fewer pieces than split_ngram_parts when they do not divide the rows
        self.ngram_embedding.weight.shard_ids = set(range(-(-self.rows // self.chunk_rows)))

    def _load_rows(self, param: nn.Parameter, w: torch.Tensor, shard_id: int | None = None):
        """The whole table, or its checkpoint piece `shard_id` (rows from shard_id *
        chunk_rows), into this rank's rows."""
        if shard_id is None:
            self.ngram_embedding.weight_loader(param, w)
            return
        emb = self.ngram_embedding
        first = int(shard_id) * self.chunk_rows  # the piece's first row in the table
        lo = max(first, emb.vocab_start)
        hi = min(first + w.shape[0], emb.vocab_start + emb.shard_size, self.rows)
        if w.shape[1:] != param.shape[1:] or first + w.shape[0] > self.rows:
            raise ValueError(f"ngram_embedding piece {shard_id}: bad shape {tuple(w.shape)}")
        if hi > lo:
            param.data[lo - emb.vocab_start : hi - emb.vocab_start].copy_(
                w[lo - first : hi - first]
            )

    def forward(self, shifted: list[torch.Tensor]) -> torch.Tensor:
        """shifted[k]: each token's k-th predecessor id (0: itself), eos-masked; [T] each."""
        ids, mixed = [], shifted[0] * self.multipliers[0]
        for k in range(1, self.ngram_size):  # order k + 1 hashes positions 0..k
            mixed = torch.bitwise_xor(mixed, shifted[k] * self.multipliers[k])
            heads = slice((k - 1) * self.per_order, k * self.per_order)
            ids.append(torch.remainder(mixed[:, None], self.sizes[heads]) + self.offsets[heads])
        rows = self.ngram_embedding(torch.cat(ids, dim=-1).flatten())  # [T * heads, dh]
        return rows.view(len(shifted[0]), -1)


class PLELayer(LinearMixer):
    """transformers' `Qwen4ExpTextPLELayer` over paged state: conv_state [slots, n*D, W] holds
    the conv's last W = (K - 1) * ngram_size inputs, ssm_state [slots, ngram_size - 1] (int64)
    the last token ids. Returns the per-stream addition [T, n*D]."""

    def __init__(self, config, ple_index: int, eos_id: int) -> None:
        super().__init__()
        n, d, e = int(config.hc_count), config.hidden_size, int(config.ple_embed_dim)
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        self.n, self.d, self.eos_id = n, d, eos_id
        self.context = int(config.ngram_size) - 1
        self.kernel, self.dilation = int(config.ple_conv_kernel_size), int(config.ngram_size)
        self.window = (self.kernel - 1) * self.dilation
        self.ple_embedding = NGramEmbedding(config, ple_index, eos_id)
        self.key_proj = replicated(e, n * d)
        self.value_proj = replicated(e, d)
        self.norm_key = GroupRMSNorm(n * d, d, eps)
        self.norm_query = GroupRMSNorm(n * d, d, eps)
        self.norm_conv = GroupRMSNorm(n * d, d, eps)
        self.conv1d = DepthwiseConv(n * d, self.kernel, bias=False)

    def state_shapes(self, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (num_slots, self.n * self.d, self.window), (num_slots, self.context)

    def allocate_state(self, num_slots, dtype, ssm_dtype, device) -> None:
        conv, ctx = self.state_shapes(num_slots)
        self.conv_state = torch.zeros(conv, dtype=dtype, device=device)
        self.ssm_state = torch.zeros(ctx, dtype=torch.int64, device=device)  # token ids

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, md: AttentionMetadata):
        assert self.conv_state is not None and self.ssm_state is not None, "allocate_state()"
        slots, has_state = md.state_rows()
        t, cu = x.shape[0], md.cu_seqlens_q
        rows = torch.arange(t, device=x.device)
        seq = torch.searchsorted(cu[1:].long(), rows, right=True).clamp_max(len(slots) - 1)
        local = rows - cu[seq].long()
        fresh = ~has_state[:, None]
        # ---- n-gram ids: a predecessor across an eos reads as eos ----
        ids = input_ids.long()
        ctx = self.ssm_state[slots].masked_fill(fresh, self.eos_id)  # [S, ngram_size - 1]
        shifted, clear = [ids], torch.ones_like(ids, dtype=torch.bool)
        for k in range(1, self.context + 1):
            if k > 1:
                clear = clear & (shifted[-1] != self.eos_id)
            prev = _lookback(ids, ctx, seq, local, k)
            shifted.append(torch.where(clear, prev, self.eos_id))
        self.ssm_state[slots] = _tail(ids, ctx, cu)
        emb = self.ple_embedding(shifted)  # [T, E]
        # ---- per-stream gate of the shared value ----
        key = self.norm_key(self.key_proj(emb)).unflatten(-1, (self.n, self.d))
        value = self.value_proj(emb)
        query = self.norm_query(x).unflatten(-1, (self.n, self.d))
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(self.d)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)  # [T, n*D]
        normed = self.norm_conv(gated)
        # ---- causal depthwise conv, dilated, over the normalized gated values ----
        past = self.conv_state[slots].transpose(1, 2).masked_fill(fresh[..., None], 0)
        weight = self.conv1d.weight.squeeze(1)  # [C, K]; tap k reads row t - (K-1-k) * dil
        conv = normed * weight[:, -1]
        for k in range(self.kernel - 1):
            back = (self.kernel - 1 - k) * self.dilation
            conv = conv + _lookback(normed, past, seq, local, back) * weight[:, k]
        self.conv_state[slots] = _tail(normed, past, cu).transpose(1, 2)
        return gated + F.silu(conv)
