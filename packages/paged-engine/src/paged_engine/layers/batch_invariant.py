"""Batch-invariant matmuls on CPU: a row's result never depends on the other rows of the batch.

A CPU GEMM's reduction order depends on the problem's shape: with M = 1 it runs a GEMV,
with other row counts other blockings (measured with torch 2.13 on fp32: row 0 of x @ W^T
differs between M = 1, M = 2..255 and M >= 256 for K = 1536). Within one fixed shape every row
is computed the same way wherever it sits. So every linear layer runs on tiles of exactly
TILE_ROWS rows (the last one zero-padded): fp32 as one bmm over the tiles against the weight
broadcast (the same per-tile result for any number of tiles), other dtypes as one matmul per
tile. The bias is added afterwards, elementwise. Attention does its part in the CPU backend
(keys padded to a fixed multiple, see attention/cpu_plan.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TILE_ROWS = 32


class BatchInvariantLinear:
    """`linear_method` of a layer whose rows must not depend on the batch."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = layer.weight  # [N, K]
        m, k = x.shape
        pad = -m % TILE_ROWS
        tiles = (F.pad(x, (0, 0, 0, pad)) if pad else x).view(-1, TILE_ROWS, k)
        if x.dtype == torch.float32:
            wt = w.t()
            out = torch.bmm(tiles, wt.expand(tiles.shape[0], *wt.shape))
        else:  # bf16 / fp16 bmm changes its blocking with the batch: one call per tile
            out = torch.stack([F.linear(t, w) for t in tiles.unbind(0)])
        out = out.view(-1, w.shape[0])[:m]
        return out if bias is None else out + bias


def make_batch_invariant(model: nn.Module) -> None:
    """Route every linear layer and the LM head through BatchInvariantLinear."""
    from paged_engine.layers.embedding import ParallelLMHead
    from paged_engine.layers.linear import LinearBase

    method = BatchInvariantLinear()
    for module in model.modules():
        if isinstance(module, (LinearBase, ParallelLMHead)):
            if module.linear_method is not None:
                raise ValueError("batch_invariant=True does not combine with quantization")
            module.linear_method = method
