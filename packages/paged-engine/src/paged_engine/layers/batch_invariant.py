"""batch_invariant=True: a row's result never depends on the other rows of the batch.

Two kernel sets, picked by the attention backend:

- "cpu" (the CPU backend). A CPU GEMM's reduction order depends on the problem's shape: with
  M = 1 it runs a GEMV, with other row counts other blockings (measured with torch 2.13 on fp32:
  row 0 of x @ W^T differs between M = 1, M = 2..255 and M >= 256 for K = 1536). Within one fixed
  shape every row is computed the same way wherever it sits. So every linear layer runs on tiles
  of exactly TILE_ROWS rows (the last one zero-padded): fp32 as one bmm over the tiles against
  the weight broadcast (the same per-tile result for any number of tiles). The bias is added
  afterwards, elementwise. Logprobs' log-sum-exp never reduces a single row (`cpu_logsumexp`);
  norms reduce rows too short to be split between threads. Float32 only: bf16 CPU matmuls
  still vary.
- "triton" (the Triton backend: CUDA, or the interpreter on CPU). cuBLAS and torch's CUDA
  reductions choose split-K and threads per row from the shape, so every linear layer and the LM
  head run paged_kernels.matmul (one fixed tile config, no split-K), RMSNorm / LayerNorm run
  paged_kernels.rms_norm / layer_norm (one program per row) and logprobs use
  paged_kernels.logsumexp. Any float dtype.

Attention does its part in its backend (fixed key padding on CPU, attention/cpu_plan.py; a fixed
tile config and no split-KV in the Triton kernel). Elementwise ops are row-local everywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.attention import resolve_backend_name
from paged_engine.sample.logprobs import LogSumExp, torch_logsumexp

TILE_ROWS = 32


class BatchInvariantLinear:
    """`linear_method` of a layer whose rows must not depend on the batch (CPU tiles)."""

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


class TritonInvariantLinear:
    """`linear_method` running paged_kernels.matmul (fixed tiles, no split-K)."""

    def __init__(self) -> None:
        from paged_kernels import matmul

        self._matmul = matmul

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._matmul(x, layer.weight, bias)


def invariant_kernels(attention_backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """The kernel set ("cpu" or "triton") batch_invariant=True uses with this backend, device
    and dtype; a ValueError naming what to change where there is none."""
    name = resolve_backend_name(attention_backend, device)
    if name == "cpu" and dtype != torch.float32:
        raise ValueError(
            f"batch_invariant=True on the CPU backend runs in float32 only (dtype resolved to "
            f"{dtype}): pass dtype='float32', or attention_backend='triton' for the Triton "
            "kernels (on a CPU they run in Triton's interpreter: slow)"
        )
    if name not in ("cpu", "triton"):
        raise ValueError(
            f"batch_invariant=True needs attention_backend 'cpu' or 'triton'; got {name!r} on "
            f"{device.type} (the torch reference has no fixed-reduction-order mode)"
        )
    return name


def make_batch_invariant(model: nn.Module, kernels: str) -> None:
    """Route every linear layer and the LM head (and with "triton" every norm) through the
    fixed-order kernels of `kernels` ("cpu" or "triton", from `invariant_kernels`)."""
    from paged_engine.layers.attention import LatentAttention
    from paged_engine.layers.embedding import ParallelLMHead
    from paged_engine.layers.fused_moe import FusedMoE
    from paged_engine.layers.linear import LinearBase
    from paged_engine.layers.norm import LayerNorm, RMSNorm, rms_norm_kernel

    if any(isinstance(m, FusedMoE) for m in model.modules()):
        # An expert's matmul runs over the tokens routed to it: its shape depends on the batch.
        raise ValueError(
            f"batch_invariant=True does not support mixture-of-experts models "
            f"({type(model).__name__})"
        )
    if any(isinstance(m, LatentAttention) for m in model.modules()):
        # MLA's absorbed query / output products are batched matmuls over the step's tokens.
        raise ValueError(
            f"batch_invariant=True does not support multi-head latent attention models "
            f"({type(model).__name__})"
        )
    method = TritonInvariantLinear() if kernels == "triton" else BatchInvariantLinear()
    if kernels == "triton":
        from paged_kernels import layer_norm
    for module in model.modules():
        if isinstance(module, (LinearBase, ParallelLMHead)):
            if module.linear_method is not None:
                raise ValueError("batch_invariant=True does not combine with quantization")
            module.linear_method = method
        elif kernels == "triton" and isinstance(module, RMSNorm):
            module.kernel = rms_norm_kernel(module)  # Gemma's and OLMo 2's roundings kept
        elif kernels == "triton" and isinstance(module, LayerNorm):
            module.kernel = layer_norm


def cpu_logsumexp(raw: torch.Tensor) -> torch.Tensor:
    """torch's logsumexp, never over a single row. A CPU reduction with one output and more
    than one thread runs two-pass, splitting the row between threads; with two or more outputs
    each thread reduces whole rows, the same way for any row count (measured with torch 2.13,
    2 threads, [1, 49152]: the single row differed from the same row in a batch in 8 of 200
    draws; padded to two rows, in none). So one row is reduced next to a copy of itself."""
    if raw.shape[0] == 1 and torch.get_num_threads() > 1:
        return torch_logsumexp(torch.cat([raw, raw]))[:1]
    return torch_logsumexp(raw)


def invariant_logsumexp(kernels: str | None) -> LogSumExp:
    """The logprobs' log-sum-exp for a kernel set (None: batch_invariant=False)."""
    if kernels == "triton":
        from paged_kernels import logsumexp

        return logsumexp
    return cpu_logsumexp if kernels == "cpu" else torch_logsumexp
