"""The engine calls engine_fuzz.py makes between steps: prefix-cache resets, pauses of every
mode, sleeps that give the KV cache back (each resumed a few steps later) and, with `--faults`,
one host-side failure armed in the engine's own code (FAULTS), which the driver survives as
paged-server does: the requests involved fail, the engine serves on."""

from __future__ import annotations

import random
from typing import Any

# host code a fault is injected into (it raises on its k-th call once armed): mid-schedule, a
# block allocation with others already made; after a step ran, applying its results
FAULTS = ("allocate_slots", "apply")


class InjectedFault(RuntimeError):
    pass


def draw_events(
    rng: random.Random, options: dict[str, Any], faults: bool = False
) -> dict[int, list[tuple]]:
    """step -> engine calls made before it: prefix-cache resets, pauses of every mode and
    (with sleep mode) sleeps that give the KV cache back, each resumed a few steps later; with
    `faults`, one host-side failure armed (FAULTS) that the driver survives as paged-server
    does: every request in flight fails, the engine serves on."""
    events: dict[int, list[tuple]] = {}
    if faults:
        at = rng.randint(0, 40)
        events.setdefault(at, []).append(("fault", rng.choice(FAULTS), rng.randint(1, 3)))
    for _ in range(rng.randint(0, 3)):
        at = rng.randint(0, 60)
        kind = rng.choice(
            ["reset", "pause", "sleep" if options.get("enable_sleep_mode") else "pause"]
        )
        if kind == "reset":
            events.setdefault(at, []).append(("reset",))
            continue
        mode = rng.choice(["keep", "wait", "abort"])
        events.setdefault(at, []).append((kind, mode))
        events.setdefault(at + rng.randint(0, 5), []).append(
            ("wake" if kind == "sleep" else "resume",)
        )
    return events


def apply_event(engine: Any, event: tuple) -> list[Any]:
    """Make one engine call; what a "wait" pause's steps produced is returned by a later
    step, so nothing to collect here but for symmetry."""
    kind = event[0]
    if kind == "reset":
        engine.reset_prefix_cache()
    elif kind == "pause":
        engine.pause_generation(mode=event[1])
    elif kind == "resume":
        if not engine.sleep_mode.asleep:  # (a sleep's wake_up resumes)
            engine.resume_generation()
    elif kind == "sleep":
        engine.sleep(level=1, mode=event[1])
    elif kind == "wake":
        engine.wake_up()
    elif kind == "fault":
        _arm(engine, event[1], event[2])
    return []


def _arm(engine: Any, target: str, k: int) -> None:
    """Make `target` raise InjectedFault on its k-th call from now, once."""
    owner = engine.block_manager if target == "allocate_slots" else engine.engine_core
    name = "allocate_slots" if target == "allocate_slots" else "_apply"
    real = getattr(owner, name)
    calls = [0]

    def faulty(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == k:
            setattr(owner, name, real)  # once
            raise InjectedFault(f"injected into {target}")
        return real(*args, **kwargs)

    setattr(owner, name, faulty)
