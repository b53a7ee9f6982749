"""CUDA-only engine logic run on CPU: `CudaGraphRunner` and the worker's memory profiler.

A fake graph stands in for `torch.cuda.CUDAGraph`: capture records every model call made under
`torch.cuda.graph` (arguments and the returned tensor), replay re-runs those calls eagerly and
copies the results into the captured output tensors in place. Like a real graph, a replay reads
whatever the static input buffers hold at that moment and writes to fixed output storage, so the
runner's buffer handling (padding rows, block table widths, bucket choice) is exercised for real.
While capturing, host reads of tensors (`.item()`, `.tolist()`, `int()`, ...) are recorded: each
would fail a real capture. The memory profiler runs its real forward on CPU while `torch.cuda`'s
memory queries are faked. On a CUDA machine the Triton graph test uses real CUDA graphs instead.
"""

from __future__ import annotations

import contextlib
import gc
import random
import weakref
from typing import ClassVar

import pytest
import torch
from host_reads import spy_host_reads

import paged_engine.spec_decode.planner as planner_mod
import paged_engine.worker.memory_profiler as mp
import paged_engine.worker.worker as worker_mod
from paged_engine import EngineConfig, LLMEngine, SamplingParams
from paged_engine.attention import AttentionMetadata, get_attention_backend
from paged_engine.worker.cache_engine import CacheEngine
from paged_engine.worker.cuda_graphs import CudaGraphRunner, bucket_sizes

MAX_SEQS = 20  # buckets 1, 2, 4, 8, 16, 20
BLOCK = 4
MAX_LEN = 64  # 16 blocks per sequence
SPEC_K = 2  # speculative tests: verification steps run q = 3 query tokens per row


# Tests that drive CUDA's code paths on CPU tensors run Triton kernels in its interpreter, which
# the suite turns on only where there is no CUDA device; there the real paths run natively.
on_cpu_tensors = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CUDA's path on CPU tensors needs Triton's interpreter"
)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny-model ops gain nothing from intra-op threads, and on a shared 2-core machine their
    spin-waiting made these tests up to 30x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- fake CUDA graphs ---------------------------------------------------------------------------
class _Capture:
    current: ClassVar[_FakeGraph | None] = None
    pools: ClassVar[list[object]] = []  # the pool argument of each capture
    sizes: ClassVar[list[int]] = []  # the batch size of each captured model call
    syncs: ClassVar[list[str]] = []  # host syncs seen while capturing


class _FakeGraph:
    def __init__(self) -> None:
        self.calls: list[tuple[torch.nn.Module, tuple, torch.Tensor]] = []
        self.replays = 0
        self._pool = object()

    def replay(self) -> None:
        for model, args, out in self.calls:
            ids, positions, _, meta = args
            inputs = (ids, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens)
            before = [t.clone() for t in inputs]
            out.copy_(model(*args))
            # A graph must leave its static inputs as the runner wrote them.
            assert all(t.equal(b) for t, b in zip(inputs, before)), "the model mutated its inputs"
        self.replays += 1

    def pool(self) -> object:
        return self._pool


@contextlib.contextmanager
def _fake_graph_ctx(graph: _FakeGraph, pool=None, **_):
    """torch.cuda.graph stand-in: records the model calls and every host sync under it."""
    assert _Capture.current is None, "nested capture"
    _Capture.current = graph
    _Capture.pools.append(pool)
    try:
        with spy_host_reads(_Capture.syncs.append):
            yield
    finally:
        _Capture.current = None


