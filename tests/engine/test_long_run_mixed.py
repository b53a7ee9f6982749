"""Regressions from long mixed soaks of the offline engine and AsyncLLM (many waves on one
engine, a tiny KV pool, preemption, aborts and cancellations): each case here is a soak
finding cut down to a few requests."""

from __future__ import annotations

import asyncio
import random

from engine_state import leftovers

from paged_engine import LLM, AsyncLLM, BeamSearchParams, SamplingParams

OPTS = {"dtype": "float32", "max_model_len": 80, "seed": 0}


def test_async_llm_fails_only_the_request_that_outgrew_the_pool(tiny_llama_dir) -> None:
    """A request whose n sequences cannot fit the KV pool even alone is named by the scheduler
    (SchedulerStuckError): only its generator raises (a ValueError); the requests waiting behind
    it are served as a roomy engine serves them (they used to fail with it)."""
    prompts = [[5 + i, 9, 17, 33, 2 + i] for i in range(4)]
    small = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ref = LLM(model=str(tiny_llama_dir), **OPTS)
    try:
        want = [list(o.outputs[0].token_ids) for o in ref.generate(
            [{"prompt_token_ids": p} for p in prompts], small, use_tqdm=False
        )]  # fmt: skip
    finally:
        ref.llm_engine.shutdown()
    # 5 blocks of 16 slots: the big request's 4 sequences of up to 70 tokens need 20
    eng = AsyncLLM(model=str(tiny_llama_dir), num_gpu_blocks_override=6, **OPTS)
    big = SamplingParams(n=4, max_tokens=60, temperature=0.0, ignore_eos=True)

    async def last(prompt: list[int], params: SamplingParams, rid: str):
        outs = [o async for o in eng.generate({"prompt_token_ids": prompt}, params, rid)]
        return outs[-1]

    async def main():
        big_run = asyncio.create_task(last([7, 8, 9, 10, 11, 12, 13, 14, 15, 16], big, "big"))
        await asyncio.sleep(0)  # (added first: the head of the queue)
        smalls = [asyncio.create_task(last(p, small, f"s{i}")) for i, p in enumerate(prompts)]
        return await asyncio.gather(big_run, *smalls, return_exceptions=True)

    try:
        results = asyncio.run(main())
        assert isinstance(results[0], ValueError), results[0]
        assert "max_tokens" in str(results[0])
        got = [r if isinstance(r, BaseException) else list(r.outputs[0].token_ids) for r in
               results[1:]]  # fmt: skip
        assert got == want
        left = asyncio.run(eng._call(lambda e: e.has_unfinished_requests()))
        assert not left
    finally:
        eng.shutdown()


def test_no_drafts_ride_on_a_prompt_chunk_cut_at_a_state_checkpoint(tiny_model_factory) -> None:
    """A hybrid's prompt chunk ends where a state snapshot is due (the prompt's last full
    block): a chunk of one prompt token there is no decode row, so n-gram drafts must not ride
    on it (they ran in place of the next prompt tokens and were kept as computed: every output
    token was wrong). 0-31 runs in one chunk (the budget), 31-32 alone (the checkpoint)."""
    path = str(tiny_model_factory("qwen3_next"))
    head = [37, 155, 39, 65, 153, 144, 60, 26, 63, 182, 181, 135, 182, 109, 85, 152, 81, 145, 175]
    prompt = {"prompt_token_ids": head * 2}  # 38 tokens, repeating: the n-gram finds drafts
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want_llm = LLM(model=path, num_gpu_blocks_override=64, enable_prefix_caching=False, **OPTS)
    try:
        want = want_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        want_llm.llm_engine.shutdown()
    llm = LLM(
        model=path,
        num_gpu_blocks_override=64,
        enable_prefix_caching=True,
        max_num_batched_tokens=31,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        **OPTS,
    )
    try:
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert list(got) == list(want)
    finally:
        llm.llm_engine.shutdown()


def _jobs(rng: random.Random, wave: int) -> list[tuple[str, list[int], object, int | None]]:
    """(request id, prompt, params, the step before which it is aborted or None): prompts
    sharing heads (prefix-cache hits), repeating tails (n-gram drafts), greedy n = 1 and 2, a
    beam search, min_tokens; two of them aborted while they run."""
    head = [rng.randrange(3, 200) for _ in range(36)]
    jobs: list[tuple[str, list[int], object, int | None]] = []
    for i in range(9):
        tail = [rng.randrange(3, 200) for _ in range(rng.randint(2, 12))]
        prompt = (head[: rng.randint(8, 36)] + tail * 2)[:60]
        params: object = SamplingParams(
            max_tokens=rng.randint(4, 16),
            temperature=0.0,
            ignore_eos=True,
            n=1 + i % 2,
            min_tokens=i % 3,
        )
        if i == 4:
            params = BeamSearchParams(beam_width=2, max_tokens=8)
        jobs.append((f"w{wave}-{i}", prompt, params, 3 + i if i in (2, 7) else None))
    return jobs


def _run(llm: LLM, jobs: list, staggered: bool) -> dict[str, list[list[int]]]:
    engine = llm.llm_engine
    outs: dict[str, list[list[int]]] = {}
    pending = list(jobs)
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and (not staggered or len(jobs) - len(pending) <= step):
            rid, prompt, params, _ = pending.pop(0)  # staggered: job i arrives at step i
            engine.add_request(rid, {"prompt_token_ids": prompt}, params, final_only=True)
        if staggered:
            engine.abort_request([rid for rid, *_, at in jobs if at == step])
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = [list(c.token_ids) for c in out.outputs]
        step += 1
    while engine.can_step():  # the finished sequences leave the worker with the next step
        engine.step()
    return outs


def test_hybrid_waves_under_pressure_match_a_roomy_engine_and_leave_nothing(
    tiny_model_factory,
) -> None:
    """Waves on one pressured Qwen3-Next engine (10 KV blocks: preemption by recompute; prefix
    caching with state snapshots; chunked prefill; n-gram drafts; forks and beams; aborts):
    every request that is not aborted matches a roomy engine's, and once idle every KV block,
    recurrent-state seat and draft state is free again."""
    path = str(tiny_model_factory("qwen3_next"))
    roomy = LLM(model=path, num_gpu_blocks_override=200, enable_prefix_caching=False, **OPTS)
    llm = LLM(
        model=path,
        num_gpu_blocks_override=10,
        enable_prefix_caching=True,
        max_num_batched_tokens=24,
        max_num_seqs=6,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        **OPTS,
    )
    engine = llm.llm_engine
    slots, planner = engine.scheduler.state_slots, engine.draft_planner
    free = engine.block_manager.pool.num_free_blocks
    try:
        rng = random.Random(11)
        for wave in range(3):
            jobs = _jobs(rng, wave)
            got = _run(llm, jobs, staggered=True)
            kept = [j for j in jobs if j[3] is None]
            want = _run(roomy, kept, staggered=False)
            assert {rid: got[rid] for rid, *_ in kept} == want
            assert leftovers(engine) == {}
            assert engine.block_manager.pool.num_free_blocks == free
            assert slots.num_free == slots.num_slots and not slots._held
            assert not planner._texts and not planner._backoff
        assert engine.scheduler.num_preemptions > 0, "the KV pool is too large to preempt"
    finally:
        llm.llm_engine.shutdown()
        roomy.llm_engine.shutdown()
