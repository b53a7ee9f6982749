"""Step isolation with worker processes (executor/multiproc.py, worker/worker_loop.py):
tensor_parallel_size=2 on gloo, rank 1 in a process of its own. A model hook installed on every
rank through collective_rpc raises on a step that feeds a poisoned token: every rank fails the
step, they agree on it (`every_rank_failed`), and the engine core isolates it as with one
process: the poisoned request fails alone, the others finish with the tokens of a clean run
(the same engine's, before the hook), and the engine serves on. A failure on rank 0 alone
leaves rank 1 waiting in a collective: the engine dies (EngineDeadError), without hanging.

(tensor_parallel_size=1 with distributed_executor_backend="mp" runs rank 0 in this process,
the same executor as "uni": test_step_failure_isolation.py covers it.)"""

from __future__ import annotations

import pytest

from paged_engine import LLMEngine, SamplingParams
from paged_engine.core.step_isolation import RequestFailedError
from paged_engine.executor.base import EngineDeadError

POISON = 3
GOOD = [[11, 12, 13, 14, 15], [20, 21, 22], [30, 31, 32, 33]]
BAD = [40, 41, POISON, 42]
GREEDY = SamplingParams(max_tokens=6, temperature=0)
SEEDED = SamplingParams(max_tokens=6, temperature=0.8, seed=7, n=2)
PARAMS = [GREEDY, SEEDED, GREEDY]


def install_poison(worker) -> None:
    """(collective_rpc, on every rank) The runner's forward raises on a step feeding POISON."""
    runner = worker.model_runner
    forward = runner.forward

    def hooked(inputs):
        if bool((inputs.input_ids == POISON).any()):
            raise ValueError(f"poisoned token {POISON} in the step's input")
        return forward(inputs)

    runner.forward = hooked


def _run(engine: LLMEngine, prompts, params, tag: str):
    """Step until done: ({request id: token lists}, [request ids of RequestFailedErrors])."""
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"{tag}{i}", {"prompt_token_ids": p}, sp)
    outs, failed = {}, []
    while engine.has_unfinished_requests():
        try:
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = [list(c.token_ids) for c in o.outputs]
        except RequestFailedError as e:
            assert isinstance(e.cause, ValueError) and "poisoned token" in str(e.cause)
            failed += e.request_ids
    return outs, failed


def test_a_step_every_rank_fails_is_isolated_and_a_lone_rank_failure_is_fatal(
    tiny_llama_dir, monkeypatch
) -> None:
    engine = LLMEngine(
        model=str(tiny_llama_dir),
        dtype="float32",
        max_model_len=64,
        num_gpu_blocks_override=32,
        tensor_parallel_size=2,
    )
    try:
        clean, _ = _run(engine, GOOD, PARAMS, "c")
        engine.collective_rpc(install_poison)
        outs, failed = _run(engine, [*GOOD, BAD], [*PARAMS, GREEDY], "p")
        assert failed == ["p3"]
        assert [outs[f"p{i}"] for i in range(len(GOOD))] == [clean[f"c{i}"] for i in range(3)]
        assert _run(engine, GOOD, PARAMS, "a") == ({f"a{i}": clean[f"c{i}"] for i in range(3)}, [])
        bm = engine.engine_core.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_total_blocks

        # Rank 0 alone fails: rank 1 waits in the step's first all-reduce, never agrees.
        import paged_engine.executor.multiproc as multiproc

        monkeypatch.setattr(multiproc, "STEP_FAILURE_SYNC_S", 1.0)
        runner = engine.executor.worker.model_runner
        poisoned = runner.forward

        def rank0_only(inputs):
            if bool((inputs.input_ids == POISON + 1).any()):
                raise ValueError("rank 0 only")
            return poisoned(inputs)

        runner.forward = rank0_only
        engine.add_request("lone", {"prompt_token_ids": [POISON + 1, 50]}, GREEDY)
        with pytest.raises(EngineDeadError):
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        engine.shutdown()
