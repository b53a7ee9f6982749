"""`AsyncLLM` (vLLM's asyncio engine client): the same tokens as `LLM` for concurrent requests,
every output kind, aborts (early exits, `abort()`, a pause), errors raised to their caller
while the engine serves on, the calls RL loops make, and `from_engine_args`."""

from __future__ import annotations

import asyncio
import logging
import re
import threading

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


async def _all(agen) -> list:
    return [out async for out in agen]


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
        greedy = SamplingParams(max_tokens=12, temperature=0)
        return await _last(engine.generate(PROMPTS[0], greedy, "after"))

    assert list(asyncio.run(main()).outputs[0].token_ids) == want[0][0]


def test_duplicate_request_ids_are_each_served(engine, want) -> None:
    """As vLLM's AsyncLLM: requests sharing an id in flight each get their own outputs, all
    saying the caller's id (each engine request has an internal id of its own)."""

    async def main():
        greedy = SamplingParams(max_tokens=12, temperature=0)
        gens = [engine.generate(PROMPTS[i], greedy, "dup") for i in (0, 1)]
        outs = await asyncio.gather(*(_all(g) for g in gens))
        embed = PoolingParams(task="embed")
        pooled = await asyncio.gather(*(_all(engine.encode(p, embed, "pdup")) for p in PROMPTS[:2]))
        alone = [await _last(engine.encode(p, embed, f"one{i}")) for i, p in enumerate(PROMPTS[:2])]
        return outs, pooled, alone

    outs, pooled, alone = asyncio.run(main())
    for i, seq in enumerate(outs):
        assert {o.request_id for o in seq} == {"dup"} and seq[-1].finished
        assert list(seq[-1].outputs[0].token_ids) == want[i][0]
    for seq, ref in zip(pooled, alone, strict=True):
        assert [o.request_id for o in seq] == ["pdup"]
        assert seq[0].outputs.data.tolist() == pytest.approx(ref.outputs.data.tolist(), abs=1e-5)


def test_cancelling_one_duplicate_leaves_the_other_running(engine) -> None:
    async def main():
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        seen: dict[int, list] = {0: [], 1: []}

        async def consume(i):
            async for out in engine.generate(PROMPTS[i], params, "twin"):
                seen[i].append(out)

        tasks = [asyncio.create_task(consume(i)) for i in (0, 1)]
        while not (seen[0] and seen[1]):
            assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
            await asyncio.sleep(0.005)
        tasks[1].cancel()  # its own request only: the other shares its id and goes on
        with pytest.raises(asyncio.CancelledError):
            await tasks[1]
        await tasks[0]
        assert not await _unfinished(engine)
        return seen

    seen = asyncio.run(main())
    last = seen[0][-1]
    assert last.request_id == "twin" and last.finished
    assert len(last.outputs[0].token_ids) == 40 and last.outputs[0].finish_reason == "length"
    assert not seen[1][-1].finished


def test_abort_by_a_duplicate_id_ends_all_of_its_requests(engine, want) -> None:
    async def main():
        params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        seen: dict[int, list] = {0: [], 1: []}

        async def consume(i):
            async for out in engine.generate(PROMPTS[i], params, "both"):
                seen[i].append(out)

        tasks = [asyncio.create_task(consume(i)) for i in (0, 1)]
        greedy = SamplingParams(max_tokens=12, temperature=0)
        other = asyncio.create_task(_last(engine.generate(PROMPTS[2], greedy, "bystander")))
        while not (seen[0] and seen[1]):
            assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
            await asyncio.sleep(0.005)
        await engine.abort("both")
        for task in tasks:
            with pytest.raises(asyncio.CancelledError):
                await task
        bystander = await other
        assert not await _unfinished(engine)
        return seen, bystander

    seen, bystander = asyncio.run(main())
    assert not seen[0][-1].finished and not seen[1][-1].finished
    assert list(bystander.outputs[0].token_ids) == want[2][0]


def test_a_caller_cancelled_during_its_add_aborts_it(engine, monkeypatch) -> None:
    inner = engine.engine
    real = inner.add_request
    entered, release = threading.Event(), threading.Event()

    def slow_add(*args, **kwargs):  # the engine thread, inside the add
        entered.set()
        release.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(inner, "add_request", slow_add)

    async def main():
        params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        task = asyncio.create_task(_last(engine.generate(PROMPTS[0], params, "early")))
        while not entered.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        return await _unfinished(engine)  # its abort ran before this call: no step between

    assert asyncio.run(main()) is False


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
        # vLLM logs the request's internal id
        assert re.search(r"Added request logged-[0-9a-f]{8}\.", caplog.text)
    finally:
        eng.shutdown()
    assert not eng.is_running

    async def after_shutdown():
        with pytest.raises(Exception, match="shut down"):
            await _last(eng.generate("hi", SamplingParams(max_tokens=2), "late"))

    asyncio.run(after_shutdown())
