"""Random sampling in one pass over the logits: the Gumbel-max race.

`gumbel_race(x, seeds, temperature)` returns, per row, argmax over the vocabulary of
x / T + G with G = -log(-log U), U ~ Uniform[0, 1) from Triton's Philox generator keyed by the
row's seed: a draw from softmax(x / T). It reads each logit once, where torch's race (a float
copy, the division, a softmax, the noise, its log, a quotient and an argmin) writes and reads
[rows, vocab] several times over.

The noise of a column depends on the row's seed and the column alone: not on the batch, the
split of the vocabulary over programs, the logits' dtype or the device. So a seeded row draws
the same token whatever else is in the batch, and `uniform_noise` (the same generator, written
out) lets a test recompute the race in torch. The division by T is IEEE round-to-nearest (as
torch's), so passing T here or passing x / T already divided gives the same bits: the sampler's
plain path and its processing path race identically.

U = 0 makes G = -inf (that column loses); U < 1 always, so G is finite otherwise and a score is
never NaN for finite or -inf logits. Masked logits (-inf) never win while a finite one exists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_kernels._utils import FLOAT_DTYPES, INTERPRETED, check, device_sms

# Columns a block covers. Part of the noise's layout (a column's Philox counter and lane), so
# fixed: changing it changes every seeded draw.
NOISE_BLOCK = 1024


@triton.jit
def _block_noise(seed, start, QUARTER: tl.constexpr):
    """U for columns start + [0, 4 * QUARTER): one Philox call per 4 columns, lane k of counter
    start // 4 + q covers column start + k * QUARTER + q."""
    counters = start // 4 + tl.arange(0, QUARTER)
    return tl.rand4x(seed, counters)


@triton.jit
def _race_quarter(base, cols, hi, u, t, best, best_i, HAS_TEMP: tl.constexpr):
    """Each lane's running (best score, its column) after the columns `cols` with noise `u`:
    elementwise, so the loop carries no reduction (one at the end)."""
    ok = cols < hi
    x = tl.load(base + cols, mask=ok, other=-float("inf")).to(tl.float32)
    if HAS_TEMP:
        x = tl.math.div_rn(x, t)
    score = tl.where(ok, x - tl.log(-tl.log(u)), -float("inf"))
    take = score > best  # strictly: a lane's earlier (lower) column keeps a tie
    return tl.where(take, score, best), tl.where(take, cols, best_i)


# The split count follows the batch's row count: no specialisation on it (one compile).
@triton.jit(do_not_specialize=["num_splits"])
def _gumbel_race_kernel(
    x_ptr,  # [N, V]
    seeds_ptr,  # [N] int64
    temp_ptr,  # [N] fp32, read only if HAS_TEMP
    best_ptr,  # [N, S] fp32: each split's best score
    index_ptr,  # [N, S] int64: its column
    stride_x,
    vocab,
    per_split,  # columns a split covers, a multiple of BLOCK
    num_splits,
    HAS_TEMP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    seed = tl.load(seeds_ptr + row)
    QUARTER: tl.constexpr = BLOCK // 4
    q = tl.arange(0, QUARTER)
    base = x_ptr + row.to(tl.int64) * stride_x
    t = tl.load(temp_ptr + row) if HAS_TEMP else 1.0
    best = tl.full((QUARTER,), -float("inf"), tl.float32)
    best_i = tl.zeros((QUARTER,), tl.int32)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, vocab)
    for start in range(lo, hi, BLOCK):
        u0, u1, u2, u3 = _block_noise(seed, start, QUARTER)
        cols = start + q
        best, best_i = _race_quarter(base, cols, hi, u0, t, best, best_i, HAS_TEMP)
        best, best_i = _race_quarter(base, cols + QUARTER, hi, u1, t, best, best_i, HAS_TEMP)
        best, best_i = _race_quarter(base, cols + 2 * QUARTER, hi, u2, t, best, best_i, HAS_TEMP)
        best, best_i = _race_quarter(base, cols + 3 * QUARTER, hi, u3, t, best, best_i, HAS_TEMP)
    top = tl.max(best, axis=0)
    # the lowest column holding the best score (a tie between lanes, as within one)
    column = tl.min(tl.where(best == top, best_i, vocab), axis=0)
    tl.store(best_ptr + row * num_splits + split, top)
    tl.store(index_ptr + row * num_splits + split, column.to(tl.int64))


