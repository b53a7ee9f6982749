"""Linear attention: causal_conv1d and gated_delta_rule (Gated DeltaNet: Qwen3-Next / Qwen3.5),
ssd_scan (Mamba2: Granite 4.0-H, Nemotron-H).

The references (ref_causal_conv1d: one gather a tap; ref_gated_delta_rule and ref_ssd_scan:
batched token steps for short sequences, the chunked form for long ones) against a per-token
oracle written here and against transformers' Qwen3-Next and Granite 4.0-H torch functions; the
Triton kernels against the references on varlen batches: empty, 1-, 3- and 70-token sequences
(70 crosses a 64-token chunk), mixed initial states (a fresh slot holds NaN, which must be
ignored), a padding slot -1 and pool rows no sequence names (both must stay untouched), and a
sequence run in two halves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged_kernels import (
    causal_conv1d,
    gated_delta_rule,
    ref_causal_conv1d,
    ref_gated_delta_rule,
    ref_ssd_scan,
    ssd_scan,
)

# (atol, rtol) of outputs and states: fp32 math everywhere; 16-bit outputs round once (the
# interpreter's fp32 -> bf16 cast truncates: up to one bf16 ulp).
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)}
NUM_SLOTS = 8


# ---- The oracle: the recurrences as written, one sequence and one token at a time ------------


def oracle_conv1d(x, weight, bias, conv_state, cu, slots, init, activation="silu"):
    """(out fp32 with NaN rows for padding, the new pool)."""
    state = conv_state.clone()
    out = torch.full(x.shape, float("nan"))
    cu, width = cu.tolist(), weight.shape[1]
    for i, slot in enumerate(slots.tolist()):
        a, b = cu[i], cu[i + 1]
        if slot < 0:
            continue
        ctx = state[slot].float() if init[i] else torch.zeros(x.shape[1], width - 1)
        xin = torch.cat([ctx, x[a:b].float().t()], dim=1)  # [C, K - 1 + L]
        for t in range(b - a):
            y = (xin[:, t : t + width] * weight.float()).sum(1)
            y = y if bias is None else y + bias.float()
            out[a + t] = F.silu(y) if activation == "silu" else y
        if b > a:
            state[slot] = xin[:, -(width - 1) :].to(state.dtype)
    return out, state


def oracle_delta_rule(q, k, v, g, beta, ssm_state, cu, slots, init, scale=None, l2norm=True):
    """(out fp32 with NaN rows for padding, the new pool); heads side by side. transformers'
    recurrence, per token: q, k <- x / sqrt(|x|^2 + 1e-6), q *= scale; S *= exp(g), g [T, Hv]
    one decay a head or [T, Hv, Dk] one a key channel (Kimi Delta Attention: row i of S by
    exp(g[i])); S += k (beta (v - k^T S))^T; o = q^T S."""
    state = ssm_state.clone()
    out = torch.full(v.shape, float("nan"))
    group = v.shape[1] // q.shape[1]
    scale = q.shape[2] ** -0.5 if scale is None else scale
    cu = cu.tolist()
    for i, slot in enumerate(slots.tolist()):
        a, b = cu[i], cu[i + 1]
        if slot < 0 or a == b:
            continue
        s = state[slot].float() if init[i] else torch.zeros(state.shape[1:])  # [Hv, Dk, Dv]
        for t in range(a, b):
            qt = q[t].float().repeat_interleave(group, 0)  # [Hv, Dk]
            kt = k[t].float().repeat_interleave(group, 0)
            if l2norm:
                qt = qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + 1e-6)
                kt = kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + 1e-6)
            decay = g[t].float().exp()  # [Hv] or [Hv, Dk]
            s = s * (decay[:, None, None] if decay.dim() == 1 else decay[:, :, None])
            recalled = torch.einsum("hk,hkv->hv", kt, s)
            delta = (v[t].float() - recalled) * beta[t].float()[:, None]
            s = s + kt[:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hk,hkv->hv", qt * scale, s)
        state[slot] = s.to(state.dtype)
    return out, state


# ---- Batches ---------------------------------------------------------------------------------


def layout(lens, init, slots, device):
    """cu_seqlens, state_slots, has_initial_state; slot rows of fresh sequences hold NaN."""
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return (
        cu.to(device),
        torch.tensor(slots, dtype=torch.int32, device=device),
        torch.tensor(init, dtype=torch.bool, device=device),
    )


def poison_fresh(pool, slots, init):
    for slot, has in zip(slots, init):
        if slot >= 0 and not has:
            pool[slot] = float("nan")


def delta_inputs(lens, hk, hv, dk, dv, dtype, device):
    t = sum(lens)
    q = torch.randn(t, hk, dk, device=device).to(dtype)
    k = torch.randn(t, hk, dk, device=device).to(dtype)
    v = torch.randn(t, hv, dv, device=device).to(dtype)
    g = -torch.rand(t, hv, device=device) * 3  # exp(g) in (0.05, 1]
    g[::11] = -30.0  # a decay that wipes the state
    beta = torch.rand(t, hv, device=device).to(dtype)
    return q, k, v, g, beta


def conv_inputs(lens, channels, width, dtype, device, bias):
    x = torch.randn(sum(lens), channels, device=device).to(dtype)
    weight = (torch.randn(channels, width, device=device) * 0.5).to(dtype)
    b = torch.randn(channels, device=device).to(dtype) if bias else None
    return x, weight, b


def assert_pool(got, want, before, slots, lens, tol):
    """Rows a non-empty live sequence owns match `want`; every other row equals `before`."""
    written = {s for s, n in zip(slots, lens) if s >= 0 and n > 0}
    for row in range(got.shape[0]):
        if row in written:
            torch.testing.assert_close(got[row].float().cpu(), want[row].float().cpu(), **tol)
        else:
            assert torch.equal(got[row].nan_to_num(7.0), before[row].nan_to_num(7.0)), row


def live_rows(lens, slots):
    rows, start = [], 0
    for n, s in zip(lens, slots):
        if s >= 0:
            rows += range(start, start + n)
        start += n
    return torch.tensor(rows, dtype=torch.long)


def tol_of(dtype):
    atol, rtol = TOL[dtype]
    return {"atol": atol, "rtol": rtol}


# Empty, decode, short and chunk-crossing sequences; mixed initial states; a padding slot (-1)
# whose tokens must be skipped; slots 0, 5 and 7 named by no sequence.
LENS = [3, 0, 70, 1, 5, 1]
INIT = [True, True, False, True, False, True]
SLOTS = [2, 4, 6, -1, 1, 3]


# ---- The references --------------------------------------------------------------------------


@pytest.mark.parametrize("group", [1, 2])
def test_ref_delta_rule_matches_oracle(seed, group):
    """Short (token steps), long (chunks: 70, 150 tokens) and empty sequences in one batch."""
    lens, init, slots = [*LENS, 150, 17], [*INIT, True, False], [*SLOTS, 0, 5]
    q, k, v, g, beta = delta_inputs(lens, 2, 2 * group, 16, 24, torch.float32, "cpu")
    pool = torch.randn(NUM_SLOTS, 2 * group, 16, 24)
    poison_fresh(pool, slots, init)
    batch = layout(lens, init, slots, "cpu")
    want_out, want_pool = oracle_delta_rule(q, k, v, g, beta, pool, *batch)
    got_pool = pool.clone()
    out = ref_gated_delta_rule(q, k, v, g, beta, got_pool, *batch)
    rows = live_rows(lens, slots)
    torch.testing.assert_close(out[rows], want_out[rows], atol=5e-5, rtol=5e-5)
    assert_pool(got_pool, want_pool, pool, slots, lens, {"atol": 5e-5, "rtol": 5e-5})


def test_ref_delta_rule_decode_batch(seed):
    """Every sequence one token: a single batched step; bf16 pool, no L2 norm in the op
    (pre-normalised keys), an explicit scale."""
    lens, init, slots = [1] * 6, [True, False, True, True, False, True], [3, 0, -1, 6, 2, 7]
    q, k, v, g, beta = delta_inputs(lens, 2, 4, 16, 16, torch.bfloat16, "cpu")
    q, k = F.normalize(q.float(), dim=-1), F.normalize(k.float(), dim=-1)
    pool = torch.randn(NUM_SLOTS, 4, 16, 16).to(torch.bfloat16)
    batch = layout(lens, init, slots, "cpu")
    args = (q, k, v, g, beta)
    want_out, want_pool = oracle_delta_rule(*args, pool, *batch, scale=0.3, l2norm=False)
    got_pool = pool.clone()
    out = ref_gated_delta_rule(*args, got_pool, *batch, scale=0.3, use_qk_l2norm=False)
    rows = live_rows(lens, slots)
    torch.testing.assert_close(out[rows].float(), want_out[rows], **tol_of(torch.bfloat16))
    assert_pool(got_pool, want_pool, pool, slots, lens, tol_of(torch.bfloat16))


@pytest.mark.parametrize("length", [5, 150])
def test_ref_delta_rule_matches_transformers(seed, length):
    """One sequence with an initial state against transformers' chunked (150 tokens) and
    recurrent (5) Qwen3-Next functions, which take [B, L, H, D] batches."""
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta = delta_inputs([length], 2, 4, 32, 16, torch.float32, "cpu")
    init_state = torch.randn(1, 4, 32, 16)
    pool = torch.zeros(2, 4, 32, 16)
    pool[1] = init_state[0]
    out = ref_gated_delta_rule(q, k, v, g, beta, pool, *layout([length], [True], [1], "cpu"))
    fn = qwen3_next.torch_chunk_gated_delta_rule
    if length < 64:
        fn = qwen3_next.torch_recurrent_gated_delta_rule
    # Each value head reads key head h // 2 (as Qwen3-Next's layer repeats them): expanded
    # here, since transformers' functions broadcast key heads only in newer releases (5.24, not
    # 5.17).
    q_x, k_x = (t.repeat_interleave(2, dim=1) for t in (q, k))
    want_out, want_state = fn(
        q_x[None], k_x[None], v[None], g[None], beta[None], initial_state=init_state,
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    torch.testing.assert_close(out, want_out[0], atol=5e-5, rtol=5e-5)
    torch.testing.assert_close(pool[1], want_state[0], atol=5e-5, rtol=5e-5)
    assert pool[0].eq(0).all()


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_ref_conv1d_matches_oracle(seed, width, bias):
    """Sequences shorter than K - 1 keep part of the old context, shifted."""
    x, weight, b = conv_inputs(LENS, 12, width, torch.float32, "cpu", bias)
    pool = torch.randn(NUM_SLOTS, 12, width - 1)
    poison_fresh(pool, SLOTS, INIT)
    batch = layout(LENS, INIT, SLOTS, "cpu")
    for activation in ("silu", None):
        want_out, want_pool = oracle_conv1d(x, weight, b, pool, *batch, activation)
        got_pool = pool.clone()
        out = ref_causal_conv1d(x, weight, b, got_pool, *batch, activation)
        rows = live_rows(LENS, SLOTS)
        torch.testing.assert_close(out[rows], want_out[rows])
        assert_pool(got_pool, want_pool, pool, SLOTS, LENS, tol_of(torch.float32))


def test_ref_conv1d_matches_transformers(seed):
    """A fresh prompt against causal_conv1d_fn ([B, C, L] layout), then a decode step of two
    sequences and a 2-token step against causal_conv1d_update."""
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    x, weight, bias = conv_inputs([9], 12, 4, torch.float32, "cpu", bias=True)
    pool = torch.full((3, 12, 3), float("nan"))
    out = ref_causal_conv1d(x, weight, bias, pool, *layout([9], [False], [2], "cpu"))
    want = qwen3_next.causal_conv1d_fn(x.t()[None], weight, bias, activation="silu")
    torch.testing.assert_close(out, want[0].t())
    torch.testing.assert_close(pool[2], x[-3:].t())

    for lens in ([1, 1], [2]):
        x = torch.randn(sum(lens), 12)
        hf_state = torch.randn(len(lens), 12, 3)
        pool = torch.zeros(3, 12, 3)
        pool[2], pool[0, :, :] = hf_state[0], hf_state[-1]
        slots = [2, 0][: len(lens)]
        out = ref_causal_conv1d(
            x, weight, bias, pool, *layout(lens, [True] * len(lens), slots, "cpu")
        )
        hf_x = x.view(len(lens), -1, 12).transpose(1, 2)  # [B, C, L]
        want = qwen3_next.causal_conv1d_update(hf_x, hf_state, weight, bias, activation="silu")
        torch.testing.assert_close(out, want.transpose(1, 2).reshape(-1, 12))
        torch.testing.assert_close(pool[slots], hf_state)


def test_ref_conv1d_decode_batch_equals_the_general_path():
    """A batch of one token a sequence takes the reference's decode shortcut; the same batch
    with an empty padding sequence appended takes the general gather path: both agree, with
    fresh rows (NaN-filled) beside continued ones."""
    x, weight, bias = conv_inputs([1, 1, 1], 12, 4, torch.float32, "cpu", bias=True)
    pool = torch.randn(4, 12, 3)
    pool[1] = float("nan")  # fresh: must be ignored
    pools = [pool, pool.clone()]
    init, slots = [True, False, True], [2, 1, 0]
    fast = ref_causal_conv1d(x, weight, bias, pools[0], *layout([1, 1, 1], init, slots, "cpu"))
    general = ref_causal_conv1d(
        x, weight, bias, pools[1], *layout([1, 1, 1, 0], [*init, False], [*slots, -1], "cpu")
    )
    torch.testing.assert_close(fast, general)
    torch.testing.assert_close(pools[0], pools[1], equal_nan=True)


# ---- The Triton kernels against the references ----------------------------------------------


DELTA_CASES = [
    # dtype, state dtype, Hk, Hv, Dk, Dv
    (torch.float32, torch.float32, 2, 2, 16, 32),
    (torch.bfloat16, torch.float32, 2, 4, 16, 32),
    (torch.bfloat16, torch.bfloat16, 1, 4, 32, 16),
    (torch.float16, torch.float32, 1, 2, 32, 24),  # (2 K heads under GQA: the case above)
]


@pytest.mark.parametrize(("dtype", "state_dtype", "hk", "hv", "dk", "dv"), DELTA_CASES)
def test_gated_delta_rule_matches_reference(seed, device, dtype, state_dtype, hk, hv, dk, dv):
    _check_delta(LENS, INIT, SLOTS, dtype, state_dtype, hk, hv, dk, dv, device)


def test_gated_delta_rule_qwen3_next_head_size(seed, device):
    """Dk = Dv = 128 (Qwen3-Next, Qwen3.5): several value tiles a head, GQA 2."""
    _check_delta([2, 1], [True, False], [5, 0], torch.bfloat16, torch.float32, 1, 2, 128, 128,
                 device)  # fmt: skip


def _check_delta(lens, init, slots, dtype, state_dtype, hk, hv, dk, dv, device):
    q, k, v, g, beta = delta_inputs(lens, hk, hv, dk, dv, dtype, device)
    # The output view of a fused projection: rows strided, heads contiguous.
    v = torch.cat([v, torch.zeros_like(v)], dim=1)[:, :hv]
    num_slots = max(NUM_SLOTS, max(slots) + 1)
    pool = torch.randn(num_slots, hv, dk, dv, device=device).to(state_dtype)
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


@pytest.mark.parametrize(
    ("dtype", "width", "bias"),
    [
        (torch.float32, 4, True),
        (torch.bfloat16, 4, False),
        (torch.float16, 2, True),
        (torch.bfloat16, 3, True),
    ],
)
def test_causal_conv1d_matches_reference(seed, device, dtype, width, bias):
    """200 channels: a second, partly masked channel tile; a bf16 pool holds exact inputs."""
    x, weight, b = conv_inputs(LENS, 200, width, dtype, device, bias)
    x = torch.cat([x, x], dim=1)[:, :200]  # strided rows
    pool = torch.randn(NUM_SLOTS, 200, width - 1, device=device).to(dtype)
    poison_fresh(pool, SLOTS, INIT)
    batch = layout(LENS, INIT, SLOTS, device)
    want_pool = pool.clone()
    want = ref_causal_conv1d(x, weight, b, want_pool, *batch)
    got_pool = pool.clone()
    got = causal_conv1d(x, weight, b, got_pool, *batch)
    rows = live_rows(LENS, SLOTS).to(device)
    torch.testing.assert_close(got[rows].float(), want[rows].float(), **tol_of(dtype))
    assert_pool(got_pool, want_pool, pool, SLOTS, LENS, {"atol": 0, "rtol": 0})


def test_causal_conv1d_no_activation(seed, device):
    x, weight, b = conv_inputs([5, 1], 16, 4, torch.float32, device, bias=True)
    pool = torch.randn(2, 16, 3, device=device)
    batch = layout([5, 1], [False, True], [1, 0], device)
    want = ref_causal_conv1d(x, weight, b, pool.clone(), *batch, activation=None)
    got = causal_conv1d(x, weight, b, pool, *batch, activation=None)
    torch.testing.assert_close(got, want, **tol_of(torch.float32))


# ---- Continuation: a sequence run in two steps equals it run whole ---------------------------


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_two_steps_equal_one(seed, device, impl):
    """67 tokens as one step, and as 2 + 65 tokens (the second step continuing from the slot);
    the conv with 2 tokens (< K - 1 = 3) then 65. The reference's second step is chunked."""
    conv = ref_causal_conv1d if impl == "ref" else causal_conv1d
    delta = ref_gated_delta_rule if impl == "ref" else gated_delta_rule
    x, weight, b = conv_inputs([67], 16, 4, torch.float32, device, bias=True)
    q, k, v, g, beta = delta_inputs([67], 1, 2, 16, 16, torch.float32, device)  # GQA 2
    conv_pool = torch.randn(2, 16, 3, device=device)
    delta_pool = torch.randn(2, 2, 16, 16, device=device)
    whole = (conv_pool.clone(), delta_pool.clone())
    y = conv(x, weight, b, whole[0], *layout([67], [True], [1], device))
    o = delta(q, k, v, g, beta, whole[1], *layout([67], [True], [1], device))
    parts = (conv_pool.clone(), delta_pool.clone())
    ys, os = [], []
    for lo, hi in ((0, 2), (2, 67)):
        batch = layout([hi - lo], [True], [1], device)
        ys.append(conv(x[lo:hi], weight, b, parts[0], *batch))
        args = (t[lo:hi] for t in (q, k, v, g, beta))
        os.append(delta(*args, parts[1], *batch))
    torch.testing.assert_close(torch.cat(ys), y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(os), o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(parts[0], whole[0], atol=0, rtol=0)
    torch.testing.assert_close(parts[1], whole[1], atol=1e-4, rtol=1e-4)


def test_bad_arguments(device):
    x, weight, b = conv_inputs([2], 8, 4, torch.float32, device, bias=False)
    batch = layout([2], [True], [0], device)
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d(x, weight, b, torch.zeros(1, 8, 4, device=device), *batch)
    with pytest.raises(ValueError, match="has_initial_state"):
        causal_conv1d(x, weight, b, torch.zeros(1, 8, 3, device=device), *batch[:2], batch[1])
    q, k, v, g, beta = delta_inputs([2], 2, 3, 16, 16, torch.float32, device)
    with pytest.raises(ValueError, match="multiple"):
        gated_delta_rule(q, k, v, g, beta, torch.zeros(1, 3, 16, 16, device=device), *batch)


# ---- GPU only: Qwen3-Next's sizes ------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_qwen3_next_sizes(seed):
    """16 key / 32 value heads of 128, decode rows and prefills, bf16, fp32 state pool."""
    device = torch.device("cuda")
    lens = [1] * 32 + [300, 17, 1000]
    init = [True] * 32 + [False, True, False]
    slots = torch.randperm(64)[: len(lens)].tolist()
    _check_delta(lens, init, slots, torch.bfloat16, torch.float32, 16, 32, 128, 128, device)
    x, weight, _ = conv_inputs(lens, 8192, 4, torch.bfloat16, device, bias=False)
    pool = torch.randn(64, 8192, 3, device=device).to(torch.bfloat16)
    batch = layout(lens, init, slots, device)
    want_pool = pool.clone()
    want = ref_causal_conv1d(x, weight, None, want_pool, *batch)
    got = causal_conv1d(x, weight, None, pool, *batch)
    torch.testing.assert_close(got.float(), want.float(), **tol_of(torch.bfloat16))
    assert torch.equal(pool, want_pool)


# ---- Mamba2's selective scan (ssd_scan) ------------------------------------------------------

# fp32 outputs y = S . C: N products of a state summing dt x B over the tokens, up to ~100 in
# size, so y near 0 keeps ~1e-6 of that scale as rounding (the reference's chunks exponentiate
# differences of a cumsum of dt A reaching -170): up to ~1e-4 absolute (1 seed in 2,000 past
# 1e-4). A wrong decay, step or group moves y by O(|y|), far past 5e-4.
SSD_OUT_TOL = {"atol": 5e-4, "rtol": 1e-4}


def oracle_ssd(x, dt, A, B, C, ssm_state, cu, slots, init):
    """(y fp32 with NaN rows for padding, the new pool); heads side by side."""
    state = ssm_state.clone()
    out = torch.full(x.shape, float("nan"))
    group = x.shape[1] // B.shape[1]
    cu = cu.tolist()
    for i, slot in enumerate(slots.tolist()):
        a, b = cu[i], cu[i + 1]
        if slot < 0 or a == b:
            continue
        s = state[slot].float() if init[i] else torch.zeros(state.shape[1:])  # [H, P, N]
        for t in range(a, b):
            bt = B[t].float().repeat_interleave(group, 0)  # [H, N]
            ct = C[t].float().repeat_interleave(group, 0)
            u = dt[t, :, None] * x[t].float()  # [H, P]
            s = s * torch.exp(dt[t] * A)[:, None, None] + u[:, :, None] * bt[:, None, :]
            out[t] = torch.einsum("hpn,hn->hp", s, ct)
        state[slot] = s.to(state.dtype)
    return out, state


def ssd_inputs(lens, heads, groups, dim, d_state, dtype, device):
    """x, dt, A, B, C; x, B and C views of one fused [T, H P + 2 G N] row, as the layer splits
    its conv output (strided rows)."""
    t = sum(lens)
    xbc = torch.randn(t, heads * dim + 2 * groups * d_state, device=device).to(dtype)
    x, b, c = xbc.split([heads * dim, groups * d_state, groups * d_state], dim=1)
    dt = torch.rand(t, heads, device=device) * 0.5
    # A step whose decay all but wipes the state (dt A in [-28, -4]). Far stronger ones are
    # unrealistic and cost the reference's chunked form precision: it exponentiates differences
    # of a chunk's cumsum of dt A, which then reaches hundreds.
    dt[::11] = 8.0
    A = -(torch.rand(heads, device=device) * 3 + 0.5)
    shape = (t, groups, d_state)
    return x.view(t, heads, dim), dt, A, b.view(shape), c.view(shape)


@pytest.mark.parametrize("groups", [4, 1])
def test_ref_ssd_matches_oracle(seed, groups):
    """Short (token steps), long (chunks: 70, 150 tokens) and empty sequences in one batch;
    H == G and H = 4 G."""
    lens, init, slots = [*LENS, 150, 17], [*INIT, True, False], [*SLOTS, 0, 5]
    x, dt, A, B, C = ssd_inputs(lens, 4, groups, 8, 16, torch.float32, "cpu")
    pool = torch.randn(NUM_SLOTS, 4, 8, 16)
    poison_fresh(pool, slots, init)
    batch = layout(lens, init, slots, "cpu")
    want_out, want_pool = oracle_ssd(x, dt, A, B, C, pool, *batch)
    got_pool = pool.clone()
    out = ref_ssd_scan(x, dt, A, B, C, got_pool, *batch)
    rows = live_rows(lens, slots)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out[rows], want_out[rows], **SSD_OUT_TOL)
    assert_pool(got_pool, want_pool, pool, slots, lens, tol_of(torch.float32))


