"""Token bitmasks: which tokens a grammar allows next, 32 tokens per int32 word.

    bitmask [R, W] int32, W = ceil(V / 32): token t of row r is allowed iff
    (bitmask[r, t // 32] >> (t % 32)) & 1

xgrammar and llguidance both fill this layout. The sampler applies every constrained row's mask
in one batched op (`apply_token_bitmask`), on whatever device the logits live: the bitmask is
read as bytes (little-endian: token 8b + j is bit j of byte b), each byte looked up in a
[256, 8] table of 0 / -inf, and the result added to the rows' logits. (On CPUs a bool
`masked_fill` over [32, 49152] takes ~10 ms; the table and one `index_add_` take ~1.5 ms.)
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from torch import Tensor

assert sys.byteorder == "little", "the byte view of the bitmask assumes little-endian words"

_BIAS_TABLES: dict[torch.device, Tensor] = {}


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """[num_rows, W] int32, every token allowed (all bits set)."""
    return np.full((num_rows, bitmask_width(vocab_size)), -1, dtype=np.int32)


def _bias_table(device: torch.device) -> Tensor:
    """[256, 8] float32: entry [b, j] is 0 when bit j of byte value b is set, else -inf."""
    table = _BIAS_TABLES.get(device)
    if table is None:
        bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
        table = _BIAS_TABLES[device] = torch.where(bits.bool(), 0.0, float("-inf")).to(device)
    return table


def bitmask_bias(bitmask: Tensor, vocab_size: int) -> Tensor:
    """[R, W] int32 -> [R, vocab_size] float32: 0 where allowed, -inf where not; tokens past
    the bitmask's last word are disallowed."""
    rows = bitmask.shape[0]
    as_bytes = bitmask.contiguous().view(torch.uint8).reshape(-1)
    bias = _bias_table(bitmask.device).index_select(0, as_bytes.int()).view(rows, -1)
    if bias.shape[1] >= vocab_size:
        return bias[:, :vocab_size]
    pad = bias.new_full((rows, vocab_size - bias.shape[1]), float("-inf"))
    return torch.cat([bias, pad], dim=1)


def apply_token_bitmask(logits: Tensor, rows: Tensor, bitmask: Tensor) -> None:
    """Mask (to -inf) every token the bitmask disallows, in place, for `rows` of `logits`.

    logits: [N, V] float32; rows: [R] int64 distinct rows of logits; bitmask: [R, W] int32.
    Logits must be finite or -inf (never +inf: +inf - inf would be NaN)."""
    assert bitmask.dim() == 2 and bitmask.shape[0] == rows.shape[0], (bitmask.shape, rows.shape)
    assert bitmask.dtype == torch.int32, bitmask.dtype
    logits.index_add_(0, rows, bitmask_bias(bitmask, logits.shape[1]))
