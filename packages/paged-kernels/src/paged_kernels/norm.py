"""Row norms with a fixed reduction order: RMSNorm (alone, or after a residual add) and
LayerNorm, each program normalising a tile of ROWS rows.

torch's CUDA reductions choose how many threads and blocks share a row from the tensor's shape,
so a row's sum can change with the number of rows. Here a program holds ROWS whole rows in
registers as a [ROWS, BLOCK] tile (BLOCK = the row length rounded up to a power of two) and
reduces each along axis 1 with the same tl.sum tree. ROWS and the warps come from BLOCK alone,
never from the number of rows, and rows past the end are masked: a row's result depends on that
row alone. Statistics are fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_kernels._utils import FLOAT_DTYPES, INTERPRETED, check, next_pow2

MAX_ROW = 65536
# Elements one program holds: narrow rows (q/k-norms' head rows) share a program, rows of
# TILE_ELEMENTS or more get one each.
TILE_ELEMENTS = 2048
MAX_TILE_ROWS = 64


# The kernels load their tiles inline: a nested @triton.jit call costs the interpreter
# milliseconds per program.
@triton.jit(do_not_specialize=["M"])  # the row count: one compile for all
def _rms_norm_kernel(
    x_ptr,  # [rows, N]
    w_ptr,  # [N]
    out_ptr,  # [rows, N]
    M,
    stride_x,
    stride_o,
    N,
    eps,
    weight_offset,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    ROUND_BEFORE_WEIGHT: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK)
    col_ok = offs < N
    ok = (rows < M)[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=ok, other=0.0)
    x = x.to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 1) / N + eps)[:, None]
    w = tl.load(w_ptr + offs, mask=col_ok, other=0.0).to(tl.float32) + weight_offset
    if ROUND_BEFORE_WEIGHT:  # 16-bit models: normalise, round, then scale in the model dtype
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        w = w.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(
        out_ptr + rows[:, None] * stride_o + offs[None, :],
        (y * w[None, :]).to(out_ptr.dtype.element_ty),
        mask=ok,
    )


@triton.jit(do_not_specialize=["M"])  # the row count: one compile for all
def _add_rms_norm_kernel(
    x_ptr,  # [rows, N]
    r_ptr,  # [rows, N] the residual stream
    w_ptr,  # [N]
    out_ptr,  # [rows, N] rms_norm(x + r)
    sum_ptr,  # [rows, N] x + r
    M,
    stride_x,
    stride_r,
    N,
    eps,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    ROUND_BEFORE_WEIGHT: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK)
    col_ok = offs < N
    ok = (rows < M)[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=ok, other=0.0)
    r = tl.load(r_ptr + rows[:, None] * stride_r + offs[None, :], mask=ok, other=0.0)
    dense = rows[:, None] * N + offs[None, :]  # out and sum: dense rows of N
    total = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)  # as torch's +
    tl.store(sum_ptr + dense, total, mask=ok)
    t = total.to(tl.float32)
    y = t * tl.rsqrt(tl.sum(t * t, 1) / N + eps)[:, None]
    w = tl.load(w_ptr + offs, mask=col_ok, other=0.0).to(tl.float32)
    if ROUND_BEFORE_WEIGHT:
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        w = w.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + dense, (y * w[None, :]).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["M"])  # the row count: one compile for all
def _layer_norm_kernel(
    x_ptr,  # [rows, N]
    w_ptr,  # [N], read only if HAS_WEIGHT
    b_ptr,  # [N], read only if HAS_BIAS
    out_ptr,  # [rows, N]
    M,
    stride_x,
    stride_o,
    N,
    eps,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK)
    col_ok = offs < N
    ok = (rows < M)[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=ok, other=0.0)
    x = x.to(tl.float32)
    centred = tl.where(ok, x - (tl.sum(x, 1) / N)[:, None], 0.0)
    y = centred * tl.rsqrt(tl.sum(centred * centred, 1) / N + eps)[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + offs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + offs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows[:, None] * stride_o + offs[None, :],
        y.to(out_ptr.dtype.element_ty),
        mask=ok,
    )


def _rows(x: torch.Tensor, n: int, name: str) -> torch.Tensor:
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}")
    if not (x.dim() >= 1 and x.shape[-1] == n):
        raise ValueError(f"x's last dim must be {name}'s size {n}")
    if not (0 < n <= MAX_ROW):
        raise ValueError(f"rows of {n} elements are not supported (1..{MAX_ROW})")
    x2 = x.reshape(-1, n)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _tile(block: int) -> tuple[int, int]:
    """(ROWS, num_warps) for rows of BLOCK elements: a function of the row width only (batch
    invariance), at most TILE_ELEMENTS elements a program unless one row is wider."""
    rows = min(MAX_TILE_ROWS, max(1, TILE_ELEMENTS // block))
    return rows, 1 if INTERPRETED else min(16, max(1, rows * block // 256))


def _grid(n_rows: int, tile_rows: int) -> tuple[int]:
    return ((n_rows + tile_rows - 1) // tile_rows,)


def rms_norm(
    x: torch.Tensor,  # [..., N]
    weight: torch.Tensor,  # [N]
    eps: float,
    weight_offset: float = 0.0,
    *,
    round_before_weight: bool | None = None,
) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * (weight + weight_offset), statistics in fp32, with the
    roundings of paged_engine's RMSNorm: fp32 inputs scale in fp32; 16-bit inputs round the
    normalised row and (weight + offset) to their dtype and multiply in it. Batch-invariant.
    `round_before_weight=False`: Gemma's roundings instead, the product in fp32 (weight +
    offset too) and one rounding to x's dtype at the end (None: round before, unless fp32)."""
    check(weight.dim() == 1, "weight must be [N]")
    x2 = _rows(x, weight.shape[0], "weight")
    if weight.device != x.device:
        raise ValueError(f"weight on {weight.device}, x on {x.device}")
    out = torch.empty_like(x2)
    if x2.shape[0]:
        block = next_pow2(x2.shape[1])
        tile_rows, warps = _tile(block)
        _rms_norm_kernel[_grid(x2.shape[0], tile_rows)](
            x2,
            weight.contiguous(),
            out,
            x2.shape[0],
            x2.stride(0),
            out.stride(0),
            x2.shape[1],
            float(eps),
            float(weight_offset),
            BLOCK=block,
            ROWS=tile_rows,
            ROUND_BEFORE_WEIGHT=x.dtype != torch.float32 and round_before_weight is not False,
            num_warps=warps,
        )
    return out if x.dim() == 2 else out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor,  # [..., N]
    residual: torch.Tensor,  # [..., N], x's shape and dtype
    weight: torch.Tensor,  # [N]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual, weight, eps), x + residual) in one kernel: the sum rounded to
    x's dtype as torch's `+` rounds it, then normalised as `rms_norm` does (a pre-norm
    decoder's residual add and the next norm). Both outputs are new tensors."""
    check(weight.dim() == 1, "weight must be [N]")
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} vs x {tuple(x.shape)}")
    if residual.dtype != x.dtype:
        raise ValueError(f"residual is {residual.dtype}, x {x.dtype}")
    x2 = _rows(x, weight.shape[0], "weight")
    r2 = _rows(residual, weight.shape[0], "weight")
    for name, t in (("weight", weight), ("residual", residual)):
        if t.device != x.device:
            raise ValueError(f"{name} on {t.device}, x on {x.device}")
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)  # dense rows of N
    total = torch.empty_like(out)
    if x2.shape[0]:
        block = next_pow2(x2.shape[1])
        tile_rows, warps = _tile(block)
        _add_rms_norm_kernel[_grid(x2.shape[0], tile_rows)](
            x2,
            r2,
            weight.contiguous(),
            out,
            total,
            x2.shape[0],
            x2.stride(0),
            r2.stride(0),
            x2.shape[1],
            float(eps),
            BLOCK=block,
            ROWS=tile_rows,
            ROUND_BEFORE_WEIGHT=x.dtype != torch.float32,
            num_warps=warps,
        )
    if x.dim() == 2:  # rows already: no views to make
        return out, total
    return out.view(x.shape), total.view(x.shape)


def layer_norm(
    x: torch.Tensor,  # [..., N]
    weight: torch.Tensor | None,  # [N]
    bias: torch.Tensor | None,  # [N]
    eps: float,
) -> torch.Tensor:
    """`F.layer_norm(x.float(), (N,), weight, bias, eps).to(x.dtype)`: two-pass mean and
    variance in fp32, one rounding at the end. Batch-invariant."""
    n = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check(t.shape == (n,), f"{name} must be [{n}], got {tuple(t.shape)}")
            check(t.device == x.device, f"{name} on {t.device}, x on {x.device}")
    x2 = _rows(x, n, "x")
    out = torch.empty_like(x2)
    if x2.shape[0]:
        block = next_pow2(n)
        tile_rows, warps = _tile(block)
        _layer_norm_kernel[_grid(x2.shape[0], tile_rows)](
            x2,
            weight.contiguous() if weight is not None else x2,
            bias.contiguous() if bias is not None else x2,
            out,
            x2.shape[0],
            x2.stride(0),
            out.stride(0),
            n,
            float(eps),
            BLOCK=block,
            ROWS=tile_rows,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            num_warps=warps,
        )
    return out.view(x.shape)
