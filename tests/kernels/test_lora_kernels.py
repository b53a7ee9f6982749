"""lora_shrink / lora_expand (paged_kernels/lora.py) against ref_lora_shrink / ref_lora_expand on
random inputs: ranks 8-48, token counts of 1 and past a tile, K and N that are not multiples of a
tile, slots with several tiles, one token, no token, and tokens without an adapter (their rows of
y untouched, bit for bit); split-K; the same bits in any token order; no host reads; argument
checks; and the segment layout of lora_segments. GPU-marked tests run a 4096 hidden size at rank
48 and a CUDA graph capture.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from host_reads import spy_host_reads

import paged_kernels.lora as lora
from paged_kernels import (
    lora_expand,
    lora_segments,
    lora_shrink,
    ref_lora_expand,
    ref_lora_shrink,
)
from paged_kernels.lora import LoraTiles

SLOTS = 4
K, N = 40, 72  # not multiples of any tile: K and N edges are masked
# Shrink's output is fp32 of products that are exact in fp32 (bf16 x bf16): only the sum order
# differs. Expand rounds once to y's dtype: at most an ulp apart there.
SHRINK_TOL = 1e-4
EXPAND_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# 16 x 16 x 16 tiles: several K steps and column tiles, segments spanning several row tiles.
SMALL = LoraTiles(16, 16, 16, 1, 4, 2)
SMALL_SPLIT = SMALL._replace(split_k=3)


def _slots(tokens: int, device, unused: int = 2) -> torch.Tensor:
    """Random slots in {-1, 0, .., SLOTS - 1} except `unused`, whose segment stays empty."""
    choices = torch.tensor([s for s in range(-1, SLOTS) if s != unused], device=device)
    return choices[torch.randint(len(choices), (tokens,), device=device)]


def _inputs(tokens: int, rank: int, dtype, device, k: int = K, n: int = N):
    x = torch.randn(tokens, k, device=device).to(dtype)
    lora_a = (torch.randn(SLOTS, rank, k, device=device) * k**-0.5).to(dtype)
    lora_b = (torch.randn(SLOTS, n, rank, device=device) * rank**-0.5).to(dtype)
    y = torch.randn(tokens, n, device=device).to(dtype)
    return x, lora_a, lora_b, y


def _run(x, lora_a, lora_b, y, slots, shrink_tiles=None, expand_tiles=None):
    """(s with rows of no-adapter tokens zeroed, y after expand) through the kernels."""
    token_idx, seg_start = lora_segments(slots, lora_a.shape[0])
    out = torch.full((x.shape[0], lora_a.shape[1]), float("nan"), device=x.device)
    s = lora_shrink(x, lora_a, token_idx, seg_start, out, tiles=shrink_tiles)
    assert s is out
    s = torch.where((slots >= 0)[:, None], s, 0.0)
    y_out = y.clone()
    assert lora_expand(s, lora_b, token_idx, seg_start, y_out, tiles=expand_tiles) is y_out
    return s, y_out


def _check(x, lora_a, lora_b, y, slots, s, y_out) -> None:
    want_s = ref_lora_shrink(x, lora_a, slots)
    torch.testing.assert_close(s, want_s, rtol=SHRINK_TOL, atol=SHRINK_TOL)
    want_y = ref_lora_expand(want_s, lora_b, slots, y.clone())
    tol = EXPAND_TOL[y.dtype]
    assert y_out.dtype == y.dtype
    torch.testing.assert_close(y_out.float(), want_y.float(), rtol=tol, atol=tol)
    none = slots < 0
    assert torch.equal(y_out[none], y[none])  # untouched rows: the same bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "rank"), [(1, 8), (37, 16), (37, 24), (20, 48)])
def test_matches_reference(seed, device, dtype, tokens, rank):
    x, lora_a, lora_b, y = _inputs(tokens, rank, dtype, device)
    slots = _slots(tokens, device) if tokens > 1 else torch.tensor([SLOTS - 1], device=device)
    _check(x, lora_a, lora_b, y, slots, *_run(x, lora_a, lora_b, y, slots))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_tiles_and_split_k(seed, device, dtype):
    """Several K steps split over 3 programs, several column and row tiles per slot; x a
    strided row view, weights not at their storage's start."""
    tokens, rank = 41, 24
    x, lora_a, lora_b, y = _inputs(tokens, rank, dtype, device)
    x_view = torch.cat([x, x], 1)[:, K:]  # rows of stride 2K
    a_view = torch.cat([lora_a[:1], lora_a])[1:]  # not at its storage's start
    slots = _slots(tokens, device, unused=0)
    for tiles in (SMALL, SMALL_SPLIT):
        got = _run(x_view, a_view, lora_b, y, slots, tiles, SMALL)
        _check(x, lora_a, lora_b, y, slots, *got)


