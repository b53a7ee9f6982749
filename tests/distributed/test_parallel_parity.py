"""Tensor and pipeline parallelism (2 gloo ranks on the CPU) give the single-process engine's
outputs: identical greedy tokens, logprobs within 1e-4, for every tiny architecture (pipeline
stages: one per model shell); and the
step's other features (n > 1, beams, seeds, preemption, prefix caching, prompt logprobs,
prompt_embeds)."""

from __future__ import annotations

import os
import random

import pytest
from safetensors import safe_open

from paged_engine import LLM, BeamSearchParams, SamplingParams
from paged_engine.testing import SUPPORTED_TINY_ARCHS, write_tiny_model

pytest.importorskip("transformers")

LP_TOL = 1e-4


def _run(path, requests, **engine_kwargs):
    """[(token_ids, logprobs of the chosen tokens)] per request, in order."""
    engine_kwargs.setdefault("max_model_len", 256)
    llm = LLM(model=str(path), dtype="float32", **engine_kwargs)
    try:
        prompts = [p for p, _ in requests]
        outs = llm.generate(prompts, [sp for _, sp in requests], use_tqdm=False)
        return [_summary(o) for o in outs]
    finally:
        llm.llm_engine.shutdown()


def _summary(out):
    seqs = []
    for c in out.outputs:
        lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])]
        seqs.append((list(c.token_ids), lps))
    prompt_lps = None
    if out.prompt_logprobs is not None:
        prompt_lps = [None if d is None else sorted(d.items()) for d in out.prompt_logprobs]
    return seqs, prompt_lps


def _assert_same(got, want):
    assert len(got) == len(want)
    for (g_seqs, g_prompt), (w_seqs, w_prompt) in zip(got, want):
        assert [t for t, _ in g_seqs] == [t for t, _ in w_seqs]
        for (_, g_lp), (_, w_lp) in zip(g_seqs, w_seqs):
            assert g_lp == pytest.approx(w_lp, abs=LP_TOL)
        assert (g_prompt is None) == (w_prompt is None)
        for g, w in zip(g_prompt or [], w_prompt or []):
            if w is None:
                assert g is None
                continue
            assert [tok for tok, _ in g] == [tok for tok, _ in w]
            assert [x.logprob for _, x in g] == pytest.approx([x.logprob for _, x in w], abs=LP_TOL)


