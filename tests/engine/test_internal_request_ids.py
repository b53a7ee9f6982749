"""engine/request_ids.py: internal ids of requests whose callers' ids repeat, and the rules the
front ends' stream maps (AsyncLLM, paged-server's EngineClient) share: a caller's id names every
request in flight added under it (`internal_ids`), an internal id exactly one (`pop_each`);
unknown, finished or repeated ids name nothing more; the module imports without torch."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from paged_engine.engine.request_ids import internal_ids, internal_request_id, pop_each


@dataclass(eq=False)
class _S:
    request_id: str  # the caller's id
    group: int = 0


def _streams(*pairs: tuple[str, str, int]) -> dict[str, _S]:
    return {internal: _S(external, group) for internal, external, group in pairs}


def test_internal_ids_extend_the_callers_id_with_8_random_hex_digits() -> None:
    ids = {internal_request_id("cmpl-x-0") for _ in range(200)}
    assert len(ids) == 200
    assert all(re.fullmatch(r"cmpl-x-0-[0-9a-f]{8}", i) for i in ids)
    assert internal_request_id("r").startswith("r-")


def test_a_callers_id_names_every_request_added_under_it_in_order() -> None:
    m = _streams(("r-2", "r", 0), ("q-1", "q", 0), ("r-1", "r", 1), ("rr-1", "rr", 0))
    assert internal_ids(m, "r") == ["r-2", "r-1"]  # duplicates in flight: all, as added
    assert internal_ids(m, ["q", "r"]) == ["r-2", "q-1", "r-1"]
    assert internal_ids(m, iter(["rr"])) == ["rr-1"]  # any iterable
    # a str is one id, not its characters; a prefix names nothing
    assert internal_ids(m, "rq") == [] and internal_ids(m, "") == []


def test_unknown_finished_and_internal_ids_name_no_callers_request() -> None:
    m = _streams(("r-1", "r", 0), ("r-2", "r", 0))
    assert internal_ids(m, ["nope"]) == []
    assert internal_ids(m, "r-1") == []  # an internal id is not a caller's id
    del m["r-1"]  # finished: its outputs are done
    assert internal_ids(m, "r") == ["r-2"]
    pop_each(m, ["r-2"])
    assert internal_ids(m, "r") == [] and not m


def test_where_keeps_one_groups_requests_of_a_shared_id() -> None:
    # two clients sending one X-Request-Id: an abort of one group's leaves the other's
    m = _streams(("x-a", "x", 1), ("x-b", "x", 2), ("x-c", "x", 1), ("y-a", "y", 1))
    assert internal_ids(m, "x", lambda s: s.group == 1) == ["x-a", "x-c"]
    assert internal_ids(m, "x", lambda s: s.group == 3) == []
    assert internal_ids(m, ["x", "y"], None) == ["x-a", "x-b", "x-c", "y-a"]


def test_pop_each_removes_each_request_once_in_the_order_named() -> None:
    m = _streams(("a-1", "a", 0), ("b-1", "b", 0), ("c-1", "c", 0))
    b, a = m["b-1"], m["a-1"]
    # a failure may name a request twice, or one already aborted or finished
    taken = pop_each(m, ["b-1", "zz", "a-1", "b-1", "a-1"])
    assert taken == [("b-1", b), ("a-1", a)]
    assert list(m) == ["c-1"]
    assert m.get("b-1") is None  # an output still queued for it finds no stream
    assert pop_each(m, ["a-1", "b-1"]) == []  # a second abort or failure: nothing left


def test_pop_each_everything_in_flight() -> None:
    m = _streams(("a-1", "a", 0), ("a-2", "a", 0))
    assert [rid for rid, _ in pop_each(m, list(m))] == ["a-1", "a-2"] and not m


def test_the_module_imports_without_torch() -> None:
    # paged-server imports it before anything loads torch (it binds its port first)
    code = (
        "import sys, paged_engine.engine.request_ids; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture(scope="module")
def async_engine(tiny_llama_dir):
    from paged_engine import AsyncLLM

    opts = {"dtype": "float32", "max_model_len": 128, "num_gpu_blocks_override": 64}
    eng = AsyncLLM(str(tiny_llama_dir), **opts)
    yield eng
    eng.shutdown()


def test_async_llm_abort_naming_an_internal_id_twice_aborts_it_once(async_engine) -> None:
    """vLLM's abort(internal=True) with a repeated engine id: one abort, no KeyError (the
    old code popped the stream twice), and the duplicate of the same caller's id goes on."""
    from paged_engine import SamplingParams

    eng = async_engine
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)

    async def main():
        seen: dict[int, list] = {0: [], 1: []}

        async def consume(i: int) -> None:
            async for out in eng.generate([5, 6, 7 + i], params, "twin"):
                seen[i].append(out)

        tasks = [asyncio.create_task(consume(i)) for i in (0, 1)]
        while not (seen[0] and seen[1]):
            assert not any(t.done() for t in tasks)
            await asyncio.sleep(0.005)
        ids = await eng._call(lambda e: list(eng._streams))
        assert len(ids) == 2 and all(i.startswith("twin-") for i in ids)
        await eng.abort([ids[0], ids[0]], internal=True)
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert sum(isinstance(d, asyncio.CancelledError) for d in done) == 1
        assert await eng._call(lambda e: not e.has_unfinished_requests())
        return seen

    seen = asyncio.run(main())
    finished = [s[-1] for s in seen.values() if s[-1].finished]
    assert len(finished) == 1 and finished[0].request_id == "twin"
    assert len(finished[0].outputs[0].token_ids) == 30


def test_duplicates_of_while_another_thread_finishes_requests() -> None:
    """LLMEngine.abort_request scans the output stage's states on the engine thread while
    paged-server's output thread removes finished ones: the scan must never see the dict change
    size (the old generator over states.values() raised RuntimeError at times, and the abort was
    lost: the requests ran on, holding their KV blocks)."""
    import threading
    from types import SimpleNamespace

    from paged_engine.engine.output_processor import OutputProcessor

    states = {f"r{i}": SimpleNamespace(request_id=f"r{i}", external_req_id="x") for i in range(64)}
    proc = SimpleNamespace(states=states)
    stop = threading.Event()

    def churn() -> None:  # the output thread: requests finish, new ones arrive
        i = 64
        while not stop.is_set():
            states.pop(next(iter(states)), None)
            states[f"r{i}"] = SimpleNamespace(request_id=f"r{i}", external_req_id="x")
            i += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        for _ in range(5000):
            assert len(OutputProcessor.duplicates_of(proc, ["x"])) in (63, 64)  # mid-churn
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(old)
