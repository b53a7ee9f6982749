"""Row log-sum-exp with a fixed reduction order, for logprobs over a vocabulary.

torch's CUDA logsumexp is a max and a sum through its generic reduction, which splits a long row
over several blocks when there are few rows: a row's sum then changes with the batch. Here one
program owns one row and walks it in BLOCK-wide chunks from 0: an elementwise running max, then
a running sum of exp(x - max), each folded by one tl.max / tl.sum at the end. The order depends
on the row length only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_kernels._utils import FLOAT_DTYPES, check, is_interpreter

BLOCK = 1024


@triton.jit
def _logsumexp_kernel(x_ptr, out_ptr, stride_x, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, N, BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < N, other=float("-inf"))
        top = tl.maximum(top, x.to(tl.float32))
    mx = tl.max(top, 0)
    finite = (mx > float("-inf")) & (mx < float("inf"))
    shift = tl.where(finite, mx, 0.0)  # all -inf: sum 0, log -inf; any +inf: result +inf
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, N, BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < N, other=float("-inf"))
        acc += tl.exp(x.to(tl.float32) - shift)
    tl.store(out_ptr + row, tl.log(tl.sum(acc, 0)) + shift)


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """`x.float().logsumexp(-1, keepdim=True)` of a [rows, N] tensor, batch-invariant: [rows, 1]
    fp32. NaN rows give NaN, rows holding +inf give +inf, all -inf rows give -inf."""
    check(x.dim() == 2, f"x must be [rows, N], got {tuple(x.shape)}")
    check(x.dtype in FLOAT_DTYPES, f"unsupported dtype {x.dtype}")
    check(x.shape[1] > 0, "rows must not be empty")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _logsumexp_kernel[(x.shape[0],)](
            x, out, x.stride(0), x.shape[1], BLOCK=BLOCK, num_warps=1 if is_interpreter() else 4
        )
    return out
