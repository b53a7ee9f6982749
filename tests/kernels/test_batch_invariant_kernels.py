"""The batch-invariant kernels: matmul, rms_norm / layer_norm, logsumexp and paged_attention's
batch_invariant mode. Each against its torch reference on random inputs, and each row's bits
against the same row computed inside other batches: other row counts, other positions in a tile,
other neighbours, and for attention chunked or decoded instead of prefilled.

Under the interpreter the kernels sum tile products explicitly (paged_kernels/_dot.py); on a GPU
they run tl.dot, which the GPU-marked tests at the end check at realistic sizes.
"""

from __future__ import annotations

import math

import pytest
import torch

from paged_kernels import (
    layer_norm,
    logsumexp,
    matmul,
    paged_attention,
    ref_layer_norm,
    ref_logsumexp,
    ref_matmul,
    ref_paged_attention,
    ref_rms_norm,
    rms_norm,
)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (start, rows) slices of a ROWS-row batch: one row, rows crossing a 64-row tile boundary, rows
# landing at other positions of their tile than in the full batch.
ROWS = 100
SLICES = [(0, 1), (7, 1), (63, 2), (3, 7), (60, 40)]


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(a.float(), b.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k", "bias"), [(96, 64, False), (100, 70, True), (3, 130, True)])
def test_matmul(seed, device, dtype, n, k, bias):
    x = torch.randn(ROWS, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device) / math.sqrt(k)
    b = torch.randn(n, dtype=dtype, device=device) if bias else None
    full = matmul(x, w, b)
    close(full, ref_matmul(x, w, b), dtype)
    for start, rows in SLICES:
        assert torch.equal(matmul(x[start : start + rows], w, b), full[start : start + rows])
    # Leading dims are flattened; a strided row view is read in place.
    assert torch.equal(matmul(x.view(10, 10, k), w, b), full.view(10, 10, n))
    wide = torch.randn(ROWS, 2 * k, dtype=dtype, device=device)
    wide[:, :k] = x
    assert torch.equal(matmul(wide[:, :k], w, b), full)


def test_matmul_rejects_bad_arguments(device):
    x, w = torch.randn(4, 8, device=device), torch.randn(6, 8, device=device)
    with pytest.raises(ValueError, match="K"):
        matmul(x, w[:, :7].contiguous())
    with pytest.raises(ValueError, match="dtype"):
        matmul(x, w.half())
    with pytest.raises(ValueError, match="bias"):
        matmul(x, w, torch.zeros(5, device=device))
    with pytest.raises(ValueError, match="dtype"):
        matmul(x.int(), w.int())
    assert matmul(x[:0], w).shape == (0, 6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("n", [80, 576])
def test_rms_norm(seed, device, dtype, offset, n):
    x = torch.randn(ROWS, n, dtype=dtype, device=device) * 3
    w = (torch.randn(n, device=device) * 0.1 + (0.0 if offset else 1.0)).to(dtype)
    full = rms_norm(x, w, 1e-6, offset)
    close(full, ref_rms_norm(x, w, 1e-6, offset), dtype)
    for start, rows in SLICES:
        assert torch.equal(
            rms_norm(x[start : start + rows], w, 1e-6, offset), full[start : start + rows]
        )


def test_rms_norm_matches_the_engine_layer(device):
    """Same roundings as paged_engine's RMSNorm (fp32 fused, 16-bit rounded before the weight)."""
    from paged_engine.layers.norm import RMSNorm

    for dtype in DTYPES:
        for offset in (0.0, 1.0):
            layer = RMSNorm(96, 1e-5, offset).to(device=device, dtype=dtype)
            with torch.no_grad():
                layer.weight.normal_(0.0 if offset else 1.0, 0.1)
            x = torch.randn(40, 96, dtype=dtype, device=device)
            close(rms_norm(x, layer.weight, 1e-5, offset), layer(x), dtype)


def test_rms_norm_of_head_views(device):
    """q_norm / k_norm see [T, H, D] views of a fused QKV output: rows with a token stride."""
    qkv = torch.randn(20, 6 * 32, device=device)
    q = qkv[:, : 4 * 32].view(20, 4, 32)
    w = torch.rand(32, device=device) + 0.5
    out = rms_norm(q, w, 1e-6)
    assert out.shape == q.shape
    close(out, ref_rms_norm(q, w, 1e-6), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm(seed, device, dtype, affine):
    n = 72
    x = torch.randn(ROWS, n, dtype=dtype, device=device) + 2
    w = torch.randn(n, dtype=dtype, device=device) if affine else None
    b = torch.randn(n, dtype=dtype, device=device) if affine else None
    full = layer_norm(x, w, b, 1e-5)
    close(full, ref_layer_norm(x, w, b, 1e-5), dtype)
    for start, rows in SLICES:
        assert torch.equal(
            layer_norm(x[start : start + rows], w, b, 1e-5), full[start : start + rows]
        )


def test_norms_reject_bad_arguments(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="last dim"):
        rms_norm(x, torch.ones(7, device=device), 1e-6)
    with pytest.raises(ValueError, match="bias"):
        layer_norm(x, None, torch.zeros(3, device=device), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [50, 2100])
def test_logsumexp(seed, device, dtype, vocab):
    x = (torch.randn(ROWS, vocab, device=device) * 4).to(dtype)
    full = logsumexp(x)
    assert full.shape == (ROWS, 1) and full.dtype == torch.float32
    torch.testing.assert_close(full, ref_logsumexp(x), rtol=1e-5, atol=1e-5)
    for start, rows in SLICES:
        assert torch.equal(logsumexp(x[start : start + rows]), full[start : start + rows])


def test_logsumexp_special_values(device):
    x = torch.zeros(4, 2000, device=device)
    x[0] = float("-inf")  # every token banned
    x[1, 1500] = float("inf")
    x[2, 7] = float("nan")
    x[3, :1000] = float("-inf")
    got = logsumexp(x)[:, 0].tolist()
    assert got[0] == float("-inf") and got[1] == float("inf") and math.isnan(got[2])
    assert got[3] == pytest.approx(math.log(1000.0))


# ---- paged_attention(batch_invariant=True) ---------------------------------------------------


class Pool:
    """A shared paged K/V pool with fixed random contents and a permuted block order."""

    def __init__(self, num_kv_heads, head_dim, block_size, dtype, device, num_blocks=64):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.randn(shape, dtype=dtype, device=device)
        self.v = torch.randn(shape, dtype=dtype, device=device)
        self.perm = torch.randperm(num_blocks).to(torch.int32)
        self.block_size, self.used = block_size, 0

    def table(self, length: int) -> torch.Tensor:
        n = -(-length // self.block_size)
        out = self.perm[self.used : self.used + n]
        self.used += n
        return out


def attend(pool, parts, *, device, **kwargs):
    """parts: (q [q_len, H, D], table, seq_len) per sequence -> one output per sequence."""
    width = max(len(t) for _, t, _ in parts)
    tables = torch.zeros(len(parts), width, dtype=torch.int32)
    for i, (_, t, _) in enumerate(parts):
        tables[i, : len(t)] = t
    q_lens = [q.shape[0] for q, _, _ in parts]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([s for _, _, s in parts], dtype=torch.int32)
    q = torch.cat([q for q, _, _ in parts])
    args = (pool.k, pool.v, tables.to(device), cu.to(device), seq_lens.to(device))
    out = paged_attention(q, *args, 0.125, **kwargs)
    ref = ref_paged_attention(
        q, *args, 0.125, **{k: v for k, v in kwargs.items() if k != "batch_invariant"}
    )
    torch.testing.assert_close(out.float(), ref.float(), rtol=3e-2, atol=3e-2)
    return list(out.split(q_lens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# GQA 4 and MHA on one and two KV heads (the grid has a program row per KV head): query tiles
# of 8 and 32 rows in fp32, 16 and 64 in bf16.
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 1, 32), (2, 2, 40)])
@pytest.mark.parametrize("window", [None, 37])
def test_attention_rows_do_not_depend_on_the_batch(
    seed, device, dtype, num_heads, num_kv_heads, head_dim, window
):
    """A 90-token sequence's rows: prefilled alone, chunked (35 + 55 tokens), its last row
    decoded alone, and each of those among decode and prefill rows of other sequences."""
    pool = Pool(num_kv_heads, head_dim, 16, dtype, device)
    kw = {"batch_invariant": True, "sliding_window": window, "device": device}
    length = 90
    table = pool.table(length)
    q = torch.randn(length, num_heads, head_dim, dtype=dtype, device=device)

    def other(q_len, ctx):
        t = pool.table(ctx + q_len)
        return (torch.randn(q_len, num_heads, head_dim, dtype=dtype, device=device), t, ctx + q_len)

    (alone,) = attend(pool, [(q, table, length)], **kw)
    first, second = attend(pool, [(q[:35], table, 35), (q[35:], table, length)], **kw)
    assert torch.equal(torch.cat([first, second]), alone)
    (last,) = attend(pool, [(q[-1:], table, length)], **kw)
    assert torch.equal(last, alone[-1:])
    mixed = attend(
        pool,
        [
            other(1, 120),
            other(17, 0),
            (q[35:], table, length),
            other(1, 5),
            (q[-1:], table, length),
        ],
        **kw,
    )
    assert torch.equal(mixed[2], alone[35:]) and torch.equal(mixed[4], alone[-1:])


def test_attention_batch_invariant_never_splits(device):
    pool = Pool(2, 32, 16, torch.float32, device)
    q = torch.randn(1, 4, 32, device=device)
    with pytest.raises(ValueError, match="never splits"):
        attend(pool, [(q, pool.table(40), 40)], batch_invariant=True, num_splits=2, device=device)


# ---- GPU only: tl.dot on tensor cores, realistic sizes ---------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_matmul_rows_match_any_batch(seed, dtype):
    """Rows of x @ W^T for a 4096 x 1024 weight: every slice of a 512-row batch, and M = 1..300,
    bitwise equal to the full batch's rows (cuBLAS itself differs here for some M)."""
    x = torch.randn(512, 1024, dtype=dtype, device="cuda")
    w = torch.randn(4096, 1024, dtype=dtype, device="cuda") / 32
    full = matmul(x, w)
    close(full, ref_matmul(x, w), dtype)
    for m in (1, 2, 3, 7, 16, 31, 64, 65, 129, 300):
        for start in (0, 5, 100):
            assert torch.equal(matmul(x[start : start + m], w), full[start : start + m]), (m, start)


@pytest.mark.gpu
def test_gpu_norms_and_logsumexp_rows_match_any_batch(seed):
    x = torch.randn(512, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    logits = torch.randn(300, 151936, device="cuda") * 5
    full_rms, full_ln, full_lse = rms_norm(x, w, 1e-6), layer_norm(x, w, w, 1e-5), logsumexp(logits)
    for m in (1, 3, 64, 257):
        assert torch.equal(rms_norm(x[5 : 5 + m], w, 1e-6), full_rms[5 : 5 + m])
        assert torch.equal(layer_norm(x[5 : 5 + m], w, w, 1e-5), full_ln[5 : 5 + m])
        assert torch.equal(logsumexp(logits[5 : 5 + m]), full_lse[5 : 5 + m])


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_attention_rows_match_any_batch(seed, head_dim):
    pool = Pool(8, head_dim, 16, torch.bfloat16, torch.device("cuda"), num_blocks=6000)
    kw = {"batch_invariant": True, "device": torch.device("cuda")}
    length = 3000
    table = pool.table(length)
    q = torch.randn(length, 32, head_dim, dtype=torch.bfloat16, device="cuda")
    (alone,) = attend(pool, [(q, table, length)], **kw)
    chunks = attend(pool, [(q[:1000], table, 1000), (q[1000:], table, length)], **kw)
    assert torch.equal(torch.cat(chunks), alone)
    others = [(q[:1] * 0.5, pool.table(2000), 2000) for _ in range(40)]
    decode = attend(pool, [*others, (q[-1:], table, length)], **kw)
    assert torch.equal(decode[-1], alone[-1:])
