"""Gated SiLU of a fused gate/up projection: silu(gate) * up in one kernel (torch runs two and
writes silu(gate) out in between).

Roundings are torch's: silu in fp32, rounded to x's dtype, times up, rounded again (fp32 models
keep fp32 throughout). silu(g) = g / (1 + exp(-g)); Triton's exp may differ from the CUDA math
library's in the last fp32 bit, which a 16-bit rounding almost always absorbs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_kernels._utils import FLOAT_DTYPES, INTERPRETED, check, next_pow2


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2I]: gate | up
    out_ptr,  # [T, I]
    stride_x,
    stride_o,
    inter,
    BLOCK: tl.constexpr,
    ROUND_SILU: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inter
    g = tl.load(x_ptr + t * stride_x + offs, mask=ok, other=0.0)
    dtype = g.dtype
    g = g.to(tl.float32)
    u = tl.load(x_ptr + t * stride_x + inter + offs, mask=ok, other=0.0).to(tl.float32)
    s = g / (1.0 + tl.exp(-g))
    if ROUND_SILU:
        s = s.to(dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, (s * u).to(dtype), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] holding (gate | up) -> silu(gate) * up [..., I]."""
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}")
    check(x.dim() >= 1 and x.shape[-1] % 2 == 0, "x's last dim must be even: gate | up")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    if x2.shape[0] and inter:
        # one program a row under the interpreter (it runs programs one by one)
        block = next_pow2(inter) if INTERPRETED else min(1024, next_pow2(inter))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2,
            out,
            x2.stride(0),
            out.stride(0),
            inter,
            BLOCK=block,
            ROUND_SILU=x.dtype != torch.float32,
            num_warps=1 if INTERPRETED else 4,
        )
    return out.view(*x.shape[:-1], inter)