def test_mixed_dtypes(seed, device):
    """x and lora_a of different dtypes multiply in fp32; y of another dtype than lora_b."""
    x, lora_a, lora_b, y = _inputs(19, 16, torch.bfloat16, device)
    y = y.half()
    slots = _slots(19, device)
    _check(x, lora_a.float(), lora_b, y, slots, *_run(x, lora_a.float(), lora_b, y, slots))


def test_token_order_does_not_change_bits(seed, device):
    """The tokens permuted (so segments hold them in another order, at other tile rows): each
    token's shrink row and y row have the same bits."""
    tokens, rank = 45, 24
    x, lora_a, lora_b, y = _inputs(tokens, rank, torch.bfloat16, device)
    slots = _slots(tokens, device, unused=3)
    perm = torch.randperm(tokens, device=device)
    for tiles in (None, SMALL_SPLIT):
        s, y_out = _run(x, lora_a, lora_b, y, slots, tiles)
        s_p, y_p = _run(x[perm], lora_a, lora_b, y[perm], slots[perm], tiles)
        assert torch.equal(s_p, s[perm]) and torch.equal(y_p, y_out[perm])


def test_lora_segments_layout():
    slots = np.array([1, -1, 0, 1, 0, 3, -1, 1])
    token_idx, seg_start = lora_segments(slots, 5)
    assert token_idx.dtype == seg_start.dtype == torch.int32
    assert token_idx.tolist() == [2, 4, 0, 3, 7, 5, 1, 6]  # no-adapter tokens last
    assert seg_start.tolist() == [0, 2, 5, 5, 6, 6]  # slots 2 and 4 empty
    same = lora_segments(torch.tensor(slots, dtype=torch.int32), 5)
    assert all(torch.equal(a, b) for a, b in zip(same, (token_idx, seg_start)))
    empty_idx, empty_start = lora_segments(torch.tensor([-1, -1]), 0)
    assert empty_idx.tolist() == [0, 1] and empty_start.tolist() == [0]
    assert lora_segments(torch.zeros(0, dtype=torch.int64), 2)[1].tolist() == [0, 0, 0]
    for bad, match in (([0, 4], r"\[-1, 4\)"), ([-2, 0], r"\[-2, 0\]"), ([0.0], "integers")):
        with pytest.raises(ValueError, match=match):
            lora_segments(torch.tensor(bad), 4)
    with pytest.raises(ValueError, match="1-D"):
        lora_segments(torch.zeros(2, 2, dtype=torch.int64), 4)


def test_no_host_reads(device, monkeypatch):
    """The wrappers (checks, buffers, split-K's sum) read nothing on the host: with the kernel
    launches stubbed out, not one host read happens."""
    launches = []

    class Stub:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(grid)

    monkeypatch.setattr(lora, "_lora_shrink_kernel", Stub())
    monkeypatch.setattr(lora, "_lora_expand_kernel", Stub())
    x, lora_a, lora_b, y = _inputs(9, 16, torch.float32, device)
    token_idx, seg_start = lora_segments(_slots(9, device), SLOTS)
    reads: list[str] = []
    with spy_host_reads(reads.append):
        for tiles in (None, SMALL_SPLIT):
            s = lora_shrink(x, lora_a, token_idx, seg_start, tiles=tiles)
            lora_expand(s, lora_b, token_idx, seg_start, y)
    assert reads == []
    # Static grids: (row tiles of T, column tiles [x splits], slots).
    assert launches[2] == (1, 1 * 3, SLOTS) and launches[3] == (1, 3, SLOTS)


