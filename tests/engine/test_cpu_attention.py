"""The CPU attention backend against paged_kernels' torch reference on random paged batches.

Each batch scatters its sequences' blocks over a random permutation of a larger pool whose other
blocks hold random data, and mixes decode rows, fresh prompts and chunked-prefill rows (new rows
after a cached context) of random lengths. The CPU backend keeps its cache in head planes
([Hkv, num_blocks, block_size, D]); the reference reads the same values in its own layout.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from paged_engine.attention import AttentionMetadata, get_attention_backend
from paged_engine.attention.cpu_backend import CpuBackend, DecodeRows
from paged_engine.attention.cpu_plan import FULL, LocalRange, length_bands
from paged_kernels import alibi_slopes, ref_paged_attention, ref_write_kv_cache

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def to_planes(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, Hkv, D] -> the CPU backend's [Hkv, num_blocks, block_size, D]."""
    return cache.permute(2, 0, 1, 3).contiguous()


def make_batch(q_lens, ctx_lens, *, num_heads, num_kv_heads, head_dim, block_size, dtype):
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens, strict=True)]
    needed = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(needed) + 8
    perm = torch.randperm(num_blocks - 1) + 1  # block 0 is the null block
    tables = torch.randint(0, num_blocks, (len(q_lens), max(needed) + 2), dtype=torch.int32)
    start = 0
    for i, n in enumerate(needed):
        tables[i, :n] = perm[start : start + n]
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    md = AttentionMetadata(
        slot_mapping=torch.zeros(cu[-1], dtype=torch.int64),
        block_tables=tables,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(seq_lens),
        backend=None,
    )
    q = torch.randn(cu[-1], num_heads, head_dim).to(dtype)
    return q, torch.randn(shape).to(dtype), torch.randn(shape).to(dtype), md


def random_mix(rng: random.Random, num_seqs: int, max_len: int) -> tuple[list[int], list[int]]:
    """(q_lens, ctx_lens): a random mix of decode rows, prompts and chunks after a context."""
    q_lens, ctx = [], []
    for _ in range(num_seqs):
        kind = rng.choice(("decode", "prompt", "chunk"))
        if kind == "decode":
            q_lens.append(1)
            ctx.append(rng.randint(0, max_len))
        elif kind == "prompt":
            q_lens.append(rng.randint(1, max_len))
            ctx.append(0)
        else:
            q_lens.append(rng.randint(2, max_len // 2))
            ctx.append(rng.randint(1, max_len))
    return q_lens, ctx


def attend_both(q, kc, vc, md, **kw):
    scale = q.shape[-1] ** -0.5
    want = ref_paged_attention(
        q, kc, vc, md.block_tables, md.cu_seqlens_q, md.seq_lens, scale, **kw
    ).float()
    backend = get_attention_backend("auto", torch.device("cpu"))
    assert isinstance(backend, CpuBackend)
    md.backend = backend
    args = {"sliding_window": None, "soft_cap": None, "alibi_slopes": None, **kw}
    got = backend.attend(q, to_planes(kc), to_planes(vc), md, scale=scale, **args)
    assert got.dtype == q.dtype and got.shape == q.shape
    return got.float(), want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_random_mixed_batches(dtype, num_heads, num_kv_heads, block_size):
    rng = random.Random(hash((str(dtype), num_heads, num_kv_heads, block_size)))
    torch.manual_seed(rng.randrange(2**31))
    for num_seqs in (1, 3, 9):
        q_lens, ctx = random_mix(rng, num_seqs, 40)
        q, kc, vc, md = make_batch(
            q_lens,
            ctx,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=32,
            block_size=block_size,
            dtype=dtype,
        )
        got, want = attend_both(q, kc, vc, md)
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize(
    ("q_lens", "ctx"),
    [
        ([1] * 7, [0, 3, 16, 17, 40, 1, 100]),  # decode only: lengths over several bands
        ([5], [0]),  # one prompt (rows already in order: no scatter)
        ([9, 1, 1, 30], [0, 5, 70, 33]),  # prompts, decodes and a long chunk
        ([3, 1, 2], [60, 0, 0]),  # the shortest decode (context 1)
        ([1], [30]),  # one decode sequence: every key visible, SDPA runs without a mask
        ([1, 1, 1], [12, 12, 12]),  # decodes of one length: no mask either
    ],
)
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"sliding_window": 5},
        {"attention_chunk_size": 6},  # Llama 4's chunked local attention
        {"soft_cap": 3.0},
        {"alibi": True},
        {"soft_cap": 2.0, "sliding_window": 9, "alibi": True},
    ],
)
def test_edge_batches_and_options(q_lens, ctx, extra):
    torch.manual_seed(0)
    q, kc, vc, md = make_batch(
        q_lens, ctx, num_heads=6, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32
    )
    kw = {k: v for k, v in extra.items() if k != "alibi"}
    if extra.get("alibi"):
        kw["alibi_slopes"] = alibi_slopes(6)
    got, want = attend_both(q, kc, vc, md, **kw)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_write_kv_skips_padding_and_copy_blocks():
    torch.manual_seed(1)
    num_blocks, bs, hkv, d = 6, 4, 2, 8
    ref_k, ref_v = (torch.randn(num_blocks, bs, hkv, d) for _ in "kv")
    cpu_k, cpu_v = to_planes(ref_k), to_planes(ref_v)
    key, value = torch.randn(5, hkv, d), torch.randn(5, hkv, d)
    slots = torch.tensor([5, -1, 9, 23, -1])
    ref_write_kv_cache(key, value, ref_k, ref_v, slots)
    backend = CpuBackend()
    backend.write_kv(key, value, cpu_k, cpu_v, slots)
    assert torch.equal(cpu_k, to_planes(ref_k)) and torch.equal(cpu_v, to_planes(ref_v))
    backend.copy_blocks([cpu_k], [cpu_v], torch.tensor([[1, 4], [2, 0]]))
    assert torch.equal(cpu_k[:, 4], cpu_k[:, 1]) and torch.equal(cpu_v[:, 0], cpu_v[:, 2])
    assert CpuBackend.kv_cache_shape(num_blocks, bs, hkv, d) == cpu_k.shape


