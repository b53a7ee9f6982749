"""Kimi Delta Attention (KDA, Kimi Linear): the gated delta rule with a per-key-channel decay,
gated_delta_rule / ref_gated_delta_rule given g [T, H, Dk] instead of [T, H].

The reference (batched token steps for short sequences, _kda_chunks for long ones) against
test_linear_attention.py's per-token oracle (its per-channel decay as transformers'
fused_recurrent_kda fallback has it) and against
transformers' own torch functions; the Triton kernel against the reference on the varlen batches
of test_linear_attention.py (empty, decode, 70-token sequences, fresh NaN rows, a padding slot,
untouched rows) in fp32 / bf16 / fp16, and a sequence run in two steps against it run whole.
Heads as KDA has them: as many key heads as value heads."""

from __future__ import annotations

import pytest
import torch
from test_linear_attention import (
    INIT,
    LENS,
    NUM_SLOTS,
    SLOTS,
    assert_pool,
    layout,
    live_rows,
    oracle_delta_rule,
    poison_fresh,
    tol_of,
)

from paged_kernels import gated_delta_rule, ref_gated_delta_rule


def kda_inputs(lens, heads, dk, dv, dtype, device):
    t = sum(lens)
    q = torch.randn(t, heads, dk, device=device).to(dtype)
    k = torch.randn(t, heads, dk, device=device).to(dtype)
    v = torch.randn(t, heads, dv, device=device).to(dtype)
    g = -torch.rand(t, heads, dk, device=device) * 2  # exp(g) in (0.13, 1] a channel
    g[::7, :, : dk // 2] = -30.0  # half the channels wiped, the other half kept
    g[::13, 0] = 0.0  # a head that keeps everything
    beta = torch.rand(t, heads, device=device).to(dtype)
    return q, k, v, g, beta


# ---- The reference ---------------------------------------------------------------------------


def test_ref_kda_matches_oracle(seed):
    """Short (token steps), long (chunks: 70, 150 tokens) and empty sequences in one batch."""
    lens, init, slots = [*LENS, 150, 17], [*INIT, True, False], [*SLOTS, 0, 5]
    q, k, v, g, beta = kda_inputs(lens, 3, 16, 24, torch.float32, "cpu")
    pool = torch.randn(NUM_SLOTS, 3, 16, 24)
    poison_fresh(pool, slots, init)
    batch = layout(lens, init, slots, "cpu")
    want_out, want_pool = oracle_delta_rule(q, k, v, g, beta, pool, *batch)
    got_pool = pool.clone()
    out = ref_gated_delta_rule(q, k, v, g, beta, got_pool, *batch)
    rows = live_rows(lens, slots)
    torch.testing.assert_close(out[rows], want_out[rows], atol=5e-5, rtol=5e-5)
    assert_pool(got_pool, want_pool, pool, slots, lens, {"atol": 5e-5, "rtol": 5e-5})


def test_ref_kda_decode_batch(seed):
    """Every sequence one token: one batched step; bf16 inputs and pool, no L2 norm in the op,
    an explicit scale."""
    lens, init, slots = [1] * 6, [True, False, True, True, False, True], [3, 0, -1, 6, 2, 7]
    q, k, v, g, beta = kda_inputs(lens, 2, 16, 16, torch.bfloat16, "cpu")
    pool = torch.randn(NUM_SLOTS, 2, 16, 16).to(torch.bfloat16)
    batch = layout(lens, init, slots, "cpu")
    args = (q, k, v, g, beta)
    want_out, want_pool = oracle_delta_rule(*args, pool, *batch, scale=0.3, l2norm=False)
    got_pool = pool.clone()
    out = ref_gated_delta_rule(*args, got_pool, *batch, scale=0.3, use_qk_l2norm=False)
    rows = live_rows(lens, slots)
    torch.testing.assert_close(out[rows].float(), want_out[rows], **tol_of(torch.bfloat16))
    assert_pool(got_pool, want_pool, pool, slots, lens, tol_of(torch.bfloat16))


@pytest.mark.parametrize("length", [5, 100])
def test_ref_kda_matches_transformers(seed, length):
    """One sequence with an initial state against transformers' Kimi Linear torch functions
    ([B, L, H, D] batches): chunk_kimi_delta_attention (the prefill's, 100 tokens: two of its
    64-token chunks) and recurrent_kimi_delta_attention (the decode's, 5 tokens)."""
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    q, k, v, g, beta = kda_inputs([length], 2, 32, 16, torch.float32, "cpu")
    init_state = torch.randn(1, 2, 32, 16)
    pool = torch.zeros(2, 2, 32, 16)
    pool[1] = init_state[0]
    out = ref_gated_delta_rule(q, k, v, g, beta, pool, *layout([length], [True], [1], "cpu"))
    fn = kimi.chunk_kimi_delta_attention if length > 16 else kimi.recurrent_kimi_delta_attention
    want_out, want_state = fn(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=init_state,
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    torch.testing.assert_close(out, want_out[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pool[1], want_state[0], atol=1e-4, rtol=1e-4)
    assert pool[0].eq(0).all()


# ---- The Triton kernel against the reference -------------------------------------------------


KDA_CASES = [
    # dtype, state dtype, H, Dk, Dv
    (torch.float32, torch.float32, 2, 16, 32),
    (torch.bfloat16, torch.float32, 3, 16, 24),
    (torch.float16, torch.bfloat16, 2, 32, 16),
]


@pytest.mark.parametrize(("dtype", "state_dtype", "heads", "dk", "dv"), KDA_CASES)
def test_kda_kernel_matches_reference(seed, device, dtype, state_dtype, heads, dk, dv):
    lens, init, slots = LENS, INIT, SLOTS
    q, k, v, g, beta = kda_inputs(lens, heads, dk, dv, dtype, device)
    # Output views of fused projections: rows strided, heads and channels contiguous.
    v = torch.cat([v, torch.zeros_like(v)], dim=1)[:, :heads]
    g = torch.cat([g, torch.zeros_like(g)], dim=1)[:, :heads]
    pool = torch.randn(NUM_SLOTS, heads, dk, dv, device=device).to(state_dtype)
    poison_fresh(pool, slots, init)
    batch = layout(lens, init, slots, device)
    want_pool = pool.clone()
    want = ref_gated_delta_rule(q, k, v, g, beta, want_pool, *batch)
    got_pool = pool.clone()
    got = gated_delta_rule(q, k, v, g, beta, got_pool, *batch)
    assert got.dtype == dtype and got.shape == want.shape
    rows = live_rows(lens, slots).to(device)
    tol = tol_of(dtype if state_dtype == torch.float32 else state_dtype)
    torch.testing.assert_close(got[rows].float(), want[rows].float(), **tol)
    assert_pool(got_pool, want_pool, pool, slots, lens, tol)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_kda_two_steps_equal_one(seed, device, impl):
    """40 tokens as one step, and as 3 + 37 (the second continuing from the slot); the
    reference's steps are chunked (> 16 tokens) or token by token."""
    delta = ref_gated_delta_rule if impl == "ref" else gated_delta_rule
    q, k, v, g, beta = kda_inputs([40], 2, 16, 16, torch.float32, device)
    pool = torch.randn(2, 2, 16, 16, device=device)
    whole = pool.clone()
    o = delta(q, k, v, g, beta, whole, *layout([40], [True], [1], device))
    parts, outs = pool.clone(), []
    for lo, hi in ((0, 3), (3, 40)):
        args = (t[lo:hi] for t in (q, k, v, g, beta))
        outs.append(delta(*args, parts, *layout([hi - lo], [True], [1], device)))
    torch.testing.assert_close(torch.cat(outs), o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(parts, whole, atol=1e-4, rtol=1e-4)


def test_kda_bad_gate(device):
    q, k, v, g, beta = kda_inputs([2], 2, 16, 16, torch.float32, device)
    batch = layout([2], [True], [0], device)
    pool = torch.zeros(1, 2, 16, 16, device=device)
    with pytest.raises(ValueError, match="g must be"):
        gated_delta_rule(q, k, v, g[..., :8], beta, pool, *batch)
    with pytest.raises(ValueError, match="g must be"):
        gated_delta_rule(q, k, v, g.half(), beta, pool, *batch)


# ---- GPU only: Kimi-Linear-48B's sizes -------------------------------------------------------


@pytest.mark.gpu
def test_gpu_kimi_linear_sizes(seed):
    """32 heads of 128, decode rows and prefills, bf16, fp32 state pool."""
    device = torch.device("cuda")
    lens = [1] * 32 + [300, 17, 1000]
    init = [True] * 32 + [False, True, False]
    slots = torch.randperm(64)[: len(lens)].tolist()
    q, k, v, g, beta = kda_inputs(lens, 32, 128, 128, torch.bfloat16, device)
    pool = torch.randn(64, 32, 128, 128, device=device)
    poison_fresh(pool, slots, init)
    batch = layout(lens, init, slots, device)
    before, want_pool = pool.clone(), pool.clone()
    want = ref_gated_delta_rule(q, k, v, g, beta, want_pool, *batch)
    got = gated_delta_rule(q, k, v, g, beta, pool, *batch)
    rows = live_rows(lens, slots).to(device)
    tol = tol_of(torch.bfloat16)
    torch.testing.assert_close(got[rows].float(), want[rows].float(), **tol)
    assert_pool(pool, want_pool, before, slots, lens, tol)