def test_rejects_bad_arguments(device):
    x, lora_a, lora_b, y = _inputs(5, 16, torch.float32, device)
    token_idx, seg_start = lora_segments(_slots(5, device), SLOTS)
    s = torch.zeros(5, 16, device=device)
    meta = torch.empty(5, K, device="meta")
    shrink_cases = [
        ((x[0], lora_a, token_idx, seg_start), "x must be"),
        ((x, lora_a[..., 1:], token_idx, seg_start), "lora_a"),
        ((x.int(), lora_a, token_idx, seg_start), "x: unsupported dtype"),
        ((x, lora_a, token_idx.long(), seg_start), "token_idx"),
        ((x, lora_a, token_idx[:4], seg_start), "token_idx"),
        ((x, lora_a, token_idx, seg_start[1:]), "seg_start"),
        ((x, lora_a, token_idx, seg_start, s.double()), "out must be"),
        ((x, lora_a, token_idx, seg_start, s[:, 1:]), "out must be"),
        ((meta, lora_a, token_idx, seg_start), "devices"),
    ]
    for args, match in shrink_cases:
        with pytest.raises(ValueError, match=match):
            lora_shrink(*args)
    with pytest.raises(ValueError, match="tiles"):
        lora_shrink(x, lora_a, token_idx, seg_start, tiles=SMALL._replace(block_k=8))
    expand_cases = [
        ((s.bfloat16(), lora_b, token_idx, seg_start, y), "s must be float32"),
        ((s, lora_b[..., 1:], token_idx, seg_start, y), "lora_b"),
        ((s, lora_b, token_idx, seg_start, y[1:]), "y "),
        ((s, lora_b, token_idx, seg_start, y.t().contiguous().t()), "y must be contiguous"),
        ((s, lora_b, token_idx[:4], seg_start, y), "token_idx"),
    ]
    for args, match in expand_cases:
        with pytest.raises(ValueError, match=match):
            lora_expand(*args)
    with pytest.raises(ValueError, match="split_k"):
        lora_expand(s, lora_b, token_idx, seg_start, y, tiles=SMALL_SPLIT)
    assert lora_shrink(x[:0], lora_a, token_idx, seg_start).shape == (0, 16)


# A 4096 hidden size; rank 48 = q, k and v at rank 16 stacked; 4 adapter slots.
HIDDEN, RANK = 4096, 48


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 256, 4096])
def test_realistic_shapes(seed, tokens):
    device = torch.device("cuda")
    x, lora_a, lora_b, y = _inputs(tokens, RANK, torch.bfloat16, device, HIDDEN, HIDDEN)
    slots = _slots(tokens, device)
    got = _run(x, lora_a, lora_b, y, slots)
    _check(x, lora_a, lora_b, y, slots, *got)
    perm = torch.randperm(tokens, device=device)
    s_p, y_p = _run(x[perm], lora_a, lora_b, y[perm], slots[perm])
    assert torch.equal(s_p, got[0][perm]) and torch.equal(y_p, got[1][perm])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [8, 512])
def test_cuda_graph_capture_and_replay(seed, tokens):
    """Captured once, replayed on new inputs and new segments: the result of an eager call."""
    device = torch.device("cuda")
    x, lora_a, lora_b, y = _inputs(tokens, RANK, torch.bfloat16, device, HIDDEN, HIDDEN)
    token_idx, seg_start = lora_segments(_slots(tokens, device), SLOTS)
    y_graph = y.clone()

    def step() -> None:
        s = lora_shrink(x, lora_a, token_idx, seg_start)
        lora_expand(s, lora_b, token_idx, seg_start, y_graph)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for unused in (0, 3):
        x.copy_(torch.randn_like(x))
        y.copy_(torch.randn_like(y))
        slots = _slots(tokens, device, unused)
        new_idx, new_start = lora_segments(slots, SLOTS)
        token_idx.copy_(new_idx)
        seg_start.copy_(new_start)
        y_graph.copy_(y)
        graph.replay()
        _, want = _run(x, lora_a, lora_b, y, slots)
        assert torch.equal(y_graph, want)