def test_length_bands_bound_padding():
    lengths = torch.randint(1, 5000, (500,)).numpy()
    bands = length_bands(lengths)
    assert bands.min() == 0 and bands.max() <= 7
    for b in set(bands.tolist()) - {7}:  # the last band collects everything shorter
        members = lengths[bands == b]
        assert members.max() / members.min() <= 2**0.5 + 1e-9


def test_cpu_backend_rejects_other_devices():
    with pytest.raises(ValueError, match="attention_backend='cpu'"):
        get_attention_backend("cpu", torch.device("cuda"))


def test_triton_backend_off_cuda_needs_the_interpreter(monkeypatch):
    """Without it Triton fails deep inside with "0 active drivers"; this says what to do."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_attention_backend("triton", torch.device("cpu"))


def test_mask_dropped_only_when_every_key_is_visible():
    """A decode group whose rows all see all keys runs SDPA without a mask; padding keys, a
    window or chunk shorter than the context, or batch invariance keep it."""

    def group(q_lens, ctx, batch_invariant=False):
        *_, md = make_batch(
            q_lens, ctx, num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32
        )
        backend = CpuBackend(batch_invariant=batch_invariant)
        md.backend = backend
        (g,) = backend._plan(md).groups(4)
        return g

    assert group([1], [30]).sdpa_mask(FULL, 2) is None
    assert group([1, 1], [9, 9]).sdpa_mask(FULL, 2) is None
    assert group([1, 1], [9, 9]).sdpa_mask(LocalRange(window=20), 2) is None  # past the context
    assert group([1, 1], [9, 9]).sdpa_mask(LocalRange(window=4), 2) is not None
    assert group([1, 1], [9, 9]).sdpa_mask(LocalRange(chunk=16), 2) is None  # one chunk
    assert group([1, 1], [9, 9]).sdpa_mask(LocalRange(chunk=8), 2) is not None
    assert group([1, 1], [9, 7]).sdpa_mask(FULL, 2) is not None  # the shorter row has padding
    assert group([1], [30], batch_invariant=True).sdpa_mask(FULL, 2) is not None  # keys to 512


def test_head_kv_index_gathers_the_same_rows_as_the_planes():
    """The flat row gather (dim 0 of [Hkv * slots, D]) yields the per-plane gather's bytes."""
    shape = {"num_heads": 6, "num_kv_heads": 3, "head_dim": 8, "block_size": 4}
    *_, md = make_batch([1, 3, 1], [20, 0, 7], **shape, dtype=torch.float32)
    backend = CpuBackend()
    md.backend = backend
    cache = torch.randn(3, 40, 4, 8)  # [Hkv, num_blocks, block_size, D]
    planes, rows = cache.view(3, -1, 8), cache.view(-1, 8)
    for g in backend._plan(md).groups(4):
        index = g.head_kv_index(3, planes.shape[1])
        assert g.head_kv_index(3, planes.shape[1]) is index  # built once per step
        want = planes.index_select(1, g.kv_index)
        assert torch.equal(rows.index_select(0, index).view_as(want), want)


