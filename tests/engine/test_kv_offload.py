"""Swap preemption and the prefix cache's CPU tier: a device pool small enough to force
preemption / eviction gives the unconstrained engine's outputs, and every device and CPU block
is free at the end. Runs with sync and async scheduling (the scheduler plans a step ahead)."""

from __future__ import annotations

import random

import pytest

from paged_engine import LLM, BeamSearchParams, SamplingParams
from paged_engine.core.block_manager import BlockManager
from paged_engine.core.request import Request

# The tiny llama's block: 2 layers x 16 tokens x 2 KV heads x 16 dims x (K, V) x 4 bytes.
BLOCK_BYTES = 8192
CPU_64_BLOCKS = 64 * BLOCK_BYTES / 2**30  # GiB


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(params=["sync", "async"])
def scheduling(request) -> bool:
    return request.param == "async"


def _prompts(count: int, seed: int = 0, lo: int = 20, hi: int = 70) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def _params() -> list[SamplingParams]:
    """Greedy, seeded sampling with logprobs, and n = 2: outputs must not depend on preemption."""
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    seeded = SamplingParams(temperature=0.9, seed=7, max_tokens=40, ignore_eos=True)
    forked = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=30, ignore_eos=True)
    return [greedy, seeded, forked, greedy, seeded, greedy]


def _run(model_dir, prompts, params, **kw):
    kw.setdefault("max_model_len", 128)
    llm = LLM(model=str(model_dir), dtype="float32", **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [
        [(list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
          if c.logprobs else None) for c in o.outputs]
        for o in outs
    ]  # fmt: skip
    stats = llm.get_stats()
    llm.llm_engine.shutdown()
    return got, stats


def _assert_same(got, want) -> None:
    """Identical tokens; logprobs equal up to float noise (batch composition changes)."""
    assert [[ids for ids, _ in o] for o in got] == [[ids for ids, _ in o] for o in want]
    for g, w in zip(got, want):
        for (_, g_lp), (_, w_lp) in zip(g, w):
            assert (g_lp is None) == (w_lp is None)
            assert g_lp is None or g_lp == pytest.approx(w_lp, abs=1e-4)


def _assert_all_free(stats) -> None:
    assert stats.num_used_blocks == 0
    assert stats.num_free_cpu_blocks == stats.num_cpu_blocks


@pytest.mark.parametrize(
    ("mode", "batched"),
    [("swap", None), ("recompute", None), (None, 48)],
    ids=["swap", "recompute", "auto"],
)
def test_preemption_modes_never_change_outputs(model_dir, scheduling, mode, batched):
    prompts, params = _prompts(6), _params()
    want, _ = _run(model_dir, prompts, params, enable_prefix_caching=False)
    kw = {"max_num_batched_tokens": batched} if batched else {}
    got, stats = _run(
        model_dir, prompts, params,
        num_gpu_blocks_override=14, preemption_mode=mode, swap_space=CPU_64_BLOCKS,
        enable_prefix_caching=False, async_scheduling=scheduling, **kw,
    )  # fmt: skip
    _assert_same(got, want)
    assert stats.num_preemptions > 0, "the pool should force preemption"
    if mode == "recompute":
        assert stats.num_swap_preemptions == 0
    else:  # auto: 48-token steps make the long (and forked) requests swap
        assert stats.num_swap_preemptions > 0
    if mode is None:
        assert stats.num_swap_preemptions < stats.num_preemptions, "short ones recompute"
    _assert_all_free(stats)


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_full(model_dir):
    prompts, params = _prompts(6), _params()
    want, _ = _run(model_dir, prompts, params, enable_prefix_caching=False)
    got, stats = _run(
        model_dir, prompts, params,
        num_gpu_blocks_override=14, preemption_mode="swap", swap_space=3 * BLOCK_BYTES / 2**30,
        enable_prefix_caching=False,
    )  # fmt: skip
    _assert_same(got, want)
    assert 0 < stats.num_swap_preemptions < stats.num_preemptions
    _assert_all_free(stats)


def test_swap_with_beams_and_prefix_caching(model_dir, scheduling):
    prompts = _prompts(4, seed=5)
    beams = BeamSearchParams(beam_width=3, max_tokens=16)
    kw = {"max_model_len": 128, "dtype": "float32"}
    ref = LLM(model=str(model_dir), **kw)
    want = [
        [b.tokens for b in o.sequences]
        for o in ref.beam_search([{"prompt_token_ids": p} for p in prompts], beams)
    ]
    ref.llm_engine.shutdown()
    llm = LLM(
        model=str(model_dir), num_gpu_blocks_override=16, preemption_mode="swap",
        swap_space=CPU_64_BLOCKS, async_scheduling=scheduling, **kw,
    )  # fmt: skip
    got = [
        [b.tokens for b in o.sequences]
        for o in llm.beam_search([{"prompt_token_ids": p} for p in prompts], beams)
    ]
    stats = llm.get_stats()
    llm.llm_engine.shutdown()
    assert got == want
    assert stats.num_swap_preemptions > 0
    _assert_all_free(stats)


def test_abort_frees_a_swapped_request(model_dir):
    llm = LLM(
        model=str(model_dir), dtype="float32", max_model_len=128, num_gpu_blocks_override=10,
        preemption_mode="swap", swap_space=CPU_64_BLOCKS, enable_prefix_caching=False,
    )  # fmt: skip
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i, p in enumerate(_prompts(4, seed=1, lo=30, hi=40)):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    while not engine.block_manager.cpu.tables:
        engine.step()
    swapped = {
        r.request_id for r in engine.scheduler.waiting if engine.block_manager.is_swapped(r.seqs[0])
    }
    assert swapped
    engine.abort_request(list(swapped))
    while engine.has_unfinished_requests():
        engine.step()
    _assert_all_free(engine.get_stats())
    engine.shutdown()


def _chat_turns(num_convs: int, turns: int, seed: int = 0) -> list[list[list[int]]]:
    """Per conversation, the prompt of each turn: the previous prompt + a reply + a question."""
    rng = random.Random(seed)
    convs = []
    for _ in range(num_convs):
        prompt = [rng.randrange(3, 500) for _ in range(40)]
        conv = []
        for _ in range(turns):
            conv.append(list(prompt))
            prompt += [rng.randrange(3, 500) for _ in range(rng.randint(18, 30))]
        convs.append(conv)
    return convs


def _chat(model_dir, **kw):
    """Turn t of every conversation, then turn t + 1: the pool cannot keep them all."""
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=256, **kw)
    convs = _chat_turns(6, 4)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = []
    for t in range(4):
        batch = [{"prompt_token_ids": c[t]} for c in convs]
        outs += [o.outputs[0].token_ids for o in llm.generate(batch, sp, use_tqdm=False)]
    stats = llm.get_stats()
    llm.llm_engine.shutdown()
    return outs, stats


