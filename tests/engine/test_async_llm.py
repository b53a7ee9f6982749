"""`AsyncLLM` (vLLM's asyncio engine client): the same tokens as `LLM` for concurrent requests,
every output kind, aborts (early exits, `abort()`, a pause), errors raised to their caller
while the engine serves on, the calls RL loops make, and `from_engine_args`."""

from __future__ import annotations

import asyncio
import logging

import pytest

from paged_engine import (
    LLM,
    AsyncEngineArgs,
    AsyncLLM,
    AsyncLLMEngine,
    EngineArgs,
    LLMEngine,
    PoolingParams,
    RequestOutputKind,
    SamplingParams,
    TokensPrompt,
)

OPTS = {"dtype": "float32", "max_model_len": 128, "num_gpu_blocks_override": 64}
PROMPTS = ["Hello, my name is", "The capital of France is", "1 2 3 4", "Once upon a time"]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    eng = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(tiny_llama_dir), **OPTS))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def want(tiny_llama_dir) -> list[tuple[list[int], str]]:
    llm = LLM(str(tiny_llama_dir), **OPTS)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0))
        return [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]
    finally:
        llm.llm_engine.shutdown()


async def _last(agen):
    last = None
    async for out in agen:
        last = out
    return last


async def _unfinished(eng: AsyncLLM) -> bool:
    return await eng._call(lambda e: e.has_unfinished_requests())


def test_concurrent_requests_equal_llm(engine, want) -> None:
    async def main():
        greedy = SamplingParams(max_tokens=12, temperature=0)
        gens = [engine.generate(p, greedy, f"c{i}") for i, p in enumerate(PROMPTS)]
        return await asyncio.gather(*(_last(g) for g in gens))

    outs = asyncio.run(main())
    got = [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]
    assert got == want
    assert all(o.finished and o.request_id == f"c{i}" for i, o in enumerate(outs))


def test_output_kinds(engine, want) -> None:
    async def collect(kind):
        params = SamplingParams(max_tokens=12, temperature=0, output_kind=kind)
        return [o async for o in engine.generate(PROMPTS[1], params, f"k{kind.name}")]

    async def main():
        return [await collect(k) for k in RequestOutputKind]

    cumulative, delta, final = asyncio.run(main())
    ids, text = want[1]
    assert list(cumulative[-1].outputs[0].token_ids) == ids
    lengths = [len(o.outputs[0].token_ids) for o in cumulative]
    assert lengths == sorted(lengths) and lengths[-1] == 12  # growing, whole each time
    assert [t for o in delta for t in o.outputs[0].token_ids] == ids
    assert "".join(o.outputs[0].text for o in delta) == text
    assert len(final) == 1 and final[0].outputs[0].text == text


def test_token_prompts_and_n(engine) -> None:
    async def main():
        params = SamplingParams(max_tokens=5, n=2, temperature=1.0, seed=3)
        return await _last(engine.generate(TokensPrompt(prompt_token_ids=[1, 5, 9]), params, "n2"))

    out = asyncio.run(main())
    assert out.prompt_token_ids == [1, 5, 9] and len(out.outputs) == 2


def test_leaving_early_aborts_the_request(engine) -> None:
    async def main():
        params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        async for out in engine.generate(PROMPTS[0], params, "early"):
            if len(out.outputs[0].token_ids) >= 2:
                break
        await asyncio.sleep(0)  # the generator's cleanup ran at the break
        for _ in range(100):
            if not await _unfinished(engine):
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())


def test_abort_from_another_task_and_cancellation(engine) -> None:
    async def main():
        params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        seen = []

        async def consume(rid):
            async for out in engine.generate(PROMPTS[2], params, rid):
                seen.append(out)

        task = asyncio.create_task(consume("victim"))
        while not seen:
            await asyncio.sleep(0.005)
        await engine.abort("victim")
        with pytest.raises(asyncio.CancelledError):
            await task
        task = asyncio.create_task(consume("cancelled"))
        await asyncio.sleep(0.05)
        task.cancel()  # the caller's own cancellation aborts its request
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if not await _unfinished(engine):
                break
            await asyncio.sleep(0.01)
        assert not await _unfinished(engine)
        await engine.abort(["nobody", "victim"])  # unknown or gone: nothing happens

    asyncio.run(main())


def test_bad_requests_raise_to_their_caller_and_the_engine_serves_on(engine, want) -> None:
    async def main():
        with pytest.raises(ValueError, match="prompt"):  # longer than max_model_len
            await _last(engine.generate(list(range(1, 200)), SamplingParams(), "too-long"))
        with pytest.raises(ValueError, match="sampling_params"):
            await _last(engine.generate("x", {"max_tokens": 2}, "not-params"))
        with pytest.raises(ValueError, match="request_id"):
            await _last(engine.generate("x", SamplingParams(), ""))
        slow = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
        first = engine.generate("x", slow, "dup")
        await first.__anext__()
        with pytest.raises(ValueError, match="already in flight"):
            await _last(engine.generate("y", slow, "dup"))
        await first.aclose()
        greedy = SamplingParams(max_tokens=12, temperature=0)
        return await _last(engine.generate(PROMPTS[0], greedy, "after"))

    assert list(asyncio.run(main()).outputs[0].token_ids) == want[0][0]


def test_a_failed_step_fails_the_requests_in_flight_only(engine, want, monkeypatch) -> None:
    inner = engine.engine
    real = inner.step
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real()

    monkeypatch.setattr(inner, "step", flaky)

    async def main():
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        with pytest.raises(RuntimeError, match="boom"):
            await _last(engine.generate(PROMPTS[3], params, "hit"))
        greedy = SamplingParams(max_tokens=12, temperature=0)
        return await _last(engine.generate(PROMPTS[1], greedy, "next"))

    assert asyncio.run(main()).outputs[0].text == want[1][1]
    assert not engine.errored and engine.is_running


def test_the_calls_rl_loops_make(engine, want) -> None:
    async def main():
        assert await engine.is_paused() is False
        params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        gen = engine.generate(PROMPTS[0], params, "paused")
        await gen.__anext__()
        await engine.pause_generation(mode="abort")  # finishes it: finish_reason "abort"
        last = await _last(gen)
        assert last.finished and last.outputs[0].finish_reason == "abort"
        assert await engine.is_paused() is True
        await engine.resume_generation()
        assert await engine.collective_rpc(lambda worker: type(worker).__name__) == ["Worker"]
        assert await engine.reset_prefix_cache() is True
        assert await engine.list_loras() == set()
        tok = await engine.get_tokenizer()
        assert tok.decode(tok.encode("hello", add_special_tokens=False)) == "hello"
        assert (await engine.get_model_config()).max_model_len == 128
        await engine.check_health()
        greedy = SamplingParams(max_tokens=12, temperature=0)
        return await _last(engine.generate(PROMPTS[2], greedy, "resumed"))

    assert list(asyncio.run(main()).outputs[0].token_ids) == want[2][0]


def test_encode_pools(engine) -> None:
    async def main():
        return await _last(engine.encode("Hello", PoolingParams(task="embed"), "pool"))

    out = asyncio.run(main())
    assert out.finished and len(out.outputs.data) == 64  # the tiny model's hidden size


def test_engine_args_and_construction_errors(tiny_llama_dir, caplog) -> None:
    args = EngineArgs(model=str(tiny_llama_dir), **OPTS)
    assert args.create_engine_config().max_model_len == 128
    engine = LLMEngine.from_engine_args(args)
    engine.shutdown()
    assert AsyncLLMEngine is AsyncLLM
    with pytest.raises(ValueError, match="unknown engine option"):
        AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(tiny_llama_dir), bogus_option=1))
    with pytest.raises((OSError, ValueError)):
        AsyncLLM(model=str(tiny_llama_dir / "missing"), **OPTS)
    eng = AsyncLLM.from_engine_args(
        AsyncEngineArgs(model=str(tiny_llama_dir), enable_log_requests=True, **OPTS)
    )
    try:
        with caplog.at_level(logging.INFO, logger="paged_engine.engine.async_llm"):
            asyncio.run(_last(eng.generate("hi", SamplingParams(max_tokens=2), "logged")))
        assert "Added request logged." in caplog.text
    finally:
        eng.shutdown()
    assert not eng.is_running

    async def after_shutdown():
        with pytest.raises(Exception, match="shut down"):
            await _last(eng.generate("hi", SamplingParams(max_tokens=2), "late"))

    asyncio.run(after_shutdown())
