"""Multi-LoRA as two segmented GEMMs: each token multiplied by its own adapter slot's weights.

    shrink   s[t] = x[t] @ lora_a[l]^T            [T, K] -> [T, R] float32
    expand   y[t] += s[t] @ lora_b[l]^T           [T, R] -> [T, N], in place

for every token t of slot l. The tokens of slot l are listed in a segment of `token_idx`
(`lora_segments` in reference.py builds it from per-token slots, -1 = no adapter):

    slots       t0:1  t1:-1  t2:0  t3:1  t4:0
    token_idx   | t2 t4 | t0 t3 | t1          seg_start = [0, 2, 4]   (L = 2)
                 slot 0  slot 1  no adapter (past seg_start[L]: never read)

Program (m, n, l) of the grid (cdiv(T, BLOCK_M), column tiles, L) takes rows
m * BLOCK_M .. of slot l's segment and returns at once when they are past its end, so the grid
depends on shapes alone and nothing is read on the host: the launches can be captured in a CUDA
graph and replayed on new segments. A program gathers its rows through token_idx, walks the
reduction dim in BLOCK_K steps into an fp32 accumulator (tl.dot; R is padded to the tile by
masks) and writes each row back to its token's row.

Preconditions, not checked (that would read the tensors on the host): seg_start is
nondecreasing with seg_start[L] <= len(token_idx), and a token is in at most one segment.

At decode sizes shrink has few output tiles (R is small), so it splits K over extra programs
when the grid would leave SMs idle: partial products go to an fp32 scratch [split_k, T, R],
summed by torch in a fixed order (no atomics: deterministic).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from paged_kernels._dot import round_bf16, tile_dot
from paged_kernels._utils import (
    FLOAT_DTYPES,
    check,
    check_last_dim_contiguous,
    device_sms,
    is_interpreter,
    next_pow2,
)

# Each split of shrink's K range covers at least this many columns, so a program does a few
# pipelined K steps rather than one (a rule of thumb, not yet timed).
MIN_SPLIT_COLS = 256


class LoraTiles(NamedTuple):
    block_m: int  # segment rows per program
    block_n: int  # output columns per program (R for shrink, N for expand)
    block_k: int  # reduction step (K for shrink, R for expand)
    split_k: int  # shrink only: programs sharing one output tile's K range; expand: 1
    num_warps: int
    num_stages: int


def _block_m(num_tokens: int) -> int:
    """Rows per tile: a slot may hold all T tokens, so T bounds its segment."""
    if num_tokens <= 64:
        return 16
    return 32 if num_tokens <= 512 else 64


def choose_shrink_tiles(
    num_tokens: int, k: int, rank: int, num_slots: int, dtype: torch.dtype, device: torch.device
) -> LoraTiles:
    """Tiles by shape (no autotuning; not yet timed on a GPU). Few rows (decode) make shrink
    weight-bound: 16-column tiles and split-K spread lora_a over more programs. Many rows make it
    x-bound: one column tile holds all of R (up to 128), so x is read once. split_k aims at two
    programs per SM over the tiles that can hold rows (segments pad < BLOCK_M rows each)."""
    fp32 = dtype == torch.float32
    block_m = min(_block_m(num_tokens), 32 if fp32 else 64)  # fp32 64 x 64 tiles spill on sm_90
    if num_tokens <= 64:
        block_n = 16
        block_k = 64 if fp32 else 256
    else:
        block_n = min(max(next_pow2(rank), 16), 64 if fp32 else 128)
        block_k = 32 if fp32 else 64
    used_m = -(-num_tokens // block_m) + min(num_slots, num_tokens) - 1
    programs = max(1, used_m * -(-rank // block_n))
    split_k = max(1, min(-(-2 * device_sms(device) // programs), k // max(block_k, MIN_SPLIT_COLS)))
    return LoraTiles(block_m, block_n, block_k, split_k, 4, 2 if fp32 else 3)


def choose_expand_tiles(num_tokens: int, rank: int, dtype: torch.dtype) -> LoraTiles:
    """Expand reads and writes y's rows: y's traffic dominates and R is at most a few K steps.
    Decode-size T takes 32-column tiles to spread lora_b over more programs."""
    block_m = _block_m(num_tokens)
    fp32 = dtype == torch.float32
    block_n = 32 if num_tokens <= 64 or fp32 else 64
    block_k = min(max(next_pow2(rank), 16), 32 if fp32 else 64)
    return LoraTiles(block_m, block_n, block_k, 1, 4, 2)


def _check_segments(token_idx: torch.Tensor, seg_start: torch.Tensor, t: int, slots: int) -> None:
    check(
        token_idx.dim() == 1 and token_idx.dtype == torch.int32 and token_idx.numel() >= t,
        f"token_idx must be a 1-D int32 tensor of >= T={t} entries, "
        f"got {token_idx.dtype} {tuple(token_idx.shape)}",
    )
    check(
        seg_start.shape == (slots + 1,) and seg_start.dtype == torch.int32,
        f"seg_start must be an int32 tensor [L + 1] = [{slots + 1}], "
        f"got {seg_start.dtype} {tuple(seg_start.shape)}",
    )
    check(token_idx.stride(0) == 1, "token_idx must be contiguous")
    check(seg_start.stride(0) == 1, "seg_start must be contiguous")


def _check_tiles(tiles: LoraTiles) -> None:
    sizes = (tiles.block_m, tiles.block_n, tiles.block_k)
    check(
        all(b >= 16 and b & (b - 1) == 0 for b in sizes),
        f"tiles: block sizes {sizes} must be powers of two >= 16 (tl.dot's minimum)",
    )
    check(tiles.split_k >= 1, f"tiles: split_k must be >= 1, got {tiles.split_k}")


def _check_devices(**tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors.values()}
    check(
        len(devices) == 1,
        "tensors on several devices: "
        + ", ".join(f"{name} on {t.device}" for name, t in tensors.items()),
    )


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [L, R, K]
    token_idx_ptr,  # [>= T] int32: slot l's tokens at [seg_start[l], seg_start[l + 1])
    seg_start_ptr,  # [L + 1] int32
    out_ptr,  # [split_k, T, R] float32 (split_k = 1: the [T, R] output itself)
    R,
    K,
    k_per_split,  # a multiple of BLOCK_K
    num_n_tiles,
    stride_xm,
    stride_al,
    stride_ar,
    stride_os,
    stride_om,
    UPCAST: tl.constexpr,  # x and lora_a differ in dtype: multiply in fp32
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EXPLICIT_DOT: tl.constexpr,  # interpreter only (_dot.py)
):
    pid_m = tl.program_id(0)
    pid_nk = tl.program_id(1)  # split * num_n_tiles + column tile
    slot = tl.program_id(2)
    row0 = tl.load(seg_start_ptr + slot) + pid_m * BLOCK_M
    seg_end = tl.load(seg_start_ptr + slot + 1)
    if row0 >= seg_end:
        return
    pid_k = pid_nk // num_n_tiles
    offs_m = row0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < seg_end
    tokens = tl.load(token_idx_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
    offs_n = (pid_nk % num_n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < R
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    x_tile = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :]
    a_tile = a_ptr + slot.to(tl.int64) * stride_al + offs_n[None, :] * stride_ar + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = offs_k < k_hi - k0
        a = tl.load(x_tile + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(a_tile + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # A^T: [K, R]
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tile_dot(a, b, acc, DOT_PRECISION, EXPLICIT_DOT)
    out = out_ptr + pid_k.to(tl.int64) * stride_os + tokens[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _lora_expand_kernel(
    s_ptr,  # [T, R] float32
    b_ptr,  # [L, N, R]
    token_idx_ptr,  # [>= T] int32: slot l's tokens at [seg_start[l], seg_start[l + 1])
    seg_start_ptr,  # [L + 1] int32
    y_ptr,  # [T, N], updated in place
    N,
    R,
    stride_sm,
    stride_bl,
    stride_bn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EXPLICIT_DOT: tl.constexpr,  # interpreter only (_dot.py)
    ROUND_S_BITS: tl.constexpr,  # interpreter only, bf16 lora_b: s rounds with round_bf16
    ROUND_Y_BITS: tl.constexpr,  # interpreter only, bf16 y: y rounds with round_bf16
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2)
    row0 = tl.load(seg_start_ptr + slot) + pid_m * BLOCK_M
    seg_end = tl.load(seg_start_ptr + slot + 1)
    if row0 >= seg_end:
        return
    offs_m = row0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < seg_end
    tokens = tl.load(token_idx_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_r = tl.arange(0, BLOCK_K)
    y_tile = y_ptr + tokens[:, None] * stride_ym + offs_n[None, :]
    y_ok = m_ok[:, None] & n_ok[None, :]
    y = tl.load(y_tile, mask=y_ok, other=0.0)  # issued before the product: its latency overlaps
    s_tile = s_ptr + tokens[:, None] * stride_sm + offs_r[None, :]
    b_tile = b_ptr + slot.to(tl.int64) * stride_bl + offs_n[None, :] * stride_bn + offs_r[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r0 in range(0, R, BLOCK_K):
        r_ok = offs_r < R - r0
        # s rounds to lora_b's dtype (a no-op for fp32) so 16-bit weights use tensor cores.
        a = tl.load(s_tile + r0, mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        if ROUND_S_BITS:
            a = round_bf16(a)  # the explicit product upcasts to fp32 anyway
        else:
            a = a.to(b_ptr.dtype.element_ty)
        b = tl.load(b_tile + r0, mask=r_ok[:, None] & n_ok[None, :], other=0.0)  # B^T: [R, N]
        acc = tile_dot(a, b, acc, DOT_PRECISION, EXPLICIT_DOT)
    acc += y.to(tl.float32)
    if ROUND_Y_BITS:
        acc = round_bf16(acc)  # exact in bf16 now: the cast below truncates nothing
    tl.store(y_tile, acc.to(y_ptr.dtype.element_ty), mask=y_ok)


def lora_shrink(
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [L, R, K]
    token_idx: torch.Tensor,  # [>= T] int32
    seg_start: torch.Tensor,  # [L + 1] int32
    out: torch.Tensor | None = None,  # [T, R] float32
    *,
    tiles: LoraTiles | None = None,  # None: choose_shrink_tiles
) -> torch.Tensor:  # out: [T, R] float32
    """out[t] = x[t] @ lora_a[l]^T for every token t in slot l's segment, with fp32 products
    and sums (x and lora_a of different dtypes multiply in fp32); rows of tokens in no segment
    are undefined. No host read: capturable in a CUDA graph."""
    check(x.dim() == 2, f"x must be [T, K], got {tuple(x.shape)}")
    check(lora_a.dim() == 3, f"lora_a must be [L, R, K], got {tuple(lora_a.shape)}")
    t, k = x.shape
    num_slots, rank = lora_a.shape[:2]
    check(lora_a.shape[2] == k, f"lora_a {tuple(lora_a.shape)}: K != x's K {k}")
    check(x.dtype in FLOAT_DTYPES, f"x: unsupported dtype {x.dtype}")
    check(lora_a.dtype in FLOAT_DTYPES, f"lora_a: unsupported dtype {lora_a.dtype}")
    _check_segments(token_idx, seg_start, t, num_slots)
    if out is None:
        out = torch.empty(t, rank, dtype=torch.float32, device=x.device)
    check(
        out.shape == (t, rank) and out.dtype == torch.float32,
        f"out must be float32 [T, R] = [{t}, {rank}], got {out.dtype} {tuple(out.shape)}",
    )
    _check_devices(x=x, lora_a=lora_a, token_idx=token_idx, seg_start=seg_start, out=out)
    check_last_dim_contiguous("lora_a", lora_a)
    check_last_dim_contiguous("out", out)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if t == 0 or rank == 0 or num_slots == 0:
        return out
    if k == 0:
        return out.zero_()
    upcast = x.dtype != lora_a.dtype
    tiles = tiles or choose_shrink_tiles(
        t, k, rank, num_slots, torch.float32 if upcast else x.dtype, x.device
    )
    _check_tiles(tiles)
    k_per_split = triton.cdiv(triton.cdiv(k, tiles.block_k), tiles.split_k) * tiles.block_k
    split_k = triton.cdiv(k, k_per_split)  # no empty split
    dest = out if split_k == 1 else torch.empty(split_k, t, rank, device=x.device)
    num_n_tiles = triton.cdiv(rank, tiles.block_n)
    grid = (triton.cdiv(t, tiles.block_m), num_n_tiles * split_k, num_slots)
    fp32 = upcast or x.dtype == torch.float32
    _lora_shrink_kernel[grid](
        x,
        lora_a,
        token_idx,
        seg_start,
        dest,
        rank,
        k,
        k_per_split,
        num_n_tiles,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        dest.stride(0) if split_k > 1 else 0,
        dest.stride(-2),
        UPCAST=upcast,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        DOT_PRECISION="ieee" if fp32 else "tf32",
        EXPLICIT_DOT=is_interpreter(),
        num_warps=1 if is_interpreter() else tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if split_k > 1:
        torch.sum(dest, dim=0, out=out)
    return out


def lora_expand(
    s: torch.Tensor,  # [T, R] float32
    lora_b: torch.Tensor,  # [L, N, R]
    token_idx: torch.Tensor,  # [>= T] int32
    seg_start: torch.Tensor,  # [L + 1] int32
    y: torch.Tensor,  # [T, N]
    *,
    tiles: LoraTiles | None = None,  # None: choose_expand_tiles
) -> torch.Tensor:  # y
    """y[t] += s[t] @ lora_b[l]^T in place for every token t in slot l's segment: s rounded to
    lora_b's dtype (as a 16-bit PEFT forward rounds x @ A^T), fp32 products and sums, one
    rounding to y's dtype. Rows of tokens in no segment are not touched. No host read:
    capturable in a CUDA graph."""
    check(s.dim() == 2, f"s must be [T, R], got {tuple(s.shape)}")
    check(lora_b.dim() == 3, f"lora_b must be [L, N, R], got {tuple(lora_b.shape)}")
    check(y.dim() == 2, f"y must be [T, N], got {tuple(y.shape)}")
    t, rank = s.shape
    num_slots, n = lora_b.shape[:2]
    check(lora_b.shape[2] == rank, f"lora_b {tuple(lora_b.shape)}: R != s's R {rank}")
    check(y.shape == (t, n), f"y {tuple(y.shape)} != [T, N] = [{t}, {n}]")
    check(s.dtype == torch.float32, f"s must be float32, got {s.dtype}")
    check(lora_b.dtype in FLOAT_DTYPES, f"lora_b: unsupported dtype {lora_b.dtype}")
    check(y.dtype in FLOAT_DTYPES, f"y: unsupported dtype {y.dtype}")
    _check_segments(token_idx, seg_start, t, num_slots)
    _check_devices(s=s, lora_b=lora_b, token_idx=token_idx, seg_start=seg_start, y=y)
    check_last_dim_contiguous("lora_b", lora_b)
    check_last_dim_contiguous("y", y)
    if s.stride(-1) != 1:
        s = s.contiguous()
    if t == 0 or n == 0 or rank == 0 or num_slots == 0:
        return y
    tiles = tiles or choose_expand_tiles(t, rank, lora_b.dtype)
    _check_tiles(tiles)
    check(tiles.split_k == 1, f"tiles: lora_expand does not split, got split_k={tiles.split_k}")
    grid = (triton.cdiv(t, tiles.block_m), triton.cdiv(n, tiles.block_n), num_slots)
    _lora_expand_kernel[grid](
        s,
        lora_b,
        token_idx,
        seg_start,
        y,
        n,
        rank,
        s.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        y.stride(0),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        DOT_PRECISION="ieee" if lora_b.dtype == torch.float32 else "tf32",
        EXPLICIT_DOT=is_interpreter(),
        ROUND_S_BITS=is_interpreter() and lora_b.dtype == torch.bfloat16,
        ROUND_Y_BITS=is_interpreter() and y.dtype == torch.bfloat16,
        num_warps=1 if is_interpreter() else tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return y