def _hf_dt(dt_raw, bias):
    return F.softplus(dt_raw + bias)


@pytest.mark.parametrize("length", [5, 150])
def test_ref_ssd_matches_transformers_chunk_scan(seed, length):
    """One sequence continuing from a state against transformers' mamba2_chunk_scan (Granite
    4.0-H's torch path: raw dt, dt_bias, dt_softplus=True, D=None), whose chunking differs from
    the reference's (chunk 32 against 64); 5 tokens take the reference's token steps."""
    hf = pytest.importorskip("transformers.models.granitemoehybrid.modeling_granitemoehybrid")
    x, _, A, B, C = ssd_inputs([length], 4, 2, 8, 16, torch.float32, "cpu")
    dt_raw, dt_bias = torch.randn(length, 4) - 1.0, torch.randn(4) * 0.5
    init_state = torch.randn(1, 4, 8, 16)
    pool = torch.zeros(2, 4, 8, 16)
    pool[1] = init_state[0]
    dt = _hf_dt(dt_raw, dt_bias)
    out = ref_ssd_scan(x, dt, A, B, C, pool, *layout([length], [True], [1], "cpu"))
    want_out, want_state = hf.mamba2_chunk_scan(
        x[None], dt_raw[None], A, B[None], C[None], chunk_size=32, D=None, dt_bias=dt_bias,
        initial_states=init_state, dt_softplus=True, return_final_states=True,
    )  # fmt: skip
    torch.testing.assert_close(out, want_out[0], **SSD_OUT_TOL)  # two chunkings of y = S . C
    torch.testing.assert_close(pool[1], want_state[0], atol=5e-5, rtol=5e-5)
    assert pool[0].eq(0).all()


