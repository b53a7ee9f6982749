"""Attention sinks (gpt-oss) through the engine's attention paths against paged_kernels' torch
reference: CpuBackend.attend (SDPA with its log-sum-exp, the decode fast path, the explicit
scores of soft cap / ALiBi, fp8 caches, batch invariance), attend_decode eager and traced, and
the Attention layer, which reads the model's parameter at each call, eager, compiled and
through the kernel backends (torch reference, Triton's interpreter).

Values get a mean of 1: an output is then about the share of its row's mass the keys keep, so
a wrong sink denominator shows at O(1). Each comparison also checks that the sinks matter.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_cpu_attention import (  # tests/engine is on sys.path
    TOL,
    _attend_decode,
    _decode_step,
    make_batch,
    random_mix,
    to_planes,
)
from torch import nn

from paged_engine.attention import AttentionMetadata, get_attention_backend
from paged_engine.attention.cpu_backend import CpuBackend, DecodeRows
from paged_engine.layers import compiled_ops
from paged_engine.layers.attention import Attention
from paged_kernels import alibi_slopes, ref_paged_attention, ref_quantize, ref_write_kv_cache


def random_sinks(num_heads: int, keys: int = 20) -> torch.Tensor:
    """Around log(keys): a large share of a row's mass, spread over heads."""
    return torch.randn(num_heads) * 1.5 + math.log(keys)


def reference(q, kc, vc, md, sinks, **kw) -> torch.Tensor:
    args = (q, kc, vc, md.block_tables, md.cu_seqlens_q, md.seq_lens, q.shape[-1] ** -0.5)
    return ref_paged_attention(*args, sinks=sinks, **kw).float()


def assert_matches(got, q, kc, vc, md, sinks, tol, **kw) -> None:
    """`got` == the reference with sinks, which the reference without them is not."""
    want = reference(q, kc, vc, md, sinks, **kw)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    plain = reference(q, kc, vc, md, None, **kw)
    assert not torch.allclose(plain, want, atol=tol, rtol=tol), "the sinks change nothing here"


def cpu_attend(backend, q, kc, vc, md, sinks, **kw) -> torch.Tensor:
    md.backend = backend
    args = {"sliding_window": None, "soft_cap": None, "alibi_slopes": None, **kw}
    scale = q.shape[-1] ** -0.5
    return backend.attend(q, to_planes(kc), to_planes(vc), md, scale=scale, sinks=sinks, **args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (8, 1)])
def test_attend_random_mixed_batches(dtype, num_heads, num_kv_heads):
    rng = random.Random(hash((str(dtype), num_heads, num_kv_heads)))
    torch.manual_seed(rng.randrange(2**31))
    for num_seqs in (1, 3, 9):
        q_lens, ctx = random_mix(rng, num_seqs, 40)
        q, kc, vc, md = make_batch(
            q_lens, ctx, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32,
            block_size=4, dtype=dtype,
        )  # fmt: skip
        vc = vc + 1
        sinks = random_sinks(num_heads)
        got = cpu_attend(CpuBackend(), q, kc, vc, md, sinks)
        assert got.dtype == dtype and got.shape == q.shape
        assert_matches(got, q, kc, vc, md, sinks, TOL[dtype])