class _Recorder:
    """Wraps the model: calls under a fake capture are recorded into that graph."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model

    def __call__(self, *args):
        out = self._model(*args)
        if _Capture.current is not None:
            _Capture.current.calls.append((self._model, args, out))
            _Capture.sizes.append(args[0].shape[0])
        return out

    def __getattr__(self, name: str):
        return getattr(self._model, name)


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    _Capture.current, _Capture.pools, _Capture.sizes, _Capture.syncs = None, [], [], []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", _fake_graph_ctx)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)


def _engine(model_dir, **overrides) -> LLMEngine:
    options = dict(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        max_model_len=MAX_LEN,
        block_size=BLOCK,
        max_num_seqs=MAX_SEQS,
        num_gpu_blocks_override=MAX_SEQS * MAX_LEN // BLOCK + 8,
        enable_prefix_caching=False,
        # The torch reference: what these tests drive through fake graphs (the CPU default,
        # the "cpu" backend, plans from host lengths and is never captured).
        attention_backend="torch",
    )
    options.update(overrides)
    return LLMEngine(EngineConfig(**options))


def _attach_graphs(engine: LLMEngine, verify_len: int | None = None) -> CudaGraphRunner:
    runner = engine.model_runner
    runner.model = _Recorder(runner.model)
    graphs = CudaGraphRunner(runner, engine.config.max_num_seqs, verify_len=verify_len)
    graphs.capture()
    runner.graphs = graphs
    return graphs


# ---- tests --------------------------------------------------------------------------------------
def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(3) == [1, 2, 3]
    assert bucket_sizes(16) == [1, 2, 4, 8, 16]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert bucket_sizes(300) == [1, 2, 4, 8, *range(16, 257, 16), 300]
    for n in range(1, 400):
        sizes = bucket_sizes(n)
        assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == n


def test_capture_reads_static_buffers_largest_first(tiny_llama_dir, fake_cuda_graphs):
    engine = _engine(tiny_llama_dir)
    graphs = _attach_graphs(engine)
    assert graphs.sizes == {1: bucket_sizes(MAX_SEQS)}
    assert _Capture.sizes == sorted(graphs.sizes[1], reverse=True)
    first_pool = graphs.graphs[1, MAX_SEQS].pool()
    assert _Capture.pools == [None] + [first_pool] * (len(graphs.sizes[1]) - 1)
    assert graphs.block_tables.shape == (MAX_SEQS, MAX_LEN // BLOCK)
    for (_, bs), graph in graphs.graphs.items():
        ((_, (ids, pos, kv, meta), out),) = graph.calls
        assert ids.data_ptr() == graphs.input_ids.data_ptr() and ids.shape == (bs,)
        assert pos.data_ptr() == graphs.positions.data_ptr()
        assert meta.slot_mapping.data_ptr() == graphs.slot_mapping.data_ptr()
        assert meta.block_tables.data_ptr() == graphs.block_tables.data_ptr()
        assert meta.seq_lens.data_ptr() == graphs.seq_lens.data_ptr()
        assert meta.cu_seqlens_q.tolist() == list(range(bs + 1))
        assert (meta.max_seqlen_q, meta.max_seqlen_k) == (1, MAX_LEN)  # static bounds
        assert kv is engine.model_runner.cache.kv_caches
        assert out is graphs.outputs[1, bs] and out.shape[0] == bs
    # The torch reference reads lengths on the host: why only the Triton backend is captured.
    assert "tolist" in _Capture.syncs
    # Capture ran with every slot -1: the warm-up and capture wrote nothing.
    assert all(not k.any() and not v.any() for k, v in engine.model_runner.cache.kv_caches)


def _check_against_eager(
    engine: LLMEngine, graphs: CudaGraphRunner, tol: float = 1e-5, query_lens=(1,)
) -> dict:
    """Make every forward run eagerly, then again (from the same KV cache) through the graphs,
    and check both give the same hidden states and cache writes. A step replays a graph exactly
    when every row has the same query length q and q is one of `query_lens`. Returns what it
    saw: the (q, batch size) and table widths of graphed steps, the count of eager ones."""
    runner = engine.model_runner
    forward = runner.forward
    seen: dict = {"sizes": set(), "verify_sizes": set(), "widths": set(), "eager_steps": 0}

    def checked_forward(inputs):
        caches = runner.cache.kv_caches
        before = [(k.clone(), v.clone()) for k, v in caches]
        saved, runner.graphs = runner.graphs, None
        eager = forward(inputs).clone()
        eager_caches = [(k.clone(), v.clone()) for k, v in caches]
        runner.graphs = saved
        for (k, v), (k0, v0) in zip(caches, before):
            k.copy_(k0)
            v.copy_(v0)
        replays = sum(g.replays for g in graphs.graphs.values())
        result = forward(inputs)
        replayed = sum(g.replays for g in graphs.graphs.values()) - replays
        meta = inputs.attn_metadata
        row_lens = set((inputs.cu[1:] - inputs.cu[:-1]).tolist())  # query tokens per row
        graphed = len(row_lens) == 1 and row_lens <= set(query_lens)
        assert replayed == (1 if graphed else 0)
        if graphed:
            (q,) = row_lens
            seen["sizes" if q == 1 else "verify_sizes"].add(meta.seq_lens.shape[0])
            seen["widths"].add(meta.block_tables.shape[1])
        else:
            seen["eager_steps"] += 1
        torch.testing.assert_close(result, eager, rtol=tol, atol=tol)
        for (k, v), (ke, ve) in zip(caches, eager_caches):  # padding rows wrote nothing
            torch.testing.assert_close(k, ke, rtol=tol, atol=tol)
            torch.testing.assert_close(v, ve, rtol=tol, atol=tol)
            assert not k[0].any() and not v[0].any(), "the null block was written"
        return result

    runner.forward = checked_forward
    return seen


def test_graph_decode_matches_eager(tiny_llama_dir, fake_cuda_graphs):
    """Random workloads: every decode-only step (batch sizes 1..MAX_SEQS, bucket or not, block
    tables of changing widths) replays a graph and gives the eager logits and KV writes."""
    engine = _engine(tiny_llama_dir)
    seen = _check_against_eager(engine, _attach_graphs(engine))
    rng = random.Random(0)
    params = dict(temperature=0.0, ignore_eos=True)
    # Round 1: MAX_SEQS requests admitted together, all finishing at different steps, so the
    # decode batch shrinks through every size MAX_SEQS..1.
    for i, max_tokens in enumerate(rng.sample(range(2, 2 + MAX_SEQS), MAX_SEQS)):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randint(1, 40))]
        engine.add_request(f"a{i}", prompt, SamplingParams(max_tokens=max_tokens, **params))
    while engine.has_unfinished_requests():
        engine.step()
    assert seen["sizes"] == set(range(1, MAX_SEQS + 1))
    # Round 2: arrivals mid-stream mix prefills (eager) into the decodes; rows left stale by
    # larger batches must not leak into smaller ones.
    for i in range(18):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randint(1, 48))]
        max_tokens = rng.randint(1, MAX_LEN - len(prompt))
        engine.add_request(f"b{i}", prompt, SamplingParams(max_tokens=max_tokens, **params))
        if i % 3 == 2:
            for _ in range(rng.randint(1, 6)):
                engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    # Round 3: short prompts growing to max_model_len: batch tables of every width 1..16.
    for i in range(3):
        prompt = [rng.randrange(3, 200) for _ in range(i + 1)]
        engine.add_request(f"c{i}", prompt, SamplingParams(max_tokens=MAX_LEN - i - 1, **params))
    while engine.has_unfinished_requests():
        engine.step()
    assert seen["eager_steps"] > 3
    assert seen["widths"] == set(range(1, MAX_LEN // BLOCK + 1))
    assert engine.get_stats().num_used_blocks == 0


@pytest.mark.parametrize("arch", ["mistral", "qwen3", "opt", "gpt2", "gpt_neox"])
def test_graph_decode_matches_eager_every_arch(tiny_model_factory, fake_cuda_graphs, arch):
    engine = _engine(tiny_model_factory(arch), max_num_seqs=5)
    seen = _check_against_eager(engine, _attach_graphs(engine))
    rng = random.Random(2)
    for i, max_tokens in enumerate([2, 3, 4, 5, 9]):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randint(1, 30))]
        engine.add_request(
            f"{arch}{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0)
        )
    while engine.has_unfinished_requests():
        engine.step()
    assert seen["sizes"] == {1, 2, 3, 4, 5}


class _CountingGraph:
    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph, self.replays = graph, 0

    def replay(self) -> None:
        self.graph.replay()
        self.replays += 1


def test_graph_decode_matches_eager_triton_split_kv(tiny_llama_dir, monkeypatch, request):
    """The Triton backend: graphs are captured with max_seqlen_k = max_model_len, which picks
    split-KV for small buckets while the eager path over short contexts does not; padding rows
    and empty splits must not change the result. Without CUDA: fake graphs and the Triton
    interpreter; with CUDA: the engine's own, real CUDA graphs."""
    from paged_kernels import attention as kernels

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        request.getfixturevalue("fake_cuda_graphs")

    splits: list[int] = []

    def spy(*args):
        splits.append(kernels_choose(*args))
        return splits[-1]

    kernels_choose = kernels.choose_num_splits
    monkeypatch.setattr(kernels, "choose_num_splits", spy)
    engine = _engine(
        tiny_llama_dir,
        attention_backend="triton",
        max_model_len=1024,
        block_size=16,
        max_num_seqs=3,
        num_gpu_blocks_override=70,
        device="cuda" if on_gpu else "cpu",
    )
    if on_gpu:  # init_kv_cache captured them
        graphs = engine.model_runner.graphs
        graphs.graphs = {key: _CountingGraph(g) for key, g in graphs.graphs.items()}
    else:
        graphs = _attach_graphs(engine)
        assert _Capture.syncs == []  # the Triton path never reads device memory on the host
    assert graphs.sizes == {1: [1, 2, 3]} and set(splits) == {2}  # captured with split-KV
    seen = _check_against_eager(engine, graphs, tol=1e-4 if on_gpu else 1e-5)
    rng = random.Random(1)
    for i, max_tokens in enumerate([2, 3, 5]):  # decode batches of 3, 2 and 1 rows
        # short prompts: the prefill runs twice in the interpreter (eager, then checked)
        prompt = [rng.randrange(3, 200) for _ in range(rng.randint(4, 8))]
        engine.add_request(f"t{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    assert seen["sizes"] == {1, 2, 3}
    assert 1 in splits  # the eager steps over short contexts did not split


# ---- verification steps (speculative decoding): q = k + 1 query tokens per row -----------------
def _greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int]) -> list[tuple]:
    """(token ids, their logprobs) of each prompt's greedy completion; every block free after."""
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
    assert engine.get_stats().num_used_blocks == 0
    outs = [done[str(i)] for i in range(len(prompts))]
    return [(c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]) for c in outs]


