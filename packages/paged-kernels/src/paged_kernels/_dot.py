"""The tile product of the batch-invariant kernels, with an interpreter path that keeps rows apart.

On a GPU every output element of a tl.dot goes through the same instructions wherever its row
sits in the tile. Triton's interpreter hands tl.dot to numpy's BLAS, whose micro-kernels sum a
row differently depending on its position in the tile (measured: fp32 rows at tile positions
3-8 vs 0-2), and which multiplies raw bf16 bits. EXPLICIT (set only under the interpreter) sums
the elementwise products with tl.sum instead: the same order for every row, in fp32.

`round_bf16`: the interpreter's fp32 -> bf16 cast truncates where the GPU's rounds to nearest;
kernels storing bf16 round with it first under the interpreter (lora.py, moe.py).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_dot(a, b, acc, PRECISION: tl.constexpr, EXPLICIT: tl.constexpr):
    """acc + a @ b, accumulated in fp32."""
    if EXPLICIT:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def round_bf16(x):
    """fp32 x rounded to the nearest bf16 value (ties to even), kept in fp32, for finite x: the
    interpreter's own fp32 -> bf16 cast truncates, the GPU's rounds to nearest even."""
    bits = x.to(tl.uint32, bitcast=True)
    bits += 0x7FFF + ((bits >> 16) & 1)
    return ((bits >> 16) << 16).to(tl.float32, bitcast=True)