def test_ref_ssd_matches_transformers_state_update(seed):
    """Three decode steps of three sequences against mamba2_selective_state_update, which takes
    dt, dt_bias and D per (head, head-dim row) and A per state entry (expanded as Granite's
    layer does); D = 0 (the skip is the caller's)."""
    hf = pytest.importorskip("transformers.models.granitemoehybrid.modeling_granitemoehybrid")
    heads, groups, dim, d_state = 4, 2, 8, 16
    slots = [2, 0, 3]
    hf_state = torch.randn(3, heads, dim, d_state)
    pool = torch.full((4, heads, dim, d_state), float("nan"))
    pool[slots] = hf_state
    dt_bias = torch.randn(heads) * 0.5
    A = -(torch.rand(heads) * 3 + 0.5)
    batch = layout([1, 1, 1], [True] * 3, slots, "cpu")
    for _ in range(3):
        x, _, _, B, C = ssd_inputs([1, 1, 1], heads, groups, dim, d_state, torch.float32, "cpu")
        dt_raw = torch.randn(3, heads) - 1.0
        out = ref_ssd_scan(x, _hf_dt(dt_raw, dt_bias), A, B, C, pool, *batch)
        want = hf.mamba2_selective_state_update(
            hf_state, x, dt_raw[..., None].expand(-1, -1, dim),
            A[:, None, None].expand(-1, dim, d_state), B, C, D=torch.zeros(heads, dim),
            dt_bias=dt_bias[:, None].expand(-1, dim), dt_softplus=True,
        )  # fmt: skip
        torch.testing.assert_close(out, want, atol=5e-5, rtol=5e-5)
        torch.testing.assert_close(pool[slots], hf_state, atol=5e-5, rtol=5e-5)
    assert pool[1].isnan().all()


