"""Mamba1's selective scan: selective_scan (Triton; the interpreter on CPU) and
ref_selective_scan, each against a per-token oracle written here, and the reference against
transformers' Mamba functions (mamba_selective_scan's recurrent loop, then
mamba_selective_state_update's decode steps).

Batches mix decode rows (one token continuing a slot), prefills from zeros (whose slot holds NaN,
which must be ignored), continuation chunks, an empty sequence, a padding slot -1 and pool rows
no sequence names (both must stay untouched); x is a slice of in_proj's output (x | gate) and B
and C slices of x_proj's (dt | B | C), strided views as the Mamba layer passes them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged_kernels import ref_selective_scan, selective_scan

# (atol, rtol): fp32 math everywhere on the same rounded inputs; a 16-bit pool rounds the state
# once (the interpreter's fp32 -> 16-bit cast truncates: up to one ulp).
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)}
NUM_SLOTS = 9
DT_RANK = 6

# Continuation (3), empty (fresh: its slot must stay as it is), prefill from zeros (37), padding,
# a fresh short prompt (5), decode rows continuing a slot (1, 1) and a continuation chunk (20);
# slots 0 and 8 named by no one.
LENS = [3, 0, 37, 1, 5, 1, 20, 1]
INIT = [True, False, False, True, False, True, True, True]
SLOTS = [2, 4, 6, -1, 1, 3, 5, 7]
# One token a sequence: decode rows, a fresh one-token prompt (slot 0), padding.
DECODE = ([1] * 6, [True, False, False, True, True, True], [3, 0, -1, 6, 2, 7])


def tol_of(dtype: torch.dtype) -> dict[str, float]:
    atol, rtol = TOL[dtype]
    return {"atol": atol, "rtol": rtol}


def oracle_scan(x, dt, A, B, C, ssm_state, cu, slots, init):
    """(y fp32 with NaN rows outside live sequences, the new pool), on CPU: the recurrence as
    written, one sequence and one token at a time."""
    x, dt, A, B, C = (t.cpu().float() for t in (x, dt, A, B, C))
    state = ssm_state.cpu().clone()
    out = torch.full(x.shape, float("nan"))
    cu = cu.tolist()
    for i, slot in enumerate(slots.tolist()):
        lo, hi = cu[i], cu[i + 1]
        if slot < 0 or lo == hi:
            continue
        h = state[slot].float() if bool(init[i]) else torch.zeros(state.shape[1:])  # [D, N]
        for t in range(lo, hi):
            h = torch.exp(dt[t][:, None] * A) * h + (dt[t] * x[t])[:, None] * B[t][None, :]
            out[t] = h @ C[t]
        state[slot] = h.to(state.dtype)
    return out, state


def layout(lens, init, slots, device, slot_dtype=torch.int32):
    """cu_seqlens, state_slots, has_initial_state."""
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return (
        cu.to(device),
        torch.tensor(slots, dtype=slot_dtype, device=device),
        torch.tensor(init, dtype=torch.bool, device=device),
    )


def scan_inputs(num_tokens, channels, d_state, dtype, device):
    """x, dt, A, B, C: x a view of in_proj's [T, 2 D] output, B and C of x_proj's
    [T, R + 2 N]; dt = softplus(...) with every 7th step 4.0 (a decay of up to exp(-4 N));
    A = -[1 .. N] a channel (Mamba's initialisation), scaled per channel."""
    xz = torch.randn(num_tokens, 2 * channels, device=device).to(dtype)
    proj = torch.randn(num_tokens, DT_RANK + 2 * d_state, device=device).to(dtype)
    b, c = proj[:, DT_RANK:].split([d_state, d_state], dim=1)
    dt = F.softplus(torch.randn(num_tokens, channels, device=device) - 1.0)
    dt[::7] = 4.0
    A = -torch.arange(1, d_state + 1, device=device).float().repeat(channels, 1)
    A = A * (torch.rand(channels, 1, device=device) + 0.25)
    return xz[:, :channels], dt, A, b, c


def pool_of(channels, d_state, dtype, device, slots, init, num_slots=NUM_SLOTS):
    """A random pool whose rows of fresh sequences hold NaN (never read)."""
    pool = torch.randn(num_slots, channels, d_state, device=device).to(dtype)
    for slot, has in zip(slots, init):
        if slot >= 0 and not has:
            pool[slot] = float("nan")
    return pool


def live_rows(lens, slots):
    rows, start = [], 0
    for n, s in zip(lens, slots):
        if s >= 0:
            rows += range(start, start + n)
        start += n
    return torch.tensor(rows, dtype=torch.long)


def assert_pool(got, want, before, slots, lens, tol):
    """Rows a non-empty live sequence owns match `want`; every other row equals `before`."""
    written = {s for s, n in zip(slots, lens) if s >= 0 and n > 0}
    got, want, before = got.cpu(), want.cpu(), before.cpu()
    for row in range(got.shape[0]):
        if row in written:
            torch.testing.assert_close(got[row].float(), want[row].float(), **tol)
        else:
            assert torch.equal(got[row].nan_to_num(7.0), before[row].nan_to_num(7.0)), row


def check_against_oracle(scan, batch, dtype, state_dtype, channels, d_state, device, extra=0,
                         slot_dtype=torch.int32):  # fmt: skip
    """`scan` on a batch (lens, init, slots) plus `extra` trailing tokens past cu_seqlens[S]
    against the oracle: live output rows, written pool rows, and the untouched ones."""
    lens, init, slots = batch
    x, dt, A, B, C = scan_inputs(sum(lens) + extra, channels, d_state, dtype, device)
    pool = pool_of(channels, d_state, state_dtype, device, slots, init)
    cu, state_slots, has_init = layout(lens, init, slots, device, slot_dtype)
    want, want_pool = oracle_scan(x, dt, A, B, C, pool, cu, state_slots, has_init)
    got_pool = pool.clone()
    got = scan(x, dt, A, B, C, got_pool, cu, state_slots, has_init)
    assert got.dtype == torch.float32 and got.shape == x.shape
    rows = live_rows(lens, slots)
    torch.testing.assert_close(got.cpu()[rows], want[rows], **tol_of(torch.float32))
    assert_pool(got_pool, want_pool, pool, slots, lens, tol_of(state_dtype))


# ---- The reference -----------------------------------------------------------------------------

REF_CASES = [
    # dtype, state dtype, D, N
    (torch.float32, torch.float32, 24, 16),
    (torch.bfloat16, torch.float32, 40, 12),
    (torch.float16, torch.bfloat16, 33, 16),
    (torch.float32, torch.float32, 8, 256),
]


@pytest.mark.parametrize(("dtype", "state_dtype", "channels", "d_state"), REF_CASES)
@pytest.mark.parametrize("batch", ["mixed", "decode"])
def test_ref_matches_oracle(seed, dtype, state_dtype, channels, d_state, batch):
    """A mixed batch (sequences drop out of the token steps one by one) and a decode batch."""
    lens_init_slots = (LENS, INIT, SLOTS) if batch == "mixed" else DECODE
    check_against_oracle(ref_selective_scan, lens_init_slots, dtype, state_dtype, channels,
                         d_state, "cpu")  # fmt: skip


@pytest.mark.parametrize("length", [1, 9])
def test_ref_matches_transformers(seed, length):
    """Two prompts of `length` and 4 tokens from zeros against mamba_selective_scan's recurrent
    loop (raw dt, delta_bias, delta_softplus, D=None: the skip and gate are the caller's) and
    its final states, then three decode steps of both against mamba_selective_state_update,
    which updates its state in place."""
    hf = pytest.importorskip("transformers.models.mamba.modeling_mamba")
    channels, d_state = 12, 16
    lens = [length, 4]
    x, _, A, B, C = scan_inputs(sum(lens), channels, d_state, torch.float32, "cpu")
    dt_raw, dt_bias = torch.randn(sum(lens), channels) - 1.0, torch.randn(channels) * 0.5
    dt = F.softplus(dt_raw + dt_bias)
    slots = [3, 1]
    pool = torch.full((4, channels, d_state), float("nan"))
    out = ref_selective_scan(x, dt, A, B, C, pool, *layout(lens, [False, False], slots, "cpu"))
    hf_states = []
    for lo, hi in ((0, lens[0]), (lens[0], sum(lens))):
        # the [batch, D or N, L] layout of transformers' scan
        want, state = hf.mamba_selective_scan(
            x[lo:hi].t()[None], dt_raw[lo:hi].t()[None], A, B[lo:hi].t()[None],
            C[lo:hi].t()[None], D=None, z=None, delta_bias=dt_bias, delta_softplus=True,
            return_last_state=True,
        )  # fmt: skip
        torch.testing.assert_close(out[lo:hi], want[0].t(), atol=5e-5, rtol=5e-5)
        hf_states.append(state[0])
    hf_state = torch.stack(hf_states)  # [2, D, N]
    torch.testing.assert_close(pool[slots], hf_state, atol=5e-5, rtol=5e-5)
    batch = layout([1, 1], [True, True], slots, "cpu")
    for _ in range(3):
        x, _, _, B, C = scan_inputs(2, channels, d_state, torch.float32, "cpu")
        dt_raw = torch.randn(2, channels) - 1.0
        out = ref_selective_scan(x, F.softplus(dt_raw + dt_bias), A, B, C, pool, *batch)
        want = hf.mamba_selective_state_update(
            hf_state, x, dt_raw, A, B, C, D=None, dt_bias=dt_bias, dt_softplus=True
        )
        torch.testing.assert_close(out, want, atol=5e-5, rtol=5e-5)
        torch.testing.assert_close(pool[slots], hf_state, atol=5e-5, rtol=5e-5)
    assert pool[[0, 2]].isnan().all()


# ---- The Triton kernel -------------------------------------------------------------------------

KERNEL_CASES = [
    # dtype, state dtype, D, N: tiles of BLOCK_D = 2048 // next_pow2(N) channels (at most D's)
    (torch.float32, torch.float32, 24, 16),  # one masked tile of 32
    (torch.bfloat16, torch.float32, 300, 16),  # three tiles of 128, the last masked
    (torch.float16, torch.bfloat16, 200, 12),  # N masked (BLOCK_N 16), two tiles
    (torch.bfloat16, torch.bfloat16, 20, 256),  # three tiles of 8, the last masked
    (torch.float32, torch.float32, 5, 3),
]


@pytest.mark.parametrize(("dtype", "state_dtype", "channels", "d_state"), KERNEL_CASES)
def test_kernel_matches_oracle(seed, device, dtype, state_dtype, channels, d_state):
    """Three padding tokens past cu_seqlens[S] (not read, not written)."""
    check_against_oracle(selective_scan, (LENS, INIT, SLOTS), dtype, state_dtype, channels,
                         d_state, device, extra=3)  # fmt: skip


def test_kernel_decode_batch_int64_slots(seed, device):
    check_against_oracle(selective_scan, DECODE, torch.bfloat16, torch.float32, 64, 16, device,
                         slot_dtype=torch.int64)  # fmt: skip


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_split_steps_equal_one(seed, device, impl):
    """30 tokens from zeros as one step, and as 1 + 2 + 27 tokens continuing from the slot."""
    scan = ref_selective_scan if impl == "ref" else selective_scan
    x, dt, A, B, C = scan_inputs(30, 40, 16, torch.float32, device)
    pool = torch.randn(3, 40, 16, device=device)
    whole = pool.clone()
    y = scan(x, dt, A, B, C, whole, *layout([30], [False], [1], device))
    ys = []
    for lo, hi in ((0, 1), (1, 3), (3, 30)):
        batch = layout([hi - lo], [lo > 0], [1], device)
        ys.append(scan(x[lo:hi], dt[lo:hi], A, B[lo:hi], C[lo:hi], pool, *batch))
    torch.testing.assert_close(torch.cat(ys), y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pool, whole, atol=1e-4, rtol=1e-4)


def test_kernel_empty_batches(device):
    """No tokens, and sequences that are all empty or padding: nothing runs, the pool stays."""
    x, dt, A, B, C = scan_inputs(2, 8, 4, torch.float32, device)
    pool = torch.randn(2, 8, 4, device=device)
    before = pool.clone()
    out = selective_scan(x[:0], dt[:0], A, B[:0], C[:0], pool, *layout([0], [True], [0], device))
    assert out.shape == (0, 8)
    selective_scan(x, dt, A, B, C, pool, *layout([0, 2], [True, True], [0, -1], device))
    assert torch.equal(pool, before)


def test_kernel_bad_arguments(device):
    x, dt, A, B, C = scan_inputs(2, 8, 4, torch.float32, device)
    pool = torch.zeros(2, 8, 4, device=device)
    batch = layout([2], [True], [0], device)
    wide_a, wide_bc = torch.zeros(8, 512, device=device), torch.zeros(2, 512, device=device)
    wide_pool = torch.zeros(2, 8, 512, device=device)
    cases = [
        ("x must be", (x[:, None], dt, A, B, C, pool, *batch)),
        ("dt must be float32", (x, dt.bfloat16(), A, B, C, pool, *batch)),
        ("dt must be float32", (x, dt[:1], A, B, C, pool, *batch)),
        ("A must be float32", (x, dt, A[:, :3], B, C, pool, *batch)),
        ("A must be float32", (x, dt, A.double(), B, C, pool, *batch)),
        ("B must be", (x, dt, A, B[:1], C, pool, *batch)),
        ("C must be", (x, dt, A, B, C[:, :3], pool, *batch)),
        ("N must be", (x, dt, wide_a, wide_bc, wide_bc, wide_pool, *batch)),
        ("ssm_state must be", (x, dt, A, B, C, pool[:, :4], *batch)),
        ("B must be contiguous", (x, dt, A, B.t().contiguous().t(), C, pool, *batch)),
        ("x: unsupported dtype", (x.double(), dt, A, B, C, pool, *batch)),
        ("cu_seqlens", (x, dt, A, B, C, pool, batch[0].long(), *batch[1:])),
        ("state_slots", (x, dt, A, B, C, pool, batch[0], batch[1].short(), batch[2])),
        ("has_initial_state", (x, dt, A, B, C, pool, *batch[:2], batch[2].int())),
    ]  # fmt: skip
    for match, args in cases:
        with pytest.raises(ValueError, match=match):
            selective_scan(*args)


@pytest.mark.gpu
def test_gpu_mamba_sizes(seed):
    """Mamba-2.8B's (D = 5120) and Jamba's (D = 8192) mixers, N = 16, on one GPU: decode rows and
    prefills, bf16 activations, fp32 and bf16 pools, against the reference."""
    device = torch.device("cuda")
    lens = [1] * 32 + [300, 17, 1000]
    init = [True] * 32 + [False, True, False]
    slots = torch.randperm(64)[: len(lens)].tolist()
    for channels in (5120, 8192):
        for state_dtype in (torch.float32, torch.bfloat16):
            x, dt, A, B, C = scan_inputs(sum(lens), channels, 16, torch.bfloat16, device)
            pool = pool_of(channels, 16, state_dtype, device, slots, init, num_slots=64)
            batch = layout(lens, init, slots, device)
            want_pool = pool.clone()
            want = ref_selective_scan(x, dt, A, B, C, want_pool, *batch)
            got_pool = pool.clone()
            got = selective_scan(x, dt, A, B, C, got_pool, *batch)
            rows = live_rows(lens, slots).to(device)
            torch.testing.assert_close(got[rows], want[rows], **tol_of(torch.float32))
            assert_pool(got_pool, want_pool, pool, slots, lens, tol_of(state_dtype))
