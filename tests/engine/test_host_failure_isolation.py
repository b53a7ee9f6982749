"""Host-side failures go through the step isolation too (core/step_isolation.py):
`scheduler.schedule()` raising while it plans a step (here: whenever it allocates blocks for
one poisoned request) and applying a step's results raising part way. Planning: every request
it may have touched recomputes as a suspect, each planned alone, and only the one that fails
alone is aborted; the rest produce a clean run's tokens. Applying: that step's requests fail
(what they emitted is unknown), the others go on. Nothing is left behind either way."""

from __future__ import annotations

import pytest
from engine_state import leftovers

from paged_engine import LLM, SamplingParams, TokensPrompt
from paged_engine.core.step_isolation import RequestFailedError

OPTS = {"dtype": "float32", "max_model_len": 128, "num_gpu_blocks_override": 64}
GOOD = [[11, 12, 13, 14, 15], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36]]
BAD = [50, 51, 52, 53]
GREEDY = SamplingParams(max_tokens=6, temperature=0)


def _tokens(out) -> list[list[int]]:
    return [list(c.token_ids) for c in out.outputs]


@pytest.fixture(scope="module")
def clean(tiny_llama_dir) -> list[list[list[int]]]:
    llm = LLM(str(tiny_llama_dir), **OPTS)
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in GOOD], GREEDY)
        return [_tokens(o) for o in outs]
    finally:
        llm.llm_engine.shutdown()


def _run(engine, prompts: dict[str, list[int]]) -> tuple[dict[str, list], list[str]]:
    """Step until done; (finished outputs by id, ids that failed with RequestFailedError)."""
    for rid, prompt in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, GREEDY, final_only=True)
    done, failed = {}, []
    for _ in range(500):
        if not (engine.has_unfinished_requests() or engine.can_step()):
            break
        try:
            outs = engine.step()
        except RequestFailedError as e:
            failed += e.request_ids
            continue
        done.update({o.request_id: _tokens(o) for o in outs if o.finished})
    return done, failed


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_that_breaks_planning_fails_alone(tiny_llama_dir, clean, async_scheduling):
    llm = LLM(str(tiny_llama_dir), async_scheduling=async_scheduling, **OPTS)
    engine = llm.llm_engine
    try:
        bm = engine.block_manager
        allocate, calls = bm.allocate_slots, []

        def poisoned(seq, n):  # raises mid-plan, after the good requests got their blocks
            if seq.request.request_id == "bad":
                calls.append(len(engine.scheduler.running))
                raise KeyError("a planner bug this request trips")
            return allocate(seq, n)

        bm.allocate_slots = poisoned
        prompts = {f"g{i}": p for i, p in enumerate(GOOD)} | {"bad": BAD}
        done, failed = _run(engine, prompts)
        assert failed == ["bad"]
        assert [done[f"g{i}"] for i in range(len(GOOD))] == clean
        # the first failure had company (the others recomputed), the second planned it alone
        assert len(calls) == 2 and calls[0] > 0
        done, failed = _run(engine, {"after": GOOD[0]})  # serving on
        assert done["after"] == clean[0] and not failed
        assert leftovers(engine) == {}
    finally:
        engine.shutdown()


def test_a_step_whose_results_fail_to_apply_fails_its_requests_only(tiny_llama_dir, clean):
    llm = LLM(str(tiny_llama_dir), max_num_seqs=1, **OPTS)  # one request a step
    engine = llm.llm_engine
    try:
        core = engine.engine_core
        apply, steps = core._apply, []

        def broken(sched, out):  # the second request's third step
            live = core.scheduler.seqs
            if any(live[s].request.request_id == "g1" for s in sched.seq_ids if s in live):
                steps.append(sched.step_id)
                if len(steps) == 3:
                    raise RuntimeError("a bug while applying results")
            return apply(sched, out)

        core._apply = broken
        done, failed = _run(engine, {f"g{i}": p for i, p in enumerate(GOOD)})
        assert failed == ["g1"]
        assert done["g0"] == clean[0] and done["g2"] == clean[2] and "g1" not in done
        assert leftovers(engine) == {}
    finally:
        engine.shutdown()


def test_results_that_fail_to_apply_while_pausing_fail_their_requests(tiny_llama_dir, clean):
    llm = LLM(str(tiny_llama_dir), async_scheduling=True, **OPTS)
    engine = llm.llm_engine
    try:
        core = engine.engine_core
        for i, p in enumerate(GOOD):
            engine.add_request(f"g{i}", {"prompt_token_ids": p}, GREEDY, final_only=True)
        engine.step()  # async: a step in flight, applied by the pause's drain
        assert core._in_flight
        apply = core._apply

        def broken(sched, out):
            core._apply = apply  # once
            raise RuntimeError("a bug while applying results")

        core._apply = broken
        with pytest.raises(RequestFailedError) as err:
            engine.pause_generation(mode="keep")
        assert sorted(err.value.request_ids) == ["g0", "g1", "g2"]
        engine.resume_generation()
        done, failed = _run(engine, {"after": GOOD[1]})
        assert done["after"] == clean[1] and not failed
        assert leftovers(engine) == {}
    finally:
        engine.shutdown()


def test_a_wait_pause_fails_a_request_that_can_never_fit_and_completes(tiny_llama_dir, clean):
    # 7 blocks of 16 tokens: the n = 3 request's sequences outgrow the pool (its stuck error)
    llm = LLM(str(tiny_llama_dir), **{**OPTS, "num_gpu_blocks_override": 7, "max_model_len": 96})
    engine = llm.llm_engine
    try:
        wide = SamplingParams(max_tokens=50, temperature=0.8, seed=1, n=3, ignore_eos=True)
        engine.add_request("wide", {"prompt_token_ids": list(range(40, 80))}, wide)
        engine.add_request("g0", {"prompt_token_ids": GOOD[0]}, GREEDY, final_only=True)
        with pytest.raises(RequestFailedError) as err:
            engine.pause_generation(mode="wait")
        assert err.value.request_ids == ["wide"]
        assert engine.is_paused()
        engine.resume_generation()
        done, failed = _run(engine, {})
        assert done["g0"] == clean[0] and not failed  # held by the pause, returned after
        assert leftovers(engine) == {}
    finally:
        engine.shutdown()