@pytest.mark.parametrize("ctx", [[30], [12, 12, 12], [20, 23, 27]])  # [20, 23, 27]: masked
def test_decode_fast_path_matches_the_general_path_bitwise(ctx):
    """A decode-only step in one group takes `CpuBackend._decode`; a window longer than any
    context (every key still visible) sends the same step through the general path."""
    torch.manual_seed(len(ctx))
    q, kc, vc, md = make_batch(
        [1] * len(ctx),
        ctx,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        block_size=4,
        dtype=torch.float32,
    )
    backend = CpuBackend()
    md.backend = backend
    kc, vc = to_planes(kc), to_planes(vc)
    calls = []
    fast = backend._decode
    backend._decode = lambda *a: calls.append(1) or fast(*a)
    kw = {"scale": 32**-0.5, "soft_cap": None, "alibi_slopes": None}
    got = backend.attend(q, kc, vc, md, sliding_window=None, **kw)
    general = backend.attend(q, kc, vc, md, sliding_window=10**6, **kw)
    assert calls == [1]
    assert torch.equal(got, general)


def _decode_step(ctxs: list[int], *, num_heads, num_kv_heads, head_dim, block_size, dtype):
    """A decode step: row i adds one token after ctxs[i] cached ones. (query, key, value,
    reference caches, metadata with the rows' slots set.)"""
    q, kc, vc, md = make_batch(
        [1] * len(ctxs),
        ctxs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    md.slot_mapping = torch.stack(
        [
            md.block_tables[i, c // block_size] * block_size + c % block_size
            for i, c in enumerate(ctxs)
        ]
    ).long()
    key, value = (torch.randn(len(ctxs), num_kv_heads, head_dim).to(dtype) for _ in "kv")
    return q, key, value, kc, vc, md


def _attend_decode(q, key, value, kc, vc, md, **options):
    """attend_decode on the CPU backend's planes; returns (output [S, H, D], the planes)."""
    k_planes, v_planes = to_planes(kc), to_planes(vc)
    rows = DecodeRows.from_metadata(md, kc.shape[1])
    assert rows is not None
    num_rows = q.shape[0]
    out = CpuBackend.attend_decode(
        q.reshape(num_rows, -1),
        key.reshape(num_rows, -1),
        value.reshape(num_rows, -1),
        k_planes,
        v_planes,
        rows,
        scale=q.shape[-1] ** -0.5,
        **{"sliding_window": None, "soft_cap": None, **options},
    )
    return out.view(q.shape), k_planes, v_planes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"sliding_window": 5},
        {"soft_cap": 3.0, "sliding_window": 20},
        {"attention_chunk_size": 6},
    ],
)
def test_attend_decode_matches_the_reference(dtype, num_heads, num_kv_heads, block_size, options):
    """The traced decode step (compiled forward) writes the reference's cache bytes and attends
    as the reference does: one sequence with a context from none to several blocks (one block
    exactly full, one token past it), and rows of different lengths in one step."""
    torch.manual_seed(block_size * 100 + num_heads)
    bs = block_size
    for ctxs in ([0], [1], [bs - 1], [bs], [2 * bs + 1], [37], [0, 37, bs, 5], [bs, bs - 1]):
        q, key, value, kc, vc, md = _decode_step(
            ctxs,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=16,
            block_size=block_size,
            dtype=dtype,
        )
        got, k_planes, v_planes = _attend_decode(q, key, value, kc, vc, md, **options)
        ref_write_kv_cache(key, value, kc, vc, md.slot_mapping)
        assert torch.equal(k_planes, to_planes(kc)) and torch.equal(v_planes, to_planes(vc))
        want = ref_paged_attention(
            q,
            kc,
            vc,
            md.block_tables,
            md.cu_seqlens_q,
            md.seq_lens,
            q.shape[-1] ** -0.5,
            **options,
        )
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("num_rows", [1, 3])
def test_attend_decode_traces_with_symbolic_sizes(num_rows):
    """Under torch.compile one graph serves every context length (block count symbolic from 2
    up; DecodeRows pads shorter tables) and, past one row, every row count; its outputs and
    cache writes equal the eager call's."""
    torch.manual_seed(3)
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    compiled = torch.compile(CpuBackend.attend_decode, backend=backend, fullgraph=True)
    block_size, most = 4, 5  # rows in the largest step
    q, key, value, kc, vc, md = _decode_step(
        [30] * most,
        num_heads=6,
        num_kv_heads=2,
        head_dim=8,
        block_size=block_size,
        dtype=torch.float32,
    )
    opts = {"scale": 0.3, "sliding_window": 7, "soft_cap": 4.0}
    steps = [[2], [9], [30]] if num_rows == 1 else [[2, 5, 1], [9, 30], [30, 1, 17, 4, 8]]
    for i, ctxs in enumerate(steps):  # tables of 2, 3 and 8 blocks over one cache
        n = len(ctxs)
        step = AttentionMetadata(
            slot_mapping=torch.stack(
                [
                    md.block_tables[r, c // block_size] * block_size + c % block_size
                    for r, c in enumerate(ctxs)
                ]
            ).long(),
            block_tables=md.block_tables[:n],
            cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
            seq_lens=torch.tensor([c + 1 for c in ctxs], dtype=torch.int32),
            max_seqlen_q=1,
            max_seqlen_k=max(ctxs) + 1,
            backend=None,
        )
        rows = DecodeRows.from_metadata(step, block_size)
        if i == 0:
            torch._dynamo.mark_dynamic(rows.block_tables, 1)
            if n > 1:
                for t in (rows.block_tables, rows.seq_lens, rows.slots):
                    torch._dynamo.mark_dynamic(t, 0)
        args = (q[:n].reshape(n, -1), key[:n].reshape(n, -1), value[:n].reshape(n, -1))
        k_eager, v_eager = to_planes(kc), to_planes(vc)
        k_traced, v_traced = to_planes(kc), to_planes(vc)
        want = CpuBackend.attend_decode(*args, k_eager, v_eager, rows, **opts)
        got = compiled(*args, k_traced, v_traced, rows, **opts)
        torch.testing.assert_close(got, want)
        assert torch.equal(k_traced, k_eager) and torch.equal(v_traced, v_eager)
    assert len(calls) == 1


def test_decode_rows_only_for_steps_of_one_written_token_per_row():
    md = _decode_step(
        [3, 5], num_heads=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32
    )[-1]
    assert DecodeRows.from_metadata(md, 4) is not None
    md.slot_mapping = torch.tensor([7, -1])  # a token that writes nothing
    assert DecodeRows.from_metadata(md, 4) is None
    prefill = make_batch(
        [1, 2],
        [3, 0],
        num_heads=2,
        num_kv_heads=2,
        head_dim=4,
        block_size=4,
        dtype=torch.float32,
    )[-1]
    assert DecodeRows.from_metadata(prefill, 4) is None
