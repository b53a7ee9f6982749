"""Three matrix multiplies, two over one GEMM kernel:

- `matmul`: batch-invariant, out = x @ weight.T (+ bias), every row computed the same way
  whatever the other rows are.
- `fp8_linear`: FP8 weights, out = x @ (weight * scale).T (+ bias) with float8_e4m3fn weights
  and one float32 scale per output channel (weight-only FP8, "W8A16": `quantization="fp8"`).
  Each fp8 tile is cast to x's dtype as it loads (exact: every e4m3 value is representable in
  bf16 / fp16 / fp32) and multiplied with an fp32 accumulator; a channel's scale is constant
  along K, so it multiplies the finished sum once. The weights are read at one byte each, half of
  bf16's (decode steps are bound by reading weights). Tiles by M, not batch-invariant.

and one over its own kernel:

- `int4_linear`: 4-bit group-quantized weights ("W4A16"), w = code * scale + low with one
  (scale, low) pair per 32 inputs of an output channel. Each tile of packed bytes is split into
  its nibbles and dequantized in fp32 in registers as it loads, cast to x's dtype and multiplied
  with an fp32 accumulator; the weights are read at half a byte each. Tiles by M.

Batch invariance (`matmul`): cuBLAS picks its algorithm (tile shape, split-K, stream-K) from
the problem's shape, so the order in which a row's K products are summed changes with the
number of rows M. This kernel's tile config is a constant: each BLOCK_M x BLOCK_N output tile
walks K from 0 in BLOCK_K steps, one tl.dot per step into an fp32 accumulator, and no split-K.
A row's result is then a function of that row and the weight alone, whatever M is and wherever
the row sits in a tile (all rows of a tile run the same instructions). M is not specialised on,
so every M runs the same binary.
`matmul`'s tile config is fixed; `fp8_linear` and `int4_linear` pick theirs by M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_kernels._dot import tile_dot
from paged_kernels._utils import FLOAT_DTYPES, check, check_last_dim_contiguous, is_interpreter
from paged_kernels.reference import INT4_GROUP, check_int4

# The fixed config. Rows per tile only pad the tensor-core work of small batches (weights are
# read once per tile row either way); 64 output columns per tile keep enough programs for
# decode-size M without split-K.
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] in x's dtype, or float8_e4m3fn with HAS_SCALE
    scale_ptr,  # [N] float32, read only if HAS_SCALE
    bias_ptr,  # [N], read only if HAS_BIAS
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EXPLICIT_DOT: tl.constexpr,  # interpreter only (_dot.py)
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_tile = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_tile = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # W^T: [K, N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(x_tile + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_tile + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        b = b.to(x_ptr.dtype.element_ty)  # fp8 -> x's dtype (exact); a no-op otherwise
        acc = tile_dot(a, b, acc, DOT_PRECISION, EXPLICIT_DOT)
    if HAS_SCALE:  # the output channel's scale, constant along K
        acc = acc * tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:  # added in fp32 before the one rounding, as cuBLAS's epilogue does
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _launch(
    x: torch.Tensor,  # [M, K], rows contiguous
    weight: torch.Tensor,  # [N, K]
    scale: torch.Tensor | None,  # [N] float32 (fp8 weights)
    bias: torch.Tensor | None,  # [N]
    out: torch.Tensor,  # [M, N]
    tiles: tuple[int, int, int, int],  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps
) -> None:
    (m, k), n = x.shape, weight.shape[0]
    block_m, block_n, block_k, num_warps = tiles
    _matmul_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        x,
        weight,
        scale if scale is not None else weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_SCALE=scale is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        EXPLICIT_DOT=is_interpreter(),
        num_warps=1 if is_interpreter() else num_warps,
        num_stages=3,
    )


def matmul(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N] in x's dtype
    """`F.linear(x, weight, bias)` with a reduction order that does not depend on the batch:
    row i of the result has the same bits for any number of rows and any position of row i.
    fp32 inputs multiply in full fp32 (no TF32)."""
    check(x.dim() >= 1 and weight.dim() == 2, "x must be [..., K] and weight [N, K]")
    n, k = weight.shape
    check(x.shape[-1] == k, f"x's last dim {x.shape[-1]} != weight's K {k}")
    check(x.dtype in FLOAT_DTYPES, f"unsupported dtype {x.dtype}")
    check(weight.dtype == x.dtype, f"weight dtype {weight.dtype} != x's {x.dtype}")
    check(x.device == weight.device, f"x on {x.device}, weight on {weight.device}")
    if bias is not None:
        check(bias.shape == (n,), f"bias must be [{n}], got {tuple(bias.shape)}")
        check(bias.device == x.device, f"bias on {bias.device}, x on {x.device}")
        bias = bias.contiguous()
    check_last_dim_contiguous("weight", weight)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*lead, n)
    if k == 0:
        return out.zero_().add_(bias if bias is not None else 0).view(*lead, n)
    tiles = (BLOCK_M, BLOCK_N, BLOCK_K, 8)  # 4 warps spill on sm_90 (255 registers + 56 B)
    _launch(x2, weight, None, bias, out, tiles)
    return out.view(*lead, n)


def _tiles_by_rows(m: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) of fp8_linear and int4_linear by rows (not yet
    timed on a GPU): decode-size M streams the weights in long K steps over 16-row tiles
    (tl.dot's minimum); prefill-size M reuses each (decoded) weight tile over 64 rows. fp32
    multiplies without tensor-core tiles: smaller. BLOCK_K is a multiple of int4's 32-input
    groups."""
    if dtype == torch.float32:
        return 16 if m <= 16 else 32, 32, 32, 4
    if m <= 16:
        return 16, 64, 128, 4
    if m <= 64:
        return 32, 64, 64, 4
    return 64, 128, 64, 8