def test_cpu_tier_keeps_evicted_prefixes(model_dir, scheduling):
    want, base = _chat(model_dir, num_gpu_blocks_override=24, async_scheduling=scheduling)
    got, tier = _chat(
        model_dir, num_gpu_blocks_override=24, cpu_offload_gib=CPU_64_BLOCKS,
        async_scheduling=scheduling,
    )  # fmt: skip
    assert got == want
    assert tier.prefix_cache_cpu_hits > 0
    assert tier.prefix_cache_hits > base.prefix_cache_hits
    assert tier.num_used_blocks == 0 and tier.num_swap_preemptions == 0
    # Off by default: no CPU pool at all.
    assert base.num_cpu_blocks == 0 and base.prefix_cache_cpu_hits == 0


def test_cpu_tier_lru_and_holds():
    """Block-level: an evicted cached block is offloaded (a swap-out), a later lookup loads it
    back (a swap-in into a new device block, registered again), and the tier evicts its least
    recently used entry when full."""
    bm = BlockManager(4, 4, num_cpu_blocks=3, cpu_offload=True)  # 3 device, 2 CPU blocks

    def admit(tokens: list[int]) -> Request:
        req = Request(str(tokens[0]), tokens, SamplingParams(max_tokens=1))
        seq = req.seqs[0]
        bm.get_computed_blocks(seq)
        assert bm.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens)
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_full_blocks(seq)
        return req

    a = admit([10, 11, 12, 13, 99])  # one full block + a partial one
    bm.free(a.seqs[0])
    bm.take_swaps()
    b = admit([20, 21, 22, 23, 24, 25, 26, 27, 98])  # needs all 3 blocks: evicts a's full block
    offloaded, into = bm.take_swaps()
    assert len(offloaded) == 1 and not into
    bm.free(b.seqs[0])
    c = admit([10, 11, 12, 13, 97])  # a's prefix: a tier hit
    out, into = bm.take_swaps()
    assert len(into) == 1 and into[0][0] == offloaded[0][1]  # back from where it went
    assert len(out) == 1  # c's partial block evicted one of b's: offloaded in turn
    assert c.seqs[0].num_cached_tokens == 4
    assert bm.prefix_cache_cpu_hits == 4
    bm.free(c.seqs[0])
    assert bm.num_free_blocks == 3 and bm.cpu.num_free_blocks == 2
    # The tier is full: b's second block (offloaded first) and a's (used since, so more
    # recent). One more offload evicts the least recently used entry: b's.
    tier = bm.cpu.pool
    assert tier.lookup(*bm._block_key(b.seqs[0], 1)) is not None
    d = admit([30, 31, 32, 33, 34, 35, 36, 37, 96])
    out, _ = bm.take_swaps()
    assert len(out) == 1
    assert tier.lookup(*bm._block_key(b.seqs[0], 1)) is None
    assert tier.lookup(*bm._block_key(a.seqs[0], 0)) is not None
    bm.free(d.seqs[0])


def test_swap_under_tensor_parallelism(model_dir):
    """Each rank holds its KV shard and its shard of the CPU pool: every rank runs the step's
    swaps (they travel in the SchedulerOutput), so TP=2 gives the single-process outputs."""
    prompts, params = _prompts(6), _params()
    want, _ = _run(model_dir, prompts, params, enable_prefix_caching=False)
    got, stats = _run(
        model_dir, prompts, params,
        num_gpu_blocks_override=14, preemption_mode="swap", swap_space=CPU_64_BLOCKS,
        cpu_offload_gib=CPU_64_BLOCKS, tensor_parallel_size=2,
    )  # fmt: skip
    _assert_same(got, want)
    assert stats.num_swap_preemptions > 0
    _assert_all_free(stats)