SSD_CASES = [
    # dtype, state dtype, H, G, P, N
    (torch.float32, torch.float32, 4, 4, 8, 16),
    (torch.bfloat16, torch.float32, 4, 1, 8, 16),
    (torch.bfloat16, torch.bfloat16, 8, 2, 16, 8),
    (torch.float16, torch.float32, 4, 1, 12, 24),  # masked P and N
    (torch.bfloat16, torch.float32, 2, 1, 20, 256),  # 3 tiles of 8 head-dim rows, one masked
]


@pytest.mark.parametrize(("dtype", "state_dtype", "heads", "groups", "dim", "d_state"), SSD_CASES)
def test_ssd_scan_matches_reference(seed, device, dtype, state_dtype, heads, groups, dim, d_state):
    lens = LENS if d_state <= 64 else [3, 0, 1, 1, 5, 1]
    _check_ssd(lens, INIT, SLOTS, dtype, state_dtype, heads, groups, dim, d_state, device)


def test_ssd_scan_granite_head_size(seed, device):
    """P = 64, N = 128 (Granite 4.0-H, Nemotron-H): four head-dim tiles a head."""
    _check_ssd([2, 1], [True, False], [5, 0], torch.bfloat16, torch.float32, 2, 1, 64, 128,
               device)  # fmt: skip