BATCHES = [
    ([1] * 7, [0, 3, 16, 17, 40, 1, 100]),  # decode rows over several length bands
    ([1, 1, 1], [20, 23, 27]),  # decode rows in one group: the fast path
    ([1], [30]),  # one decode sequence: SDPA without a mask
    ([5], [0]),  # one prompt, rows in order
    ([9, 1, 1, 30], [0, 5, 70, 33]),  # prompts, decodes and a long chunk (padded rows)
]
OPTIONS = {
    "plain": {},
    "window": {"sliding_window": 5},
    "soft_cap": {"soft_cap": 3.0},
    "alibi": {"alibi_slopes": alibi_slopes(6)},
    "all": {"soft_cap": 2.0, "sliding_window": 9, "alibi_slopes": alibi_slopes(6)},
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_attend_edge_batches_and_options(option):
    torch.manual_seed(0)
    for q_lens, ctx in BATCHES:
        q, kc, vc, md = make_batch(
            q_lens, ctx, num_heads=6, num_kv_heads=2, head_dim=16, block_size=4,
            dtype=torch.float32,
        )  # fmt: skip
        vc = vc + 1
        sinks = random_sinks(6)
        got = cpu_attend(CpuBackend(), q, kc, vc, md, sinks, **OPTIONS[option])
        assert_matches(got, q, kc, vc, md, sinks, 1e-5, **OPTIONS[option])


def test_decode_fast_path_takes_sinks():
    """A decode-only step in one group runs `_decode`, with the sinks, as the general path."""
    torch.manual_seed(1)
    q, kc, vc, md = make_batch(
        [1, 1, 1], [20, 23, 27], num_heads=8, num_kv_heads=2, head_dim=32, block_size=4,
        dtype=torch.float32,
    )  # fmt: skip
    vc = vc + 1
    sinks = random_sinks(8)
    backend = CpuBackend()
    calls = []
    fast = backend._decode
    backend._decode = lambda *a: calls.append(1) or fast(*a)
    got = cpu_attend(backend, q, kc, vc, md, sinks)
    general = cpu_attend(backend, q, kc, vc, md, sinks, sliding_window=10**6)
    assert calls == [1]
    assert torch.equal(got, general)
    assert_matches(got, q, kc, vc, md, sinks, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_fp8_cache(dtype):
    """v_scale scales the values only; the sink's share of the denominator stays."""
    torch.manual_seed(2)
    q, kc, vc, md = make_batch(
        [1, 7, 1, 12], [30, 0, 9, 20], num_heads=8, num_kv_heads=2, head_dim=32, block_size=4,
        dtype=dtype,
    )  # fmt: skip
    kc = ref_quantize(kc, torch.float8_e4m3fn, 0.25)
    vc = ref_quantize(vc + 1, torch.float8_e4m3fn, 0.5)
    sinks = random_sinks(8)
    scales = {"k_scale": 0.25, "v_scale": 0.5}
    got = cpu_attend(CpuBackend(), q, kc, vc, md, sinks, **scales)
    assert_matches(got, q, kc, vc, md, sinks, TOL[dtype], **scales)


def test_attend_batch_invariant():
    """batch_invariant=True with sinks: the reference's values, and a sequence's rows have the
    same bits alone and beside other sequences."""
    torch.manual_seed(3)
    sinks = random_sinks(4)
    shape = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "block_size": 4}
    q, kc, vc, md = make_batch([1, 13, 1], [30, 0, 70], **shape, dtype=torch.float32)
    vc = vc + 1
    backend = CpuBackend(batch_invariant=True)
    mixed = cpu_attend(backend, q, kc, vc, md, sinks, sliding_window=20)
    assert_matches(mixed, q, kc, vc, md, sinks, 1e-5, sliding_window=20)
    for seq, (lo, hi) in enumerate([(0, 1), (1, 14), (14, 15)]):
        alone = AttentionMetadata(
            slot_mapping=torch.zeros(hi - lo, dtype=torch.int64),
            block_tables=md.block_tables[seq : seq + 1],
            cu_seqlens_q=torch.tensor([0, hi - lo], dtype=torch.int32),
            seq_lens=md.seq_lens[seq : seq + 1],
            max_seqlen_q=hi - lo,
            max_seqlen_k=int(md.seq_lens[seq]),
            backend=None,
        )
        got = cpu_attend(backend, q[lo:hi], kc, vc, alone, sinks, sliding_window=20)
        assert torch.equal(got, mixed[lo:hi])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 5, "soft_cap": 3.0}])
def test_attend_decode_matches_the_reference(dtype, num_heads, num_kv_heads, options):
    torch.manual_seed(num_heads * 10 + num_kv_heads)
    for ctxs in ([0], [4], [37], [0, 37, 4, 5]):
        q, key, value, kc, vc, md = _decode_step(
            ctxs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16, block_size=4,
            dtype=dtype,
        )  # fmt: skip
        vc, value = vc + 1, value + 1
        sinks = random_sinks(num_heads, keys=10)
        got, *_ = _attend_decode(q, key, value, kc, vc, md, sinks=sinks, **options)
        ref_write_kv_cache(key, value, kc, vc, md.slot_mapping)
        assert_matches(got, q, kc, vc, md, sinks, TOL[dtype], **options)


# ---- The Attention layer ---------------------------------------------------------------------


