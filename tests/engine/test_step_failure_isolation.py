"""Step-failure isolation (core/step_isolation.py): a step that raises because of one request
fails that request only. A model hook raises whenever a poisoned token id is among a step's
input ids; a batch of good requests (one n = 2, seeded) plus one poisoned prompt (its poison
in its second prefill chunk) runs through AsyncLLM and LLM: the good ones produce exactly the
tokens of a clean run, the poisoned one fails with the hook's error, and the engine serves a
new request afterwards; with async scheduling on and off."""

from __future__ import annotations

import asyncio

import pytest

from paged_engine import LLM, AsyncLLM, SamplingParams, TokensPrompt
from paged_engine.core.step_isolation import RequestFailedError

OPTS = {
    "dtype": "float32",
    "max_model_len": 128,
    "num_gpu_blocks_override": 64,
    "max_num_batched_tokens": 32,  # the poisoned prompt spreads over two chunks
}
POISON = 3
GOOD = [[11, 12, 13, 14, 15], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36], [40, 41]]
BAD = list(range(50, 90)) + [POISON, 91]  # 42 tokens: the poison is in the second chunk
GREEDY = SamplingParams(max_tokens=8, temperature=0)
FORKED = SamplingParams(max_tokens=8, temperature=0.8, seed=3, n=2)


def _params(i: int) -> SamplingParams:
    return FORKED if i == 1 else GREEDY


def _tokens(out) -> list[list[int]]:
    return [list(c.token_ids) for c in out.outputs]


@pytest.fixture(scope="module")
def clean(tiny_llama_dir) -> list[list[list[int]]]:
    llm = LLM(str(tiny_llama_dir), **OPTS)
    try:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in GOOD]
        outs = llm.generate(prompts, [_params(i) for i in range(len(GOOD))])
        got = [_tokens(o) for o in outs]
    finally:
        llm.llm_engine.shutdown()
    assert all(POISON not in t for seqs in got for t in seqs), "pick another poison id"
    return got


def _poison(runner) -> list[int]:
    """Make the runner's forward raise on a step that feeds POISON; returns the number of
    sequences in each step that raised."""
    failures: list[int] = []
    forward = runner.forward

    def hooked(inputs):
        if bool((inputs.input_ids == POISON).any()):
            failures.append(len(inputs.seq_lens))
            raise ValueError(f"poisoned token {POISON} in the step's input")
        return forward(inputs)

    runner.forward = hooked
    return failures


async def _last(agen):
    last = None
    async for out in agen:
        last = out
    return last


async def _idle(eng: AsyncLLM, read):
    """`read(engine)` on the engine thread once it has nothing left to step."""
    for _ in range(1000):
        got = await eng._call(lambda e: None if e.can_step() else (read(e),))
        if got is not None:
            return got[0]
        await asyncio.sleep(0.01)
    raise AssertionError("the engine did not go idle")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_async_llm_fails_only_the_culprit(tiny_llama_dir, clean, async_scheduling) -> None:
    eng = AsyncLLM(str(tiny_llama_dir), async_scheduling=async_scheduling, **OPTS)
    try:
        failures = _poison(eng.engine.model_runner)

        async def main():
            gens = [
                eng.generate(TokensPrompt(prompt_token_ids=p), _params(i), f"g{i}")
                for i, p in enumerate(GOOD)
            ]
            bad = eng.generate(TokensPrompt(prompt_token_ids=BAD), GREEDY, "bad")
            # paused until every request is in: the poisoned step has company however the
            # event loop and the engine thread interleave (a loaded machine stepped "bad" alone)
            await eng.pause_generation(mode="keep")
            tasks = [asyncio.ensure_future(_last(a)) for a in (bad, *gens)]
            for _ in range(1000):
                if await eng._call(lambda e: e.get_num_unfinished_requests()) == len(tasks):
                    break
                await asyncio.sleep(0.01)
            await eng.resume_generation()
            outs = await asyncio.gather(*tasks, return_exceptions=True)
            after = await _last(eng.generate(TokensPrompt(prompt_token_ids=GOOD[0]), GREEDY, "a"))
            return outs, after

        (bad, *good), after = asyncio.run(main())
        assert isinstance(bad, ValueError) and "poisoned token" in str(bad)
        assert [_tokens(o) for o in good] == clean
        assert _tokens(after) == clean[0]
        # the first failure had company (isolation ran), the second the culprit alone
        assert len(failures) == 2 and failures[0] > 1 and failures[1] == 1
        assert eng.engine.engine_core.async_scheduling == async_scheduling
        assert not eng.errored
        # read on the engine thread once idle (its last step, freeing the worker's rows, may
        # still run after the outputs arrived)
        scheduler = asyncio.run(_idle(eng, lambda e: e.engine_core.scheduler))
        assert not scheduler.suspects and not scheduler.step_seqs  # no failed step left behind
        bm = eng.engine.engine_core.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_total_blocks  # nothing leaked
    finally:
        eng.shutdown()


def test_llm_generate_raises_for_the_culprit_and_serves_on(tiny_llama_dir, clean) -> None:
    llm = LLM(str(tiny_llama_dir), **OPTS)
    try:
        failures = _poison(llm.llm_engine.model_runner)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in [*GOOD, BAD]]
        params = [_params(i) for i in range(len(GOOD))] + [GREEDY]
        with pytest.raises(RequestFailedError) as err:
            llm.generate(prompts, params)
        assert isinstance(err.value.cause, ValueError) and len(err.value.request_ids) == 1
        assert len(failures) == 2 and failures[0] > 1 and failures[1] == 1
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in GOOD], params[:-1])
        assert [_tokens(o) for o in outs] == clean
        assert not llm.llm_engine.has_unfinished_requests()
    finally:
        llm.llm_engine.shutdown()


def test_server_answers_the_culprit_with_400_and_serves_the_rest(tiny_llama_dir, clean) -> None:
    from paged_engine import LLMEngine
    from paged_server.engine_client import EngineClient
    from paged_server.errors import APIError

    engine = LLMEngine(model=str(tiny_llama_dir), **OPTS)
    client = EngineClient(engine)
    _poison(engine.model_runner)
    client.start()
    try:
        params = client.make_params({"max_tokens": 8, "temperature": 0}, beam=False, stream=False)
        good = client.add(["g0", "g2"], [{"prompt_token_ids": GOOD[k]} for k in (0, 2)], params)
        bad = client.add(["bad"], [{"prompt_token_ids": BAD}], params)
        with pytest.raises(APIError) as err:
            while not bad.done:
                bad.next(5)
        assert err.value.status == 400 and "poisoned token" in err.value.message
        outs: dict[int, list[int]] = {}
        while not good.done:
            outs.update((i, list(o.outputs[0].token_ids)) for i, o in good.next(5))
        assert [outs[0], outs[1]] == [clean[0][0], clean[2][0]]
        assert client.alive
    finally:
        client.stop()
        engine.shutdown()
