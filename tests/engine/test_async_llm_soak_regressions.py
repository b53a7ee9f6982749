"""Regressions found by a long soak of `AsyncLLM` under asyncio cancellation races (many
concurrent generators cut short, aborts, pauses and sleeps, shutdown): each test replays one
finding deterministically."""

from __future__ import annotations

import asyncio
import queue

import pytest

from paged_engine import AsyncLLM
from paged_engine.executor.base import EngineDeadError

OPTS = {"dtype": "float32", "max_model_len": 64, "num_gpu_blocks_override": 16}


class _StopsBeforePut:
    """The engine's command queue, but the engine stops (its thread drains the queue and exits)
    between a caller's liveness checks and its put: the interleaving of a shutdown from another
    thread, or a worker lost, with a call in flight."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine
        self.inner: queue.SimpleQueue = engine._commands

    def put(self, item: tuple) -> None:
        if item[0] != "stop":
            self.engine.shutdown()  # joins the engine thread: it has drained and exited
            assert not self.engine._thread.is_alive()
        self.inner.put(item)

    def get(self, *args, **kwargs):
        return self.inner.get(*args, **kwargs)

    def get_nowait(self):
        return self.inner.get_nowait()


@pytest.mark.parametrize("call", ["is_paused", "generate"])
def test_a_call_queued_as_the_engine_stops_fails_instead_of_hanging(tiny_llama_dir, call) -> None:
    from paged_engine import SamplingParams

    engine = AsyncLLM(str(tiny_llama_dir), **OPTS)
    engine._commands = _StopsBeforePut(engine)

    async def main() -> None:
        if call == "is_paused":
            await engine.is_paused()
        else:
            async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=2), "r"):
                pass

    # the bound only ends the old behaviour (a future no one answers); a pass is immediate
    with pytest.raises(EngineDeadError):
        asyncio.run(asyncio.wait_for(main(), 60))
    assert not engine._streams


def test_a_request_too_big_for_the_pool_fails_with_valueerror_during_a_wait_pause(
    tiny_llama_dir,
) -> None:
    """A request whose n sequences outgrow the KV pool fails alone with a ValueError naming
    max_tokens, whether a step of the loop or the steps of a "wait" pause find it (the pause
    used to hand its generator the scheduler's bare SchedulerStuckError)."""
    import threading

    from paged_engine import SamplingParams

    engine = AsyncLLM(str(tiny_llama_dir), dtype="float32", max_model_len=96,
                      num_gpu_blocks_override=9, max_num_seqs=8)  # fmt: skip
    gate = threading.Event()
    big = SamplingParams(n=4, max_tokens=60, ignore_eos=True, temperature=0.8, seed=1)

    async def main() -> BaseException | None:
        # The engine thread waits on the gate, so the add and the pause are taken in one batch
        # of commands: the pause's own steps (not the loop's) run the request.
        blocked = asyncio.ensure_future(engine._call(lambda e: gate.wait(30)))
        gen = engine.generate(list(range(3, 33)), big, "big")
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)  # the generator queued its add
        pause = asyncio.ensure_future(engine.pause_generation(mode="wait"))
        await asyncio.sleep(0)
        gate.set()
        await asyncio.wait_for(blocked, 60)
        await asyncio.wait_for(pause, 60)
        try:
            await asyncio.wait_for(first, 60)
        except ValueError as e:
            return e
        finally:
            await engine.resume_generation()
        return None

    try:
        error = asyncio.run(main())
        assert isinstance(error, ValueError) and "max_tokens" in str(error), error
        # the pool's allocatable blocks, as paged-server's answer counts them
        assert f"({engine.engine.block_manager.num_total_blocks} blocks)" in str(error)
        assert not engine._streams
    finally:
        engine.shutdown()


@pytest.mark.parametrize("how", ["pause_generation", "sleep"])
def test_a_pooling_request_a_pause_aborts_ends_its_generator(tiny_llama_dir, how) -> None:
    """An `encode` in flight when a pause or sleep with mode "abort" runs ends (CancelledError,
    as abort() ends it) and leaves no stream behind; it used to wait forever, as the engine
    drops a pooling request aborted before its result without an output."""
    import threading

    from paged_engine import PoolingParams

    engine = AsyncLLM(str(tiny_llama_dir), enable_sleep_mode=True, **OPTS)
    gate = threading.Event()

    async def main() -> BaseException | None:
        # The engine thread waits on the gate, so the add and the pause are taken in one batch
        # of commands: the request is in flight, not finished, when the pause aborts it.
        blocked = asyncio.ensure_future(engine._call(lambda e: gate.wait(30)))
        gen = engine.encode(list(range(3, 20)), PoolingParams(task="embed"), "emb")
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)  # the generator queued its add
        pause = asyncio.ensure_future(getattr(engine, how)(mode="abort"))
        await asyncio.sleep(0)
        gate.set()
        await asyncio.wait_for(blocked, 60)
        await asyncio.wait_for(pause, 60)
        try:
            # the bound only ends the old behaviour (no output ever); a pass is immediate
            await asyncio.wait_for(asyncio.shield(first), 60)
        except asyncio.CancelledError as e:
            return e
        finally:
            await (engine.resume_generation() if how == "pause_generation" else engine.wake_up())
        return None

    try:
        error = asyncio.run(main())
        assert isinstance(error, asyncio.CancelledError), error
        assert not engine._streams

        async def again() -> object:  # the engine serves on
            return [o async for o in engine.encode([5, 6, 7], PoolingParams(task="embed"), "e2")]

        outs = asyncio.run(again())
        assert len(outs) == 1 and outs[0].finished
    finally:
        engine.shutdown()