@triton.jit
def _uniform_noise_kernel(seeds_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    QUARTER: tl.constexpr = BLOCK // 4
    u0, u1, u2, u3 = _block_noise(tl.load(seeds_ptr + row), start, QUARTER)
    cols = start + tl.arange(0, QUARTER)
    out = out_ptr + row.to(tl.int64) * vocab
    tl.store(out + cols, u0, mask=cols < vocab)
    tl.store(out + cols + QUARTER, u1, mask=cols + QUARTER < vocab)
    tl.store(out + cols + 2 * QUARTER, u2, mask=cols + 2 * QUARTER < vocab)
    tl.store(out + cols + 3 * QUARTER, u3, mask=cols + 3 * QUARTER < vocab)


def _check_seeds(seeds: torch.Tensor, rows: int, device: torch.device) -> None:
    if seeds.dtype != torch.int64:
        raise ValueError(f"seeds must be int64, got {seeds.dtype}")
    if seeds.shape != (rows,):
        raise ValueError(f"seeds must be [{rows}], got {tuple(seeds.shape)}")
    if seeds.device != device:
        raise ValueError(f"seeds on {seeds.device}, logits on {device}")


def _num_splits(rows: int, vocab: int, device: torch.device) -> int:
    """About two programs per SM, each over at least 8 blocks of columns."""
    if INTERPRETED:
        return 1
    return max(1, min(triton.cdiv(2 * device_sms(device), rows), vocab // (8 * NOISE_BLOCK)))


def gumbel_race(
    x: torch.Tensor,  # [N, V] logits, any float dtype
    seeds: torch.Tensor,  # [N] int64: row r's noise comes from seeds[r]
    temperature: torch.Tensor | None = None,  # [N] or [N, 1] float32 > 0; None: x is divided
    *,
    num_splits: int | None = None,  # None: heuristic; the token never depends on it
) -> torch.Tensor:
    """[N] int64: per row, argmax_v x[v] / T + G[v], G = -log(-log U[v]) with U the row's
    `uniform_noise`. A sample from softmax(x / T); -inf logits never win."""
    check(x.dim() == 2 and x.dtype in FLOAT_DTYPES, "x must be [rows, vocab] float")
    check(x.stride(1) == 1, "x must be contiguous in its last dim")
    rows, vocab = x.shape
    _check_seeds(seeds, rows, x.device)
    if temperature is not None:
        temperature = temperature.reshape(-1)
        if temperature.shape != (rows,):
            raise ValueError(f"temperature must hold {rows} values")
        check(temperature.dtype == torch.float32, "temperature must be float32")
        check(temperature.device == x.device, "temperature must be on x's device")
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    check(vocab > 0, "empty vocabulary")
    splits = num_splits or _num_splits(rows, vocab, x.device)
    check(splits >= 1, "num_splits must be >= 1")
    per_split = triton.cdiv(triton.cdiv(vocab, splits), NOISE_BLOCK) * NOISE_BLOCK
    splits = triton.cdiv(vocab, per_split)  # no empty split
    best = torch.empty(rows, splits, dtype=torch.float32, device=x.device)
    index = torch.empty(rows, splits, dtype=torch.int64, device=x.device)
    _gumbel_race_kernel[(rows, splits)](
        x,
        seeds,
        temperature if temperature is not None else best,
        best,
        index,
        x.stride(0),
        vocab,
        per_split,
        splits,
        HAS_TEMP=temperature is not None,
        BLOCK=NOISE_BLOCK,
        num_warps=4,
    )
    if splits == 1:
        return index[:, 0]
    # The first split holding the row's best score (ties to the lower columns, as within one).
    return index.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1)


def uniform_noise(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, vocab] float32: the U that `gumbel_race` draws for each row's seed."""
    check(seeds.dim() == 1, "seeds must be [rows]")
    _check_seeds(seeds, seeds.shape[0], seeds.device)
    out = torch.empty(seeds.shape[0], vocab, dtype=torch.float32, device=seeds.device)
    if seeds.shape[0] and vocab:
        grid = (seeds.shape[0], triton.cdiv(vocab, NOISE_BLOCK))
        _uniform_noise_kernel[grid](seeds, out, vocab, BLOCK=NOISE_BLOCK)
    return out
