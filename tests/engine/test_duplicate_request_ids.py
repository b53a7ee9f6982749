"""LLMEngine's duplicate request ids (vLLM's InputProcessor.assign_request_id): a duplicate is
served under an internal id, its outputs carry the caller's id, one duplicate aborts alone by
its internal id and the caller's id aborts all of them."""

from __future__ import annotations

import pytest

from paged_engine import EngineConfig, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_factory) -> LLMEngine:
    path = tiny_model_factory("llama")
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", max_model_len=64))


def _params(n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=n)


def _idle(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.get_stats()
    assert stats.num_used_blocks == 0 and stats.num_running == 0 and stats.num_waiting == 0


def test_aborting_one_duplicate_leaves_the_others(engine) -> None:
    first = engine.add_request("r", [5, 6, 7], _params())
    dup = engine.add_request("r", [5, 6, 7], _params(n=2))
    assert first == "r" and dup != "r" and dup.startswith("r-")
    engine.step()
    engine.abort_request(dup)  # the duplicate alone, by its engine id
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["r"]
    assert len(finished[0].outputs[0].token_ids) == 6
    _idle(engine)


def test_the_callers_id_aborts_every_duplicate(engine) -> None:
    engine.add_request("q", [5, 6, 7], _params())
    engine.add_request("q", [8, 9], _params(n=2))
    engine.add_request("q", [8, 9], _params())
    outs = engine.step()
    assert outs and {o.request_id for o in outs} == {"q"}  # outputs carry the caller's id
    engine.abort_request("q")
    assert not engine.has_unfinished_requests()
    _idle(engine)


def test_an_abort_naming_a_request_and_its_duplicate_frees_each_once(engine) -> None:
    engine.add_request("d", [5, 6, 7], _params())
    dup = engine.add_request("d", [5, 6, 7, 8], _params(n=2))
    engine.step()
    engine.abort_request(["d", dup])  # the duplicate named twice: by itself and by "d"
    assert not engine.has_unfinished_requests()
    _idle(engine)
    engine.add_request("d", [5, 6], _params())  # the id is free again: served as itself
    assert engine.add_request("d", [5, 6], _params()) != "d"
    _idle(engine)