def fp8_linear(
    x: torch.Tensor,  # [M, K] float16 / bfloat16 / float32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N] float32: W's values are weight * scale
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    """x @ (weight * scale[:, None]).T + bias, the weights decoded in the kernel (no host read)."""
    check(x.dim() == 2 and weight.dim() == 2, "x must be [M, K] and weight [N, K]")
    m, k = x.shape
    n = weight.shape[0]
    check(weight.shape[1] == k, f"weight {tuple(weight.shape)} does not take x's K={k}")
    check(x.dtype in FLOAT_DTYPES, f"unsupported dtype {x.dtype}")
    check(weight.dtype == torch.float8_e4m3fn, f"weight must be float8_e4m3fn, got {weight.dtype}")
    check(scale.shape == (n,) and scale.dtype == torch.float32, "scale must be float32 [N]")
    if bias is not None:
        check(bias.shape == (n,), f"bias must be [N={n}], got {tuple(bias.shape)}")
    tensors = (x, weight, scale) + ((bias,) if bias is not None else ())
    check(len({t.device for t in tensors}) == 1, "all tensors must be on one device")
    if x.stride(-1) != 1:
        x = x.contiguous()
    check_last_dim_contiguous("weight", weight)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    _launch(x, weight, scale.contiguous(), bias, out, _tiles_by_rows(m, x.dtype))
    return out


# int4_linear: inputs per (scale, low) pair. BLOCK_K is a multiple of it, so a K step spans
# whole groups (K is one too: a tile's tail past K is whole masked groups).
GROUP = INT4_GROUP


@triton.jit(do_not_specialize=["M"])
def _int4_linear_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # [N, K // 2] uint8: (n, k)'s code in byte k // 2, the low nibble for even k
    scale_ptr,  # [N, K // GROUP]
    low_ptr,  # [N, K // GROUP]
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_ln,
    stride_om,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of GROUP
    DOT_PRECISION: tl.constexpr,
    EXPLICIT_DOT: tl.constexpr,  # interpreter only (_dot.py)
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_b = tl.arange(0, BLOCK_K // 2)  # a tile row's bytes
    offs_g = tl.arange(0, BLOCK_K // GROUP)  # a tile row's groups
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows = offs_n[:, None].to(tl.int64)
    x_tile = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    q_tile = q_ptr + rows * stride_qn + offs_b[None, :]  # [BLOCK_N, BLOCK_K // 2]
    s_tile = scale_ptr + rows * stride_sn + offs_g[None, :]  # [BLOCK_N, BLOCK_K // GROUP]
    l_tile = low_ptr + rows * stride_ln + offs_g[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(x_tile + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b_mask = n_ok[:, None] & (offs_b < (K - k0) // 2)[None, :]
        q = tl.load(q_tile + k0 // 2, mask=b_mask, other=0)
        g_mask = n_ok[:, None] & (offs_g < (K - k0) // GROUP)[None, :]
        # masked groups read scale = low = 0: their weights are 0, never NaN
        scale = tl.load(s_tile + k0 // GROUP, mask=g_mask, other=0.0).to(tl.float32)
        low = tl.load(l_tile + k0 // GROUP, mask=g_mask, other=0.0).to(tl.float32)
        codes = tl.interleave(q & 15, q >> 4).to(tl.float32)  # [BLOCK_N, BLOCK_K]: k = 2b, 2b + 1
        w = codes.reshape(BLOCK_N, BLOCK_K // GROUP, GROUP) * scale[:, :, None] + low[:, :, None]
        w = w.reshape(BLOCK_N, BLOCK_K).to(x_ptr.dtype.element_ty)
        acc = tile_dot(a, tl.trans(w), acc, DOT_PRECISION, EXPLICIT_DOT)
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def int4_linear(
    x: torch.Tensor,  # [M, K] float16 / bfloat16 / float32, K a multiple of 32
    packed: torch.Tensor,  # [N, K // 2] uint8, two 4-bit codes a byte along K
    scale: torch.Tensor,  # [N, K // 32] float16 / bfloat16 / float32, read as float32
    low: torch.Tensor,  # [N, K // 32] likewise
) -> torch.Tensor:  # [M, N] in x's dtype
    """out = x @ w^T with 4-bit group-quantized weights, accumulated in fp32:

        code(n, k) = (packed[n, k // 2] >> (4 * (k % 2))) & 15   (even k in the low nibble)
        w[n, k]    = code(n, k) * scale[n, k // 32] + low[n, k // 32]

    The weights are dequantized in registers (fp32, then x's dtype) tile by tile; no host read.
    `ref_int4_linear` is the semantics (its w stays fp32: bf16 / fp16 x see w rounded once).
    ValueError on shapes or dtypes off that contract (K not a multiple of 32 among them)."""
    check_int4(x, packed, scale, low)
    tensors = (x, packed, scale, low)
    check(len({t.device for t in tensors}) == 1, "all tensors must be on one device")
    for name, t in (("packed", packed), ("scale", scale), ("low", low)):
        check_last_dim_contiguous(name, t)
    if x.stride(-1) != 1:
        x = x.contiguous()
    (m, k), n = x.shape, packed.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    block_m, block_n, block_k, num_warps = _tiles_by_rows(m, x.dtype)
    _int4_linear_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        x,
        packed,
        scale,
        low,
        out,
        m,
        n,
        k,
        x.stride(0),
        packed.stride(0),
        scale.stride(0),
        low.stride(0),
        out.stride(0),
        GROUP=GROUP,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        EXPLICIT_DOT=is_interpreter(),
        num_warps=1 if is_interpreter() else num_warps,
        num_stages=3,
    )
    return out