def _oracle_drafts(monkeypatch, prompts: list[list[int]], texts: list[list[int]]) -> None:
    """The n-gram lookup, replaced by an oracle: a decoding row proposes k drafts, the next
    tokens of its plain greedy text, the last one wrong when its length is a multiple of 4
    (partly accepted: something to roll back). No proposal gets nothing accepted, so no row
    pauses and every decode step verifies k drafts in every row, until rows near max_tokens get
    fewer (the tiny random model's text seldom repeats n-grams: real lookup drafts too rarely
    for every row of a step to have k drafts)."""
    full = [p + t for p, t in zip(prompts, texts)]

    def propose(tokens, k, n_min, n_max):
        tokens = list(tokens)  # (the planner passes its int32 TokenBuffer)
        seq = next(f for f in full if f[: len(tokens)] == tokens)
        drafts = seq[len(tokens) : len(tokens) + k]
        if len(tokens) % 4 == 0 and len(drafts) > 1:
            drafts[-1] = 3 if drafts[-1] != 3 else 4
        return drafts

    monkeypatch.setattr(planner_mod, "propose_ngram", propose)


def _spec_config() -> dict:
    return {"method": "ngram", "num_speculative_tokens": SPEC_K}


def test_graph_verify_matches_eager(tiny_llama_dir, fake_cuda_graphs, monkeypatch):
    """With speculative_config (k = 2) graphs are captured for q = 1 and q = 3; every step whose
    rows all run 3 tokens (last token + 2 drafts) replays a q = 3 graph (padded batch sizes
    included) with the eager hidden states and KV writes, mixed steps run eagerly, and greedy
    output equals the plain eager engine's."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(2, 20))] for _ in range(6)]
    max_tokens = [8, 14, 20, 26, 32, 38]
    want = _greedy(_engine(tiny_llama_dir), prompts, max_tokens)
    _oracle_drafts(monkeypatch, prompts, [t for t, _ in want])
    engine = _engine(tiny_llama_dir, speculative_config=_spec_config())
    graphs = _attach_graphs(engine, verify_len=SPEC_K + 1)
    buckets = bucket_sizes(MAX_SEQS)
    assert graphs.sizes == {1: buckets, 3: buckets}
    assert set(graphs.graphs) == {(q, bs) for q in (1, 3) for bs in buckets}
    # Most tokens first (one memory pool): q = 3 at 20 rows is 60 tokens.
    assert _Capture.sizes == sorted([*buckets, *(3 * bs for bs in buckets)], reverse=True)
    for (q, bs), graph in graphs.graphs.items():
        ((_, (ids, _, _, meta), out),) = graph.calls
        assert ids.shape == (bs * q,) and out.shape[0] == bs * q
        assert meta.cu_seqlens_q.tolist() == [q * i for i in range(bs + 1)]
        assert (meta.max_seqlen_q, meta.max_seqlen_k) == (q, MAX_LEN)
    seen = _check_against_eager(engine, graphs, query_lens=(1, SPEC_K + 1))

    got = _greedy(engine, prompts, max_tokens)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, g), (_, w) in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    verify_replays = sum(g.replays for (q, _), g in graphs.graphs.items() if q == 3)
    assert verify_replays >= 6
    assert {3, 5, 6} <= seen["verify_sizes"]  # padded into buckets 4 and 8
    assert seen["eager_steps"] > 0  # the prefill and mixed steps
    stats = engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_graph_steps_with_an_eagle3_head_match_eager(
    tiny_llama_dir, fake_cuda_graphs, monkeypatch, tmp_path
):
    """An EAGLE-3 head (random; aux ids [1, 1, 1] of the 2-layer target) drafts k in every
    decoding row (backoff off): decode and uniform verification steps replay graphs, the
    target's streams reach the head through the capture's buffer on replays too, and every
    proposal and greedy token equals an eager engine's."""
    from paged_engine.spec_decode.eagle import Eagle3Runner
    from paged_engine.testing import write_tiny_eagle3_head

    monkeypatch.setattr(planner_mod, "MAX_PAUSE", 0)
    head = write_tiny_eagle3_head(
        tmp_path / "head", tiny_llama_dir, seed=5, eagle_aux_hidden_state_layer_ids=[1, 1, 1]
    )
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": SPEC_K}
    proposals: list[list] = []
    propose = Eagle3Runner.propose

    def recording(self, sched, cached, inputs):
        proposal = propose(self, sched, cached, inputs)
        proposals[-1].append([d for _, d in sorted(proposal.tokens.items())])
        return proposal

    monkeypatch.setattr(Eagle3Runner, "propose", recording)
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(2, 20))] for _ in range(5)]
    max_tokens = [9, 12, 16, 20, 24]
    runs = []
    for graphed in (False, True):
        proposals.append([])
        engine = _engine(tiny_llama_dir, speculative_config=spec)
        graphs = _attach_graphs(engine, verify_len=SPEC_K + 1) if graphed else None
        runs.append(_greedy(engine, prompts, max_tokens))
    assert graphs is not None
    assert [t for t, _ in runs[1]] == [t for t, _ in runs[0]]
    assert proposals[1] == proposals[0] and any(proposals[0])
    replays = {q: sum(g.replays for (p, _), g in graphs.graphs.items() if p == q) for q in (1, 3)}
    assert replays[3] >= 5


