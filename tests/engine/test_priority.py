"""Priority scheduling through the engine (scheduling_policy="priority", vLLM's): requests run
by (priority, arrival), outputs do not change, and a bad priority is a ValueError naming it."""

from __future__ import annotations

import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.engine.llm_engine import check_priority


@pytest.fixture(scope="module")
def priority_llm(tiny_model_factory):
    return LLM(str(tiny_model_factory("llama")), scheduling_policy="priority", max_num_seqs=1)


def test_requests_run_by_priority_with_unchanged_outputs(priority_llm):
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    params = SamplingParams(temperature=0, max_tokens=4)
    plain = priority_llm.generate(prompts, params, use_tqdm=False)
    ranked = priority_llm.generate(prompts, params, use_tqdm=False, priority=[2, 0, 1])
    assert [o.outputs[0].token_ids for o in ranked] == [o.outputs[0].token_ids for o in plain]
    started = [o.metrics.first_scheduled_time for o in ranked]
    assert started[1] < started[2] < started[0]  # one sequence at a time: priority order
    started = [o.metrics.first_scheduled_time for o in plain]
    assert started[0] < started[1] < started[2]  # equal priorities: arrival order


def test_bad_priorities_are_refused(priority_llm):
    engine = priority_llm.llm_engine
    for bad in (True, "1", 1.5, 1 << 63):
        with pytest.raises(ValueError, match="priority"):
            engine.add_request("bad", [5, 6], SamplingParams(max_tokens=1), priority=bad)
    with pytest.raises(ValueError, match="priority must be a list of one int per prompt"):
        priority_llm.generate([[5, 6], [7, 8]], priority=[1], use_tqdm=False)
    with pytest.raises(ValueError, match="priority"):
        priority_llm.generate([[5, 6], [7, 8]], priority=[0, "high"], use_tqdm=False)
    assert not engine.has_unfinished_requests()  # a refused call leaves nothing queued
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        check_priority(3, "fcfs")
    check_priority(0, "fcfs")