def _check_ssd(
    lens, init, slots, dtype, state_dtype, heads, groups, dim, d_state, device, out_tol=None
):
    x, dt, A, B, C = ssd_inputs(lens, heads, groups, dim, d_state, dtype, device)
    num_slots = max(NUM_SLOTS, max(slots) + 1)
    pool = torch.randn(num_slots, heads, dim, d_state, device=device).to(state_dtype)
    poison_fresh(pool, slots, init)
    batch = layout(lens, init, slots, device)
    want_pool = pool.clone()
    want = ref_ssd_scan(x, dt, A, B, C, want_pool, *batch)
    got_pool = pool.clone()
    got = ssd_scan(x, dt, A, B, C, got_pool, *batch)
    assert got.dtype == torch.float32 and got.shape == want.shape
    rows = live_rows(lens, slots).to(device)
    # Both read the same rounded inputs and run in fp32: the outputs agree to fp32 rounding
    # (of the reference's chunked form for 70 tokens); a 16-bit pool rounds the new state.
    torch.testing.assert_close(got[rows], want[rows], **(out_tol or SSD_OUT_TOL))
    assert_pool(got_pool, want_pool, pool, slots, lens, tol_of(state_dtype))


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_ssd_two_steps_equal_one(seed, device, impl):
    """67 tokens as one step, and as 2 + 65 (the second continuing from the slot; the
    reference's second step is chunked)."""
    scan = ref_ssd_scan if impl == "ref" else ssd_scan
    x, dt, A, B, C = ssd_inputs([67], 2, 1, 8, 16, torch.float32, device)
    pool = torch.randn(2, 2, 8, 16, device=device)
    whole = pool.clone()
    y = scan(x, dt, A, B, C, whole, *layout([67], [False], [1], device))
    ys = []
    for lo, hi, init in ((0, 2, False), (2, 67, True)):
        batch = layout([hi - lo], [init], [1], device)
        ys.append(scan(*(t[lo:hi] for t in (x, dt)), A, B[lo:hi], C[lo:hi], pool, *batch))
    torch.testing.assert_close(torch.cat(ys), y, **SSD_OUT_TOL)
    torch.testing.assert_close(pool, whole, atol=1e-4, rtol=1e-4)


