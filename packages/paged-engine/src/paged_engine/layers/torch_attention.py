"""Attention computed in plain torch over the paged cache, for layers whose choice of keys no
kernel runs yet: Kolibri 1.1's indexed attention (models/kolibri.py), DeepSeek Sparse Attention
off CUDA (models/deepseek_v32.py and the models built on it; on CUDA paged_kernels'
sparse_mla.py runs it) and GLM-5.3-Flash's pooled choice everywhere (models/glm5_next.py),
DeepSeek-V4's compressed attention (models/deepseek_v4.py), Qwen4-Exp's QSA (models/qwen4_exp.py).

Such a layer reads its sequences' rows back from the cache (`block_view`, `gather`, and the CPU
backend's `read_rows`), picks keys (`top_k_mask`) and attends over them in float32 (`attend`),
one sequence (and block of query rows) at a time: a reference path, quadratic in the context
as transformers' is. It writes its own cache rows, and under a compiled forward it runs as an
opaque operator (`TorchAttention`). The choice reads the batch's lengths on the host, so CUDA
graphs cannot capture it: each such model refuses them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from paged_engine.attention.backend import AttentionBackend
from paged_engine.layers import compiled_ops


class TorchAttention:
    """Mixin for an attention layer (layers/attention.py's `Attention` or `LatentAttention`)
    whose `run(q, k, v, kv_cache, attn_metadata)` writes its rows and attends in torch: no
    fused K/V write, and `run` inside a compiled forward through the opaque operator."""

    op_handle: int | None

    def fused_kv_write(self, kv_cache, attn_metadata) -> None:
        return None

    def forward(self, q, k, v, kv_cache, attn_metadata, kv_written=False) -> torch.Tensor:
        if self.op_handle is not None and torch.compiler.is_compiling():
            return compiled_ops.attention(q, k, v, self.op_handle)  # runs `run`
        return self.run(q, k, v, kv_cache, attn_metadata)

    def run(self, q, k, v, kv_cache, attn_metadata) -> torch.Tensor:
        raise NotImplementedError


def top_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[R, N] -> the mask of each row's k highest finite scores, ties to the lowest index."""
    k = min(k, scores.shape[-1])
    kth = scores.topk(k, dim=-1).values[..., -1:]
    above = scores > kth
    tied = (scores == kth) & (kth > float("-inf"))
    rank = tied.cumsum(-1, dtype=torch.int32)  # 1-based among a row's ties
    return above | (tied & (rank <= k - above.sum(-1, keepdim=True)))


def block_view(cache: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
    """A layer's key or value cache as [num_blocks, block_size, Hkv, D], whatever the
    backend's layout (its `kv_cache_shape` names the axes)."""
    probe = backend.kv_cache_shape(2, 3, 5, 7)
    if sorted(probe) != [2, 3, 5, 7]:
        raise ValueError(f"indexed attention cannot read the {backend.name} backend's KV cache")
    return cache.permute([probe.index(n) for n in (2, 3, 5, 7)])


def step_sequences(md, block_size: int) -> Iterator[tuple[int, int, int, int, torch.Tensor]]:
    """Each sequence with query rows this step (`md`: the step's AttentionMetadata): its index
    s, its rows [first, end) of the step, its length in keys and the ids of the blocks that
    hold them (reads the lengths on the host)."""
    starts, lens = md.cu_seqlens_q.tolist(), md.seq_lens.tolist()
    for s, length in enumerate(lens):
        first, end = starts[s], starts[s + 1]
        if first != end:
            yield s, first, end, length, md.block_tables[s, : -(-length // block_size)]


def gather(view: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """A sequence's first `length` entries of a `block_view` [num_blocks, block_size, ...]."""
    return view[blocks].flatten(0, 1)[:length]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [R, H, D] over keys / values [L, Hkv, D] where keep [R, L], in float32 -> [R, H, D]."""
    r, h, d = q.shape
    qg = q.float().view(r, k.shape[1], -1, d)  # [R, Hkv, G, D]
    scores = torch.einsum("rkgd,lkd->rkgl", qg, k.float()) * scale
    scores = scores.masked_fill(~keep[:, None, None], float("-inf"))
    out = torch.einsum("rkgl,lkd->rkgd", torch.softmax(scores, dim=-1), v.float())
    return out.reshape(r, h, d).to(q.dtype)
