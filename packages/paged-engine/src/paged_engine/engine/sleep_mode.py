"""Sleep mode and pausing (vLLM's `sleep` / `wake_up` / `pause_generation`): what RL loops call
to free the device for training between rollouts, or to update weights mid-run.

    pause(mode)    settle the requests in flight, then schedule nothing:
                     "abort"  finish each with finish_reason "abort" (its tokens so far kept)
                     "wait"   run until every request has finished
                     "keep"   freeze them where they are; they go on after resume / wake-up
    sleep(level)   pause, then give back device memory on every rank (worker/sleep.py):
                     0  pause only
                     1  weights copied to host memory, KV cache discarded
                     2  weights and KV cache discarded (buffers kept): reload or update them
                     tags=[...]  the named ones ("weights": discarded, "kv_cache")
    wake_up(tags)  take the memory back; once nothing is asleep, scheduling resumes

Requests added meanwhile wait in the queue. Whatever sleeps loses the prefix cache, and a
sleeping KV cache takes the running requests' blocks with it: "keep" then preempts them (they
are recomputed after the wake-up, with identical outputs).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from paged_engine.core.scheduler import SchedulerStuckError
from paged_engine.core.step_isolation import RequestFailedError
from paged_engine.worker.sleep import TAGS

if TYPE_CHECKING:
    from paged_engine.engine.llm_engine import LLMEngine
    from paged_engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")


def check_mode(mode: object) -> str:
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
    return mode  # type: ignore[return-value]


def check_tags(tags: object) -> list[str] | None:
    """None (every tag) or a list of known tags, in TAGS order."""
    if tags is None:
        return None
    if isinstance(tags, str) or not isinstance(tags, Sequence):
        raise ValueError(f"tags must be a list of {list(TAGS)}, got {tags!r}")
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise ValueError(f"tags: unknown memory tag {unknown[0]!r}; expected one of {list(TAGS)}")
    return [t for t in TAGS if t in tags]


def check_sleep_args(level: object, tags: object, mode: object) -> list[str] | None:
    """`sleep`'s arguments checked (ValueError naming the bad one); returns check_tags'."""
    if isinstance(level, bool) or level not in (0, 1, 2):
        raise ValueError(f"level must be 0, 1 or 2, got {level!r}")
    named = check_tags(tags)
    check_mode(mode)
    return named


class SleepMode:
    """The engine's pause and sleep state; the engine delegates to it."""

    def __init__(self, engine: LLMEngine) -> None:
        # Weak: no cycle, so an engine its user drops is finalized (its ranks shut down) at once.
        self.engine: LLMEngine = weakref.proxy(engine)
        self.asleep: list[str] = []  # tags whose memory is given back, in TAGS order
        self.held: list[RequestOutput] = []  # what a "wait" pause's steps produced
        self.weights_offloaded = False  # the sleeping weights have a host copy (level 1)

    @property
    def paused(self) -> bool:
        return self.engine.engine_core.paused

    def pause(self, mode: str = "abort", *, clear_cache: bool = True) -> None:
        """RequestFailedError (raised once paused) names the requests that failed alone while
        "wait" ran them (core/step_isolation.py); the others went on."""
        _raise_failed(self._pause(mode, clear_cache=clear_cache))

    def _pause(self, mode: str, *, clear_cache: bool) -> list[RequestFailedError]:
        check_mode(mode)
        engine, core = self.engine, self.engine.engine_core
        failed: list[RequestFailedError] = []
        if mode == "wait" and not core.paused:
            while core.has_unfinished_requests():
                try:
                    outputs = engine.step()  # returns (and clears) what was held before
                except RequestFailedError as e:  # a culprit, alone: the others run on
                    failed.append(e)
                    continue
                except SchedulerStuckError as e:  # one that can never fit fails alone too
                    if not e.request_ids:
                        raise
                    core.abort_requests(e.request_ids)
                    engine.output_processor.abort(e.request_ids)
                    failed.append(RequestFailedError(e.request_ids, e))
                    continue
                self.held += outputs
        core.paused = True
        for e in core.drain():  # results that failed to apply: their requests failed
            engine.output_processor.abort(e.request_ids)
            failed.append(e)
        if mode == "abort":
            core.abort_all()
        if clear_cache and mode != "keep":
            engine.forget_prefix_cache()
        return failed

    def resume(self) -> None:
        if self.asleep:
            raise RuntimeError(
                f"the engine's {' and '.join(self.asleep)} memory is asleep: wake_up() resumes"
            )
        self.engine.engine_core.paused = False

    def sleep(self, level: int = 1, tags: Sequence[str] | None = None, mode: str = "abort") -> None:
        named = check_sleep_args(level, tags, mode)
        wanted = named if named is not None else ([] if level == 0 else list(TAGS))
        new = [t for t in wanted if t not in self.asleep]
        if new and not self.engine.config.enable_sleep_mode:
            raise ValueError(
                "enable_sleep_mode: start the engine with enable_sleep_mode=True "
                "(--enable-sleep-mode) to sleep"
            )
        engine, core = self.engine, self.engine.engine_core
        if not new and core.paused:
            return  # asleep already: a no-op (requests added meanwhile keep waiting)
        failed = self._pause(mode, clear_cache=False)
        if not new:
            return _raise_failed(failed)
        if "kv_cache" in new:
            core.preempt_all()  # their blocks' contents are about to go
        engine.forget_prefix_cache()
        offload = named is None and level == 1
        freed = engine.executor.collective_rpc("sleep", args=(new, offload))
        if "weights" in new:
            self.weights_offloaded = offload
        self.asleep = [t for t in TAGS if t in self.asleep or t in new]
        logger.info(
            "asleep (%s): %.2f GiB of device memory freed on %d rank(s)",
            ", ".join(self.asleep),
            sum(freed) / 2**30,
            len(freed),
        )
        _raise_failed(failed)  # (as pause's, once asleep)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        named = check_tags(tags)
        waking = [t for t in self.asleep if named is None or t in named]
        if waking:
            self.engine.executor.collective_rpc("wake_up", args=(waking,))
            self.asleep = [t for t in self.asleep if t not in waking]
            logger.info("awake: %s", ", ".join(waking))
        if not self.asleep:
            self.engine.engine_core.paused = False

    def is_sleeping(self) -> bool:
        return bool(self.asleep) or self.paused

    def state(self) -> str:
        """vLLM's engine_sleep_state: "awake", "weights_offloaded" (level 1), "discard_all"
        (level 2, or the weights slept by name), or "" (paused, or only the KV cache sleeps)."""
        if "weights" in self.asleep:
            return "weights_offloaded" if self.weights_offloaded else "discard_all"
        return "" if self.is_sleeping() else "awake"

    def take_held(self) -> list[RequestOutput]:
        held, self.held = self.held, []
        return held


def _raise_failed(failed: list[RequestFailedError]) -> None:
    """One error for the requests a "wait" pause saw fail (the first one's cause), if any."""
    if len(failed) == 1:
        raise failed[0]
    if failed:
        ids = [rid for e in failed for rid in e.request_ids]
        raise RequestFailedError(ids, failed[0].cause) from failed[0].cause