def _greedy_requests(seed: int = 0):
    rng = random.Random(seed)
    sp = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    return [
        ({"prompt_token_ids": [rng.randrange(3, 200) for _ in range(rng.randint(1, 40))]}, sp)
        for _ in range(6)
    ]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny(arch) -> (model dir, requests, single-process outputs), once per architecture."""
    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            path = write_tiny_model(tmp_path_factory.mktemp(arch), arch, seed=1)
            requests = _greedy_requests()
            cache[arch] = (path, requests, _run(path, requests))
        return cache[arch]

    return get


# Tensor parallelism shards every layer type of every architecture. Pipeline stages cut the
# decoder stack between layers: one Llama-family shell (Llama, Mistral, Qwen2 and Qwen3 share
# it) and each other shell (OPT's projections, GPT-2's tied head, GPT-NeoX's head).
PARALLEL_CASES = [(arch, 2, 1) for arch in SUPPORTED_TINY_ARCHS] + [
    (arch, 1, 2) for arch in ("llama", "opt", "gpt2", "gpt_neox")
]


@pytest.mark.parametrize(
    ("arch", "tp", "pp"),
    PARALLEL_CASES,
    ids=[f"{a}-{'tp2' if tp == 2 else 'pp2'}" for a, tp, _ in PARALLEL_CASES],
)
def test_every_architecture_matches_one_process(tiny, arch, tp, pp):
    path, requests, want = tiny(arch)
    got = _run(path, requests, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    _assert_same(got, want)


def _feature_requests(embedding):
    rng = random.Random(3)
    system = [rng.randrange(3, 200) for _ in range(40)]  # a shared prefix: prefix-cache hits
    reqs = []
    for _ in range(4):
        tail = [rng.randrange(3, 200) for _ in range(rng.randint(5, 30))]
        reqs.append(
            (
                {"prompt_token_ids": system + tail},
                SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1),
            )
        )
    prompt = {"prompt_token_ids": [rng.randrange(3, 200) for _ in range(20)]}
    reqs += [
        (prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, logprobs=1)),
        (prompt, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, ignore_eos=True)),
        (prompt, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)),
        (prompt, BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)),
    ]
    # prompts given as embedding rows (two sharing leading blocks of rows)
    for tail in ([5, 6, 7], [8, 9]):
        rows = embedding[system[:20] + tail]
        reqs.append(({"prompt_embeds": rows}, SamplingParams(temperature=0, max_tokens=8)))
    return reqs


@pytest.fixture(scope="module")
def feature_model(tmp_path_factory):
    # One KV head and a vocabulary that does not split evenly: KV heads replicated over two
    # TP ranks, and a padded last vocab shard.
    path = write_tiny_model(
        tmp_path_factory.mktemp("gqa"), "llama", seed=2, num_key_value_heads=1, vocab_size=509
    )
    # A pool of 12 blocks of 16 tokens: the batch does not fit at once, so some sequences are
    # preempted and recomputed.
    kwargs = {
        "num_gpu_blocks_override": 12,
        "block_size": 16,
        "max_model_len": 128,
        "enable_prompt_embeds": True,
    }
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        requests = _feature_requests(f.get_tensor("model.embed_tokens.weight"))
    return path, requests, kwargs, _run(path, requests, **kwargs)


@pytest.mark.parametrize(
    ("tp", "pp", "overlap"),
    [(2, 1, False), (2, 1, True), (1, 2, False), (2, 2, False)],
    ids=["tp2", "tp2-async", "pp2", "tp2-pp2"],
)
def test_features_under_parallelism(feature_model, tp, pp, overlap):
    """n > 1 (seeded), unseeded sampling (the ranks' own generator, seeded by the engine seed),
    beams, prompt logprobs, prompt_embeds, prefix caching and preemption: the same outputs;
    with async scheduling too (two steps in flight across the ranks), and on a 2 x 2 grid of
    ranks (each pipeline stage split over two tensor ranks)."""
    path, requests, kwargs, want = feature_model
    llm = LLM(
        model=str(path),
        dtype="float32",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        async_scheduling=overlap,
        **kwargs,
    )
    try:
        outs = llm.generate([p for p, _ in requests], [sp for _, sp in requests], use_tqdm=False)
        stats = llm.llm_engine.get_stats()
        assert stats.num_preemptions > 0
        assert stats.prefix_cache_hits > 0
        assert stats.num_used_blocks == 0
    finally:
        llm.llm_engine.shutdown()
    got = [_summary(o) for o in outs]
    if overlap:  # unseeded draws follow the steps' composition, which async scheduling changes
        unseeded = next(i for i, (_, sp) in enumerate(requests) if _is_unseeded(sp))
        got, want = _without(got, unseeded), _without(want, unseeded)
    _assert_same(got, want)


def _is_unseeded(sp) -> bool:
    return isinstance(sp, SamplingParams) and sp.temperature > 0 and sp.seed is None


def _without(items: list, index: int) -> list:
    return items[:index] + items[index + 1 :]


def test_sizes_the_model_cannot_take_fail_before_any_rank_starts(tmp_path):
    path = write_tiny_model(tmp_path, "llama")  # 4 heads, 2 KV heads, 2 layers
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide"):
        LLM(model=str(path), tensor_parallel_size=3)
    moe = write_tiny_model(tmp_path / "moe", "qwen3_moe", moe_intermediate_size=30)
    with pytest.raises(ValueError, match="must divide the model's moe_intermediate_size=30"):
        LLM(model=str(moe), tensor_parallel_size=4)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds"):
        LLM(model=str(path), pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM(model=str(path), pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(model=str(path), pipeline_parallel_size=2, async_scheduling=True)


def test_a_second_parallel_engine_in_one_process_is_refused_until_the_first_stops(tmp_path):
    path = write_tiny_model(tmp_path, "llama")
    first = LLM(model=str(path), max_model_len=64, tensor_parallel_size=2)
    try:
        with pytest.raises(RuntimeError, match=r"already belongs to a torch\.distributed world"):
            LLM(model=str(path), max_model_len=64, tensor_parallel_size=2)
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert len(first.generate(["hi"], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
    finally:
        first.llm_engine.shutdown()
    second = LLM(model=str(path), max_model_len=64, tensor_parallel_size=2)
    second.llm_engine.shutdown()


def _rank_view(worker, name: str) -> tuple[int, int, str | None]:
    """(pid, parent pid, os.environ[name]) of the rank that runs it (through collective_rpc)."""
    return os.getpid(), os.getppid(), os.environ.get(name)


@pytest.mark.parametrize("method", [None, "spawn", "forkserver"])
def test_ranks_start_by_the_chosen_method_with_the_engines_environment(
    tmp_path, monkeypatch, method
):
    """On the CPU rank 1 forks from this process's forkserver unless PAGED_WORKER_MULTIPROC_METHOD
    says spawn; either way it sees rank 0's environment as it was when its engine started (the
    forkserver's own is from the first engine)."""
    path = write_tiny_model(tmp_path, "llama")
    if method is None:
        monkeypatch.delenv("PAGED_WORKER_MULTIPROC_METHOD", raising=False)
    else:
        monkeypatch.setenv("PAGED_WORKER_MULTIPROC_METHOD", method)
    monkeypatch.delenv("PAGED_TEST_MARK", raising=False)
    # A forkserver started with an older environment (the first engine's) serves the second;
    # a spawned rank is a fresh interpreter every time: one engine shows it (~5 s of imports).
    for mark in ("first",) if method == "spawn" else ("first", "second"):
        os.environ["PAGED_TEST_MARK"] = mark
        llm = LLM(model=str(path), max_model_len=64, tensor_parallel_size=2)
        try:
            ranks = llm.collective_rpc(_rank_view, args=("PAGED_TEST_MARK",))
        finally:
            llm.llm_engine.shutdown()
        (pid0, _, mark0), (pid1, parent1, mark1) = ranks
        assert pid0 == os.getpid() and pid1 != pid0
        assert mark0 == mark1 == mark
        assert (parent1 == pid0) == (method == "spawn")  # a forkserver's child otherwise


def test_an_unknown_start_method_fails_before_any_rank_starts(tmp_path, monkeypatch):
    path = write_tiny_model(tmp_path, "llama")
    monkeypatch.setenv("PAGED_WORKER_MULTIPROC_METHOD", "fork")
    with pytest.raises(ValueError, match="PAGED_WORKER_MULTIPROC_METHOD='fork' is invalid"):
        LLM(model=str(path), max_model_len=64, tensor_parallel_size=2)
    monkeypatch.delenv("PAGED_WORKER_MULTIPROC_METHOD")
    LLM(model=str(path), max_model_len=64, tensor_parallel_size=2).llm_engine.shutdown()