def _prefill_then_decode():
    """Two steps over one cache (block size 4, 4 heads on 2 KV heads of 8): a chunk of 6 rows
    after 5 cached tokens beside a decode row after 9, then both decoding. Returns
    ([(q [T, 32], k [T, 16], v [T, 16], metadata with the rows' slots)], key_cache, value_cache)
    in the reference layout."""
    _, kc, vc, md = make_batch(
        [6, 1], [5, 9], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4,
        dtype=torch.float32,
    )  # fmt: skip
    steps = []
    for q_lens, ctx in (([6, 1], [5, 9]), ([1, 1], [11, 10])):
        pos = [(i, p) for i, (n, c) in enumerate(zip(q_lens, ctx)) for p in range(c, c + n)]
        slots = [int(md.block_tables[i, p // 4]) * 4 + p % 4 for i, p in pos]
        cu = [0, q_lens[0], sum(q_lens)]
        step = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=md.block_tables,
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor([c + n for c, n in zip(ctx, q_lens)], dtype=torch.int32),
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(c + n for c, n in zip(ctx, q_lens)),
            backend=None,
        )
        t = len(slots)
        steps.append((torch.randn(t, 32), torch.randn(t, 16), torch.randn(t, 16) + 1, step))
    return steps, kc, vc + 1


def _layer_reference(steps, kc, vc, sinks_per_step) -> list[torch.Tensor]:
    kc, vc = kc.clone(), vc.clone()
    outs = []
    for (q, k, v, md), sinks in zip(steps, sinks_per_step):
        t = q.shape[0]
        ref_write_kv_cache(k.view(t, 2, 8), v.view(t, 2, 8), kc, vc, md.slot_mapping)
        outs.append(reference(q.view(t, 4, 8), kc, vc, md, sinks).reshape(t, -1))
    return outs


@pytest.mark.parametrize("backend_name", ["cpu", "torch", "triton"])
def test_layer_reads_the_models_parameter_at_call_time(backend_name):
    """The layer holds the model's own parameter, unregistered, and reads it at each call:
    an in-place update after construction (as the loader's copy_) changes the next step."""
    torch.manual_seed(4)
    steps, kc, vc = _prefill_then_decode()
    sinks = nn.Parameter(torch.zeros(4), requires_grad=False)
    layer = Attention(4, 8, 2, 8**-0.5, sinks=sinks)
    assert list(layer.parameters()) == [] and list(layer.state_dict()) == []
    backend = get_attention_backend(backend_name, torch.device("cpu"))
    layout = to_planes if backend_name == "cpu" else lambda c: c.clone()
    cache = (layout(kc), layout(vc))
    values = [random_sinks(4), random_sinks(4, keys=3)]
    got = []
    for (q, k, v, md), value in zip(steps, values):
        with torch.no_grad():
            sinks.copy_(value)
        md.backend = backend
        got.append(layer(q, k, v, cache, md))
    for g, want in zip(got, _layer_reference(steps, kc, vc, values)):
        torch.testing.assert_close(g, want, atol=2e-3, rtol=2e-3)
    with pytest.raises(ValueError, match="sinks must be"):
        Attention(4, 8, 2, 1.0, sinks=torch.zeros(2))


def test_compiled_layer_reads_the_parameter_at_call_time():
    """Under torch.compile (worker/cpu_compile.py's setup): a decode step traced through
    attend_decode and a prefill step through the paged_engine::attention operator both use
    the parameter's current values, with no recompile after an in-place update."""
    torch.manual_seed(5)
    steps, kc, vc = _prefill_then_decode()
    sinks = nn.Parameter(torch.zeros(4), requires_grad=False)
    layer = Attention(4, 8, 2, 8**-0.5, sinks=sinks)
    layer.op_handle = compiled_ops.register(layer)
    layer.kv_index = 0
    layer.trace_decode = True
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(layer, backend=count, fullgraph=True)
    backend = CpuBackend()
    cache = (to_planes(kc), to_planes(vc))
    values = [random_sinks(4), random_sinks(4, keys=3), random_sinks(4, keys=30)]
    runs = [steps[0], steps[1], steps[1]]  # the decode step twice: the same writes
    got = []
    for (q, k, v, md), value in zip(runs, values):
        with torch.no_grad():
            sinks.copy_(value)
        md.backend = backend
        md.decode = DecodeRows.from_metadata(md, 4)
        with compiled_ops.forward_context([cache], md):
            got.append(compiled(q, k, v, cache, md))
    assert md.decode is not None and steps[0][3].decode is None  # both paths ran
    for g, want in zip(got, _layer_reference(runs, kc, vc, values)):
        torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[1], got[2])
    assert len(graphs) == 2  # prefill (operator) and decode (traced); the update recompiled none