def test_graph_verify_matches_eager_triton(tiny_llama_dir, monkeypatch, request):
    """The Triton backend's q = 3 graphs (the multi-token tile shape, no split-KV) give the eager
    results, padding rows (3 rows in bucket 4) included. Without CUDA: fake graphs and the
    Triton interpreter; with CUDA: the engine's own, real CUDA graphs."""
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        request.getfixturevalue("fake_cuda_graphs")
    # max_num_seqs=4: buckets 1, 2, 4 (each captured graph is a full forward in the interpreter)
    options = dict(attention_backend="triton", max_num_seqs=4, device="cuda" if on_gpu else "cpu")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(3, 12))] for _ in range(3)]
    max_tokens = [6, 9, 12]
    want = _greedy(_engine(tiny_llama_dir, enforce_eager=True, **options), prompts, max_tokens)
    _oracle_drafts(monkeypatch, prompts, [t for t, _ in want])
    engine = _engine(tiny_llama_dir, speculative_config=_spec_config(), **options)
    if on_gpu:  # init_kv_cache captured them
        graphs = engine.model_runner.graphs
        graphs.graphs = {key: _CountingGraph(g) for key, g in graphs.graphs.items()}
    else:
        graphs = _attach_graphs(engine, verify_len=SPEC_K + 1)
        assert _Capture.syncs == []  # no host reads in the q = 3 graphs either
    assert graphs.sizes == {1: [1, 2, 4], 3: [1, 2, 4]}
    tol = 1e-4 if on_gpu else 1e-5
    seen = _check_against_eager(engine, graphs, tol=tol, query_lens=(1, SPEC_K + 1))
    got = _greedy(engine, prompts, max_tokens)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, g), (_, w) in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=tol)
    assert 3 in seen["verify_sizes"]
    assert sum(g.replays for (q, _), g in graphs.graphs.items() if q == 3) >= 2


def test_verify_buckets_fit_the_token_budget(tiny_llama_dir):
    """A verification step of bs rows takes bs * q tokens of max_num_batched_tokens: buckets
    past budget // q could never run and are not captured; the buffers hold the most tokens."""
    engine = _engine(tiny_llama_dir, max_num_batched_tokens=32, speculative_config=_spec_config())
    graphs = CudaGraphRunner(engine.model_runner, MAX_SEQS, verify_len=3)
    assert graphs.sizes == {1: bucket_sizes(MAX_SEQS), 3: [1, 2, 4, 8, 10]}
    assert graphs.input_ids.shape == graphs.slot_mapping.shape == (30,)
    assert graphs.cu_seqlens_q[3].tolist() == [3 * i for i in range(11)]
    assert CudaGraphRunner(engine.model_runner, MAX_SEQS).sizes == {1: bucket_sizes(MAX_SEQS)}


@pytest.mark.parametrize(
    ("backend", "enforce_eager", "spec_k", "captured"),
    [
        pytest.param("triton", False, None, True, marks=on_cpu_tensors),
        pytest.param("triton", False, SPEC_K, True, marks=on_cpu_tensors),
        pytest.param("triton", True, SPEC_K, False, marks=on_cpu_tensors),
        ("torch", False, None, False),
    ],
)
def test_init_kv_cache_captures_only_triton_on_cuda(
    tiny_llama_dir, monkeypatch, backend, enforce_eager, spec_k, captured
):
    """Captured graphs: decode only, or with speculative_config also verification (k + 1)."""
    import paged_engine.worker.model_runner as mr

    spec = None if spec_k is None else {"method": "ngram", "num_speculative_tokens": spec_k}
    engine = _engine(tiny_llama_dir, enforce_eager=enforce_eager, speculative_config=spec)
    runner = engine.model_runner
    runner.device = torch.device("cuda", 0)
    runner.backend = get_attention_backend(backend, torch.device("cpu"))
    made: list[object] = []

    class FakeGraphRunner:
        def __init__(self, r, max_num_seqs, verify_len=None):
            assert r is runner and max_num_seqs == MAX_SEQS
            assert verify_len == (None if spec_k is None else spec_k + 1)
            made.append(self)

        def capture(self):
            self.captured = True

    def cache_on_cpu(*args, **kwargs):
        return CacheEngine(*args, **{**kwargs, "device": torch.device("cpu")})

    monkeypatch.setattr(mr, "CacheEngine", cache_on_cpu)
    monkeypatch.setattr(mr, "CudaGraphRunner", FakeGraphRunner)
    runner.graphs = None
    runner.init_kv_cache(8)
    assert (runner.graphs is not None) == captured
    assert [getattr(g, "captured", False) for g in made] == ([True] if captured else [])


def test_run_pads_rows_and_table_columns(tiny_llama_dir, fake_cuda_graphs):
    engine = _engine(tiny_llama_dir)
    graphs = _attach_graphs(engine)
    runner = engine.model_runner
    max_blocks = graphs.block_tables.shape[1]

    def meta(n: int, width: int) -> AttentionMetadata:
        tables = torch.randint(1, 50, (n, width), dtype=torch.int32)
        lens = torch.randint(1, width * BLOCK + 1, (n,), dtype=torch.int32)
        lens[0] = width * BLOCK  # the widest row fills its table
        pos = lens.long() - 1
        slots = tables[torch.arange(n), pos // BLOCK].long() * BLOCK + pos % BLOCK
        return AttentionMetadata(
            slot_mapping=slots,
            block_tables=tables,
            cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
            seq_lens=lens,
            max_seqlen_q=1,
            max_seqlen_k=int(lens.max()),
            backend=runner.backend,
        )

    with torch.inference_mode():
        for n, width in [(MAX_SEQS, max_blocks), (13, 3), (3, max_blocks), (3, 1), (1, 2)]:
            m = meta(n, width)
            ids = torch.randint(0, 200, (n,))
            assert graphs.can_run(m, n)
            hidden = graphs.run(ids, m.seq_lens.long() - 1, m)
            bs = next(s for s in graphs.sizes[1] if s >= n)
            assert hidden.shape[0] == n
            assert hidden.data_ptr() == graphs.outputs[1, bs].data_ptr()  # a view: consume now
            assert graphs.block_tables[:n, :width].equal(m.block_tables)
            assert not graphs.block_tables[:n, width:].any()
            assert not graphs.block_tables[n:bs].any()
            assert (graphs.slot_mapping[n:bs] == -1).all()
            assert (graphs.seq_lens[n:bs] == 1).all()
            eager = runner.model(ids, m.seq_lens.long() - 1, runner.cache.kv_caches, m)
            torch.testing.assert_close(hidden, eager, rtol=1e-5, atol=1e-5)

        m = meta(2, 2)
        assert not graphs.can_run(m, 3)  # a prefill row: not a decode-only step
        wide = meta(2, max_blocks + 1)
        assert not graphs.can_run(wide, 2)  # wider than the static table
        big = meta(MAX_SEQS + 1, 1)
        assert not graphs.can_run(big, MAX_SEQS + 1)


def test_run_pads_verify_rows(tiny_llama_dir, fake_cuda_graphs):
    """q = 3 graphs: n rows of 3 tokens fill the first 3n token slots. Padding rows write nothing
    (slot -1 for each of their tokens) and attend the null block with seq_len 3 (query
    positions 0..2: finite outputs); the real rows' hidden states and KV writes equal an eager
    forward's, whatever larger steps left in the buffers."""
    q = SPEC_K + 1
    engine = _engine(tiny_llama_dir, speculative_config=_spec_config())
    graphs = _attach_graphs(engine, verify_len=q)
    runner = engine.model_runner
    caches = runner.cache.kv_caches
    max_blocks = graphs.block_tables.shape[1]
    num_blocks = caches[0][0].shape[0]
    gen = torch.Generator().manual_seed(0)

    def step(n: int, width: int, q_lens: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
        """Metadata and positions of n rows, row i running the last q_lens[i] positions of
        its seq_len. Distinct blocks: no two tokens of the step share a slot."""
        tables = torch.randperm(num_blocks - 1, generator=gen)[: n * width] + 1
        tables = tables.view(n, width).int()
        lens = torch.randint(q, width * BLOCK + 1, (n,), generator=gen, dtype=torch.int32)
        lens[0] = width * BLOCK  # the widest row fills its table
        q_lens_t = torch.tensor(q_lens)
        rows = torch.arange(n).repeat_interleave(q_lens_t)
        cu = torch.zeros(n + 1, dtype=torch.int32)
        cu[1:] = q_lens_t.cumsum(0)
        pos = lens.long()[rows] - cu[1:].long()[rows] + torch.arange(len(rows))  # last q_len
        slots = tables[rows, pos // BLOCK].long() * BLOCK + pos % BLOCK
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=tables,
            cu_seqlens_q=cu,
            seq_lens=lens,
            max_seqlen_q=max(q_lens),
            max_seqlen_k=int(lens.max()),
            backend=runner.backend,
        )
        return meta, pos

    def can_run(n: int, width: int, q_lens: list[int]) -> bool:
        return graphs.can_run(step(n, width, q_lens)[0], sum(q_lens))

    with torch.inference_mode():
        for k, v in caches:  # context to attend to; the null block stays empty
            k[1:].normal_(generator=gen)
            v[1:].normal_(generator=gen)
        for n, width in [(MAX_SEQS, max_blocks), (13, 3), (3, max_blocks), (5, 1), (1, 2)]:
            m, pos = step(n, width, [q] * n)
            ids = torch.randint(0, 200, (n * q,), generator=gen)
            assert graphs.can_run(m, n * q)
            before = [(k.clone(), v.clone()) for k, v in caches]
            hidden = graphs.run(ids, pos, m)
            bs = next(s for s in graphs.sizes[q] if s >= n)
            assert hidden.shape[0] == n * q
            assert hidden.data_ptr() == graphs.outputs[q, bs].data_ptr()  # a view: consume now
            assert (graphs.slot_mapping[n * q : bs * q] == -1).all()
            assert (graphs.seq_lens[n:bs] == q).all()
            assert not graphs.block_tables[n:bs].any() and not graphs.block_tables[:n, width:].any()
            assert graphs.outputs[q, bs].isfinite().all()  # the padding rows' too
            written = set(m.slot_mapping.tolist())
            for (k, v), (k0, v0) in zip(caches, before):
                changed = ((k != k0) | (v != v0)).flatten(2).any(-1).flatten()
                assert set(changed.nonzero().flatten().tolist()) <= written
            graph_caches = [(k.clone(), v.clone()) for k, v in caches]
            for (k, v), (k0, v0) in zip(caches, before):
                k.copy_(k0)
                v.copy_(v0)
            eager = runner.model(ids, pos, caches, m)
            torch.testing.assert_close(hidden, eager, rtol=1e-5, atol=1e-5)
            for (k, v), (kg, vg) in zip(caches, graph_caches):
                assert k.equal(kg) and v.equal(vg)

        assert can_run(4, 2, [1] * 4)  # decode steps keep their graphs
        assert not can_run(3, 2, [3, 3, 2])  # a row with one draft: the step runs eagerly
        assert not can_run(3, 2, [3, 1, 3])  # a row without drafts
        assert not can_run(3, 2, [2, 2, 2])  # q = 2 was not captured
        assert not can_run(2, max_blocks + 1, [q] * 2)  # wider than the static table
        assert not can_run(MAX_SEQS + 1, 1, [q] * (MAX_SEQS + 1))


# ---- memory profiling ---------------------------------------------------------------------------
MIB = 1 << 20


class _FakeCudaMemory:
    """torch.cuda's memory queries; `_profile_forward` (run for real on CPU) bumps the peak by its
    scratch KV bytes plus `activation` bytes."""

    def __init__(self, total: int, used: int, allocated: int, activation: int) -> None:
        self.total, self.used, self.allocated, self.activation = total, used, allocated, activation
        self.peak = allocated
        self.calls: list[str] = []

    def install(self, monkeypatch) -> None:
        fakes = {
            "mem_get_info": lambda *a: (self.total - self.used, self.total),
            "memory_allocated": lambda *a: self.allocated,
            "max_memory_allocated": lambda *a: self.peak,
            "reset_peak_memory_stats": self._reset,
            "empty_cache": lambda: self.calls.append("empty_cache"),
            "synchronize": lambda *a: None,
        }
        for name, fn in fakes.items():
            monkeypatch.setattr(torch.cuda, name, fn)
        profile, forward = mp.profile_num_blocks, mp.profile_forward

        def profile_as_cuda(runner, *args, **kwargs):  # CUDA branch, runner tensors on the CPU
            cpu, runner.device = runner.device, torch.device("cuda")
            try:
                return profile(runner, *args, **kwargs)
            finally:
                runner.device = cpu

        def forward_on_cpu(runner):
            cuda, runner.device = runner.device, torch.device("cpu")
            try:
                self.calls.append("forward")
                scratch = forward(runner)
                self.peak = max(self.peak, self.allocated + scratch + self.activation)
                return scratch
            finally:
                runner.device = cuda

        monkeypatch.setattr(worker_mod, "profile_num_blocks", profile_as_cuda)
        monkeypatch.setattr(mp, "profile_forward", forward_on_cpu)

    def _reset(self, *a) -> None:
        self.calls.append("reset_peak")
        self.peak = self.allocated


def _bytes_per_block(engine: LLMEngine) -> int:
    return CacheEngine.bytes_per_block(engine.hf_config, engine.config.block_size, torch.float32)


@pytest.mark.parametrize("util", [0.5, 0.9])
def test_profile_num_blocks_arithmetic(tiny_llama_dir, monkeypatch, util):
    mem = _FakeCudaMemory(total=64 * MIB, used=20 * MIB, allocated=15 * MIB, activation=5 * MIB)
    mem.install(monkeypatch)
    engine = _engine(
        tiny_llama_dir,
        num_gpu_blocks_override=None,
        gpu_memory_utilization=util,
        max_num_batched_tokens=256,
    )
    bpb = _bytes_per_block(engine)
    expected = int((64 * MIB * util - 20 * MIB - 5 * MIB) // bpb)
    assert engine.num_blocks == expected
    assert mem.calls[:3] == ["empty_cache", "reset_peak", "forward"]
    # Weights (already in `used`) are not counted twice, and the forward's scratch KV cache is
    # not counted as activation memory.
    engine.add_request("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()


def test_profile_counts_only_the_engines_own_memory(tiny_llama_dir, monkeypatch):
    """With a baseline (memory other processes held before the engine loaded), only what the
    engine added counts against total * utilization."""
    mem = _FakeCudaMemory(total=64 * MIB, used=20 * MIB, allocated=15 * MIB, activation=5 * MIB)
    mem.install(monkeypatch)
    engine = _engine(tiny_llama_dir)  # CPU engine; re-profile its runner as if on CUDA
    runner = engine.model_runner
    runner.config.num_gpu_blocks_override = None
    runner.config.max_num_batched_tokens = 256
    blocks = worker_mod.profile_num_blocks(runner, baseline_used=12 * MIB)
    expected = int((64 * MIB * 0.9 - (20 - 12) * MIB - 5 * MIB) // _bytes_per_block(engine))
    assert blocks == expected


def test_profile_budget_too_small_is_a_clear_error(tiny_llama_dir, monkeypatch):
    mem = _FakeCudaMemory(total=64 * MIB, used=40 * MIB, allocated=30 * MIB, activation=8 * MIB)
    mem.install(monkeypatch)
    with pytest.raises(ValueError, match=r"fewer than max_model_len=64.*gpu_memory_utilization"):
        _engine(tiny_llama_dir, num_gpu_blocks_override=None, gpu_memory_utilization=0.75)


def test_profile_forward_stays_within_max_model_len(tiny_llama_dir):
    """Few sequences and a token budget above max_model_len: no profiled row runs positions the
    model has no embedding for (the tiny model has 1024)."""
    engine = _engine(
        tiny_llama_dir,
        max_model_len=1024,
        max_num_seqs=1,
        max_num_batched_tokens=3000,
        num_gpu_blocks_override=300,
    )
    scratch = mp.profile_forward(engine.model_runner)
    assert scratch == (1024 // BLOCK + 1) * _bytes_per_block(engine)


@pytest.mark.parametrize("max_logprobs", [20, -1])
def test_profile_forward_samples_and_makes_a_prompt_logprobs_slice(
    tiny_llama_dir, monkeypatch, max_logprobs
):
    """The profile's peak includes the sampler's costliest path over a step's sampled rows
    (every filter and penalty, max_logprobs logprobs: -1 the vocabulary) and the largest other
    logits a step makes: one prompt-logprobs slice (model_runner.PROMPT_LOGPROBS_ELEMENTS, 5
    rows here), packed alike. It leaves the engine's random draws alone."""
    import paged_engine.sample.logprobs as logprobs
    import paged_engine.sample.sampler as sampler_module
    import paged_engine.worker.model_runner as model_runner

    engine = _engine(tiny_llama_dir, max_num_seqs=2, max_logprobs=max_logprobs)
    runner = engine.model_runner
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_ELEMENTS", 5 * runner.vocab_size)
    rows, packed, mds = [], [], []
    whole, pack, gather = runner.compute_logits, logprobs.prompt_logprobs, logprobs.gather_logprobs
    monkeypatch.setattr(runner, "compute_logits", lambda h: rows.append(len(h)) or whole(h))
    monkeypatch.setattr(logprobs, "prompt_logprobs", lambda *a: packed.append(pack(*a)))
    monkeypatch.setattr(sampler_module, "gather_logprobs", lambda *a: packed.append(gather(*a)))
    sample = runner.sampler.sample
    monkeypatch.setattr(
        runner.sampler, "sample", lambda x, md, *a: mds.append(md) or sample(x, md, *a)
    )
    seeds_before = runner.sampler._race_seeds.bit_generator.state
    mp.profile_forward(runner)
    assert runner.sampler._race_seeds.bit_generator.state == seeds_before
    assert rows == [2, 5]  # the sampled rows (max_num_seqs), then the slice
    k = runner.vocab_size if max_logprobs == -1 else max_logprobs
    assert [p.shape for p in packed] == [(2, 3 + 3 * k), (5, 3 + 3 * k)]
    (md,) = mds
    assert md.top_k_top_p is not None and not md.top_k_only and md.min_p is not None
    assert md.penalties is not None and not md.all_greedy


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_profile_forward_includes_a_verification_step(tiny_llama_dir, monkeypatch, drafter):
    """With speculative_config the profile also samples a verification step's logits: k + 1
    positions for each of max_num_seqs rows (2 x 4 here), processed by the costliest path, with
    a draft model's q over its draft rows; the engine's draws are left alone."""
    import paged_engine.spec_decode.rejection_sampler as rejection

    spec = {"method": "ngram", "num_speculative_tokens": 3}
    if drafter == "draft_model":
        spec = {"model": str(tiny_llama_dir), "num_speculative_tokens": 3}
    engine = _engine(tiny_llama_dir, max_num_seqs=2, speculative_config=spec)
    runner = engine.model_runner
    rows, calls = [], []
    whole, verify = runner.compute_logits, rejection.verify
    monkeypatch.setattr(runner, "compute_logits", lambda h: rows.append(len(h)) or whole(h))

    def recording(processed, drafts, greedy, noise, num_drafts, q=None):
        calls.append((processed.shape[0], drafts.tolist(), num_drafts.tolist(), q))
        return verify(processed, drafts, greedy, noise, num_drafts, q)

    monkeypatch.setattr(rejection, "verify", recording)
    seeds_before = runner.sampler._race_seeds.bit_generator.state
    mp.profile_forward(runner)
    assert runner.sampler._race_seeds.bit_generator.state == seeds_before
    assert rows[:2] == [2, 8]  # the sampled rows, then the verification's
    ((n, drafts, num_drafts, q),) = calls
    assert n == 8 and num_drafts == [3, 3] and drafts == [1, 1, 1, -1] * 2
    if drafter == "draft_model":
        assert q is not None and q.shape == (8, runner.vocab_size)
        assert q[3].abs().sum() == 0 and q[0].sum().item() == pytest.approx(1.0, abs=1e-4)
    else:
        assert q is None


# ---- devices and block copies -------------------------------------------------------------------
def test_cuda_device_gets_an_index(monkeypatch):
    """Tensors report cuda:N; a seeded generator made on the engine's device must compare equal
    to the logits' device, or the sampler takes its slower cross-device path."""
    _pick_device = worker_mod.pick_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert _pick_device("auto") == _pick_device("cuda") == torch.device("cuda", 0)
    assert _pick_device("cuda:1") == torch.device("cuda", 1)
    assert _pick_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_engine_triton_copy_blocks_matches_torch(tiny_llama_dir, dtype):
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(tiny_llama_dir)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # else the interpreter
    caches = {
        name: CacheEngine(
            hf_config, 12, BLOCK, dtype=dtype, device=dev, backend=get_attention_backend(name, dev)
        )
        for name in ("torch", "triton")
    }
    gen = torch.Generator().manual_seed(0)
    for layers in zip(*(c.kv_caches for c in caches.values())):
        for a, b in zip(*layers):
            a.copy_(torch.randn(a.shape, generator=gen))
            b.copy_(a)
    pairs = [(3, 7), (5, 1), (3, 9)]  # one source twice; no destination is also a source
    for cache in caches.values():
        cache.copy_blocks(pairs)
    for (k1, v1), (k2, v2) in zip(caches["torch"].kv_caches, caches["triton"].kv_caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
        assert torch.equal(k1[9], k1[3]) and torch.equal(v1[1], v1[5])


def test_gpu_share_must_be_free_at_start(monkeypatch):
    """What others hold is measured after this process let go of a dropped engine: one that
    only a reference cycle keeps (collected), and its blocks in torch's cache (released)."""

    class Dropped:  # an earlier engine's KV cache: 20 MiB until collected
        pass

    gc.disable()  # only gpu_baseline's own collection may free it
    try:
        dropped = Dropped()
        dropped.cycle = dropped
        alive = weakref.ref(dropped)
        del dropped
        calls: list[str] = []
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))

        def mem_get_info(*_):
            calls.append("mem_get_info")
            return ((30 if alive() is None else 10) * MIB, 64 * MIB)

        monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
        assert mp.gpu_baseline(torch.device("cuda"), 0.4) == 34 * MIB  # others hold 34 MiB
    finally:
        gc.enable()
    assert calls == ["empty_cache", "mem_get_info"]
    _gpu_baseline = mp.gpu_baseline
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.9 .* only 0.0 GiB is free"):
        _gpu_baseline(torch.device("cuda"), 0.9)


@on_cpu_tensors
def test_graph_decode_with_lora_adapters_matches_eager(tiny_llama_dir, fake_cuda_graphs, tmp_path):
    """The LoRA kernels (Triton's interpreter) go into every graph while no slot has tokens, and
    each replay reads the step's token -> slot mapping from the static buffers: decode steps of
    requests with two adapters and none give the eager hidden states."""
    from paged_engine import LoRARequest
    from paged_engine.testing import write_lora_adapter

    # buckets 1, 2, 4, 6 (each capture runs the interpreter's kernels): 3 and 5 rows are padded
    lora = dict(enable_lora=True, max_loras=2, max_lora_rank=4, max_num_seqs=6)
    engine = _engine(tiny_llama_dir, **lora)
    mapping = engine.model_runner.lora.model.mapping
    mapping.use_kernels = True  # the CUDA path, on CPU tensors
    seen = _check_against_eager(engine, _attach_graphs(engine), tol=1e-4)
    assert not mapping.capturing
    paths = [write_lora_adapter(tmp_path / f"a{i}", tiny_llama_dir, rank=4, seed=i) for i in (0, 1)]
    loras = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(paths)]
    rng = random.Random(5)
    requests = []
    for i in range(6):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randint(2, 12))]
        sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(2, 6))
        requests.append((f"l{i}", prompt, sp, [*loras, None][i % 3]))

    def run(eng: LLMEngine) -> dict[str, list[int]]:
        for rid, prompt, sp, lora in requests:
            eng.add_request(rid, prompt, sp, lora_request=lora)
        done = {}
        while eng.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
        return done

    # A real graph reads the addresses captured: the mapping must be written into them.
    static = (mapping.token_idx.data_ptr(), mapping.seg_start.data_ptr())
    got = run(engine)
    assert len(seen["sizes"]) >= 3 and seen["eager_steps"] >= 1
    assert (mapping.token_idx.data_ptr(), mapping.seg_start.data_ptr()) == static
    # The tokens of an engine without graphs, whose LoRA runs in torch.
    plain = _engine(tiny_llama_dir, **lora)
    assert got == run(plain)


def test_hybrid_model_decodes_through_graphs(tmp_path, fake_cuda_graphs):
    """A hybrid model's decode steps replay graphs whose recurrent-state rows come from static
    buffers (padding rows on the scratch row): greedy outputs equal the engine's without
    graphs, batch sizes between buckets included."""
    from paged_engine.testing import write_tiny_model

    path = write_tiny_model(tmp_path, "qwen3_5", seed=2)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(1, 20))] for _ in range(7)]
    outputs = []
    for graphed in (False, True):
        engine = _engine(path)
        graphs = _attach_graphs(engine) if graphed else None
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=3 + 2 * i)
            engine.add_request(str(i), prompt, params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        outputs.append(done)
        if graphs is not None:
            assert sum(g.replays for g in graphs.graphs.values()) > 5
            states = engine.model_runner.states
            assert graphs.state_slots is not None and states is not None
            assert graphs.scratch_row == states.scratch_row == MAX_SEQS
    assert outputs[0] == outputs[1]


def test_kv_cache_memory_bytes_sizes_the_pool(tiny_llama_dir, monkeypatch):
    """kv_cache_memory_bytes (vLLM's) is the pool's size in bytes: no profile, whatever
    gpu_memory_utilization says; num_gpu_blocks_override still wins; too small is the
    usual error, naming the option."""
    mem = _FakeCudaMemory(total=64 * MIB, used=20 * MIB, allocated=15 * MIB, activation=5 * MIB)
    mem.install(monkeypatch)
    engine = _engine(
        tiny_llama_dir,
        num_gpu_blocks_override=None,
        kv_cache_memory_bytes=3 * MIB,
        gpu_memory_utilization=0.1,
    )
    assert engine.num_blocks == 3 * MIB // _bytes_per_block(engine)
    assert "forward" not in mem.calls  # nothing profiled
    over = _engine(tiny_llama_dir, num_gpu_blocks_override=40, kv_cache_memory_bytes=3 * MIB)
    assert over.num_blocks == 40
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        _engine(tiny_llama_dir, num_gpu_blocks_override=None, kv_cache_memory_bytes=1024)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=0 is invalid"):
        _engine(tiny_llama_dir, kv_cache_memory_bytes=0)
