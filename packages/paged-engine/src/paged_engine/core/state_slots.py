"""`StateSlots`: which row of the worker's recurrent-state pools each live sequence of a hybrid
model owns (worker/recurrent_state.py), and the row copies a step must run before its forward.

A sequence takes a slot when it is first scheduled and keeps it until its blocks are released
(finished, aborted, preempted for recompute), so a slot's state always belongs to one sequence
and covers its computed tokens. A sequence that starts with computed tokens it did not run
itself (a fork; the copies of a forked request recomputed after preemption) takes a fresh slot
and a copy of its source's row, queued here and run by the worker at the start of the next step:
the source has run nothing since (a fan-out or beam request sits out while its token is pending;
a reshare copies exactly when the source has computed the shared prefix), and copies read every
source row before writing any.

The engine's seats (max_num_seqs, reserved before a fan-out) bound live sequences, so
max_num_seqs slots never run out.
"""

from __future__ import annotations


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._copies: list[tuple[int, int]] = []  # (src slot, dst slot) for the next step

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(
                f"all {self.num_slots} recurrent-state slots are taken (more live sequences "
                "than max_num_seqs)"
            )
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)
        # A copy into a slot whose sequence left before the step ran is moot (and its slot may
        # be taken again: the copy must not overwrite the next owner's fresh state).
        if self._copies:
            self._copies = [c for c in self._copies if c[1] != slot]

    def copy(self, src: int, dst: int) -> None:
        self._copies.append((src, dst))

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies
