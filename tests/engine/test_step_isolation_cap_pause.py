"""Step isolation beyond one culprit (core/step_isolation.py): a failure no request is to blame
for that recurs in big batches caps the batch instead of cycling, and a step that fails while
a pause drains the steps in flight goes through the same isolation.

A model hook raises "out of memory" whenever a step holds `WIDE` or more sequences (every
request succeeds alone): the batch is capped (halved per recurrence, down to what runs), every
request finishes with the tokens of a clean run, after a bounded number of failed steps; a
one-off failure caps nothing; a cap that has held its steps lifts. A poisoned prompt whose step
is in flight when the engine pauses (async scheduling) is isolated, not raised out of the
pause: the others finish with clean-run tokens and only the poisoned request fails, alone. A
"wait" pause that runs the poisoned request finishes the others, pauses, then names it
(`RequestFailedError`); through AsyncLLM its generator raises the cause and the pause returns."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from paged_engine import LLM, AsyncLLM, LLMEngine, SamplingParams, TokensPrompt
from paged_engine.core.step_isolation import RequestFailedError

OPTS = {
    "dtype": "float32",
    "max_model_len": 128,
    "num_gpu_blocks_override": 64,
    "max_num_batched_tokens": 32,
    "max_num_seqs": 8,
}
PROMPTS = [[11, 12, 13, 14, 15], [20, 21, 22], [30, 31, 32, 33], [40, 41], [50, 51, 52], [60]]
GREEDY = SamplingParams(max_tokens=6, temperature=0)
SEEDED = SamplingParams(max_tokens=6, temperature=0.8, seed=5, n=2)
PARAMS = [SEEDED if i == 1 else GREEDY for i in range(len(PROMPTS))]  # 7 sequences in all
WIDE = 3  # a step of this many sequences or more "runs out of memory"
POISON = 3


def _tokens(outs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def _prompts(prompts: list[list[int]]) -> list[TokensPrompt]:
    return [TokensPrompt(prompt_token_ids=p) for p in prompts]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), **OPTS)
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def clean(llm) -> list[list[list[int]]]:
    return _tokens(llm.generate(_prompts(PROMPTS), PARAMS, use_tqdm=False))


def _hook(runner, fails) -> list[int]:
    """Make the runner's forward raise while `fails(width)`; returns the failed steps' widths."""
    failed: list[int] = []
    forward = runner.forward

    def hooked(inputs):
        width = len(inputs.seq_lens)
        if fails(width):
            failed.append(width)
            raise RuntimeError(f"out of memory ({width} sequences)")
        return forward(inputs)

    runner.forward = hooked
    return failed


@pytest.fixture
def engine(llm):
    """The module's engine with its runner's forward and batch cap restored afterwards."""
    engine = llm.llm_engine
    runner, scheduler = engine.model_runner, engine.engine_core.scheduler
    yield engine
    runner.__dict__.pop("forward", None)
    scheduler.max_num_seqs = scheduler.batch_cap.configured
    scheduler.batch_cap.lift_at, scheduler.batch_cap.cleared_at = 2**62, None


def test_a_recurring_blameless_failure_caps_the_batch(llm, engine, clean, caplog) -> None:
    failed = _hook(engine.model_runner, lambda width: width >= WIDE)
    scheduler = engine.engine_core.scheduler
    with caplog.at_level(logging.WARNING, logger="paged_engine.core.step_isolation"):
        outs = llm.generate(_prompts(PROMPTS), PARAMS, use_tqdm=False)
    assert _tokens(outs) == clean  # nothing lost, nothing changed
    # the full batch (6: prefill; 7: decode, forked), again (recurs: capped at 3), at the cap
    # (capped at 1): no more
    assert failed == [6, 7, 3] and scheduler.max_num_seqs == 1
    caps = [r.getMessage() for r in caplog.records if "capping steps" in r.getMessage()]
    assert len(caps) == 2 and "max_num_seqs=8" in caps[0]
    assert not scheduler.suspects and not scheduler.requests
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks

    # The cap holds its steps, then lifts the first time it keeps a request out.
    engine.model_runner.__dict__.pop("forward")
    assert _tokens(llm.generate(_prompts(PROMPTS), PARAMS, use_tqdm=False)) == clean
    assert scheduler.max_num_seqs < WIDE  # (held: far fewer steps than CAP_HOLD_STEPS)
    scheduler.batch_cap.lift_at = scheduler._next_step_id
    with caplog.at_level(logging.WARNING, logger="paged_engine.core.step_isolation"):
        assert _tokens(llm.generate(_prompts(PROMPTS), PARAMS, use_tqdm=False)) == clean
    assert scheduler.max_num_seqs == 8 and scheduler.batch_cap.lifts == 1
    assert any("lifting the batch cap" in r.getMessage() for r in caplog.records)


def test_a_one_off_failure_caps_nothing(llm, engine, clean) -> None:
    failed = _hook(engine.model_runner, lambda width: width >= WIDE and not failed)
    outs = llm.generate(_prompts(PROMPTS), PARAMS, use_tqdm=False)
    assert _tokens(outs) == clean
    assert len(failed) == 1 and engine.engine_core.scheduler.max_num_seqs == 8


def _poison(runner) -> list[int]:
    """The runner's forward raises on a step feeding POISON; returns those steps' widths."""
    failed: list[int] = []
    forward = runner.forward

    def poisoned(inputs):
        if bool((inputs.input_ids == POISON).any()):
            failed.append(len(inputs.seq_lens))
            raise ValueError("poisoned token")
        return forward(inputs)

    runner.forward = poisoned
    return failed


def test_a_step_failing_while_a_pause_drains_is_isolated(tiny_llama_dir, clean) -> None:
    engine = LLMEngine(model=str(tiny_llama_dir), async_scheduling=True, **OPTS)
    try:
        failed = _poison(engine.model_runner)
        for i, (p, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
            engine.add_request(f"g{i}", {"prompt_token_ids": p}, params)
        engine.add_request("bad", {"prompt_token_ids": [POISON, 70, 71]}, GREEDY)
        assert engine.step() == []  # the first step is in flight (async scheduling)
        engine.pause_generation(mode="keep")  # drains it: it fails, nothing raises here
        assert len(failed) == 1 and failed[0] > 1
        assert len(engine.engine_core.scheduler.suspects) == len(PROMPTS) + 1
        engine.resume_generation()
        outs, errors = {}, []
        while engine.has_unfinished_requests():
            try:
                outs.update((o.request_id, o) for o in engine.step() if o.finished)
            except RequestFailedError as e:
                errors.append(e)
        assert [e.request_ids for e in errors] == [["bad"]] and failed[1:] == [1]
        assert _tokens(outs[f"g{i}"] for i in range(len(PROMPTS))) == clean
        bm = engine.engine_core.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_total_blocks
    finally:
        engine.shutdown()


def test_a_wait_pause_names_the_culprit_once_paused(llm, engine, clean) -> None:
    failed = _poison(engine.model_runner)
    for i, (p, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        engine.add_request(f"w{i}", {"prompt_token_ids": p}, params)
    engine.add_request("bad", {"prompt_token_ids": [70, POISON]}, GREEDY)
    with pytest.raises(RequestFailedError) as err:
        engine.pause_generation(mode="wait")
    assert err.value.request_ids == ["bad"] and failed[-1] == 1
    assert engine.is_paused() and not engine.has_unfinished_requests()
    outs = {o.request_id: o for o in engine.step() if o.finished}  # what the pause held
    assert _tokens(outs[f"w{i}"] for i in range(len(PROMPTS))) == clean
    engine.resume_generation()


def test_async_llm_wait_pause_fails_the_culprits_stream(tiny_llama_dir, clean) -> None:
    eng = AsyncLLM(str(tiny_llama_dir), **OPTS)
    try:
        failed = _poison(eng.engine.model_runner)

        async def main():
            gate = threading.Event()  # holds the engine thread: the adds and the pause queue up
            held = asyncio.ensure_future(eng._call(lambda e: gate.wait(10)))
            gens = [
                eng.generate(_prompts([p])[0], s, f"g{i}")
                for i, (p, s) in enumerate(zip(PROMPTS, PARAMS, strict=True))
            ]
            gens.append(eng.generate(_prompts([[70, POISON]])[0], GREEDY, "bad"))
            tasks = [asyncio.ensure_future(_last(g)) for g in gens]
            await asyncio.sleep(0.05)  # each task queued its add
            pause = asyncio.ensure_future(eng.pause_generation(mode="wait"))
            await asyncio.sleep(0.05)
            gate.set()
            await asyncio.wait_for(pause, 30)
            await held
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)

        *good, bad = asyncio.run(main())
        assert isinstance(bad, ValueError) and failed[-1] == 1
        assert _tokens(good) == clean
    finally:
        eng.shutdown()


async def _last(agen):
    last = None
    async for out in agen:
        last = out
    return last