def test_ssd_scan_bad_arguments(device):
    x, dt, A, B, C = ssd_inputs([2], 3, 2, 8, 16, torch.float32, device)
    batch = layout([2], [True], [0], device)
    pool = torch.zeros(1, 3, 8, 16, device=device)
    with pytest.raises(ValueError, match="multiple"):
        ssd_scan(x, dt, A, B, C, pool, *batch)
    x, dt, A, B, C = ssd_inputs([2], 4, 2, 8, 16, torch.float32, device)
    pool = torch.zeros(1, 4, 8, 16, device=device)
    with pytest.raises(ValueError, match="dt"):
        ssd_scan(x, dt.bfloat16(), A, B, C, pool, *batch)
    with pytest.raises(ValueError, match="ssm_state"):
        ssd_scan(x, dt, A, B, C, pool[:, :, :, :8], *batch)


@pytest.mark.gpu
def test_gpu_granite_4_sizes(seed):
    """Granite 4.0-H's mixer on one GPU: 128 heads of 64, N = 128, one group; decode rows and
    prefills, bf16 activations, fp32 and bf16 state pools."""
    device = torch.device("cuda")
    lens = [1] * 32 + [300, 17, 1000]
    init = [True] * 32 + [False, True, False]
    slots = torch.randperm(64)[: len(lens)].tolist()
    # Over 1000 tokens the two chunked forms' fp32 sums part further than over 70: on an H100,
    # 36 of 11M outputs passed 1e-4 (at most 2.8e-4), so the outputs get 1e-3 here.
    tol = {"atol": 1e-3, "rtol": 1e-3}
    for state_dtype in (torch.float32, torch.bfloat16):
        _check_ssd(
            lens, init, slots, torch.bfloat16, state_dtype, 128, 1, 64, 128, device, out_tol=tol
        )
