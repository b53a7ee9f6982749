"""`StateSlots`: the rows of the worker's recurrent-state pools (worker/recurrent_state.py) of a
hybrid model, and the row copies a step must run before its forward.

    rows:  | 0 ... num_slots-1: seats (live sequences) | snapshots (prefix cache) | scratch |

Seats. A sequence takes a slot when it is first scheduled and keeps it until its blocks are
released (finished, aborted, preempted for recompute), so a slot's state always belongs to one
sequence and covers its computed tokens. A sequence that starts with computed tokens it did not
run itself (a fork; the copies of a forked request recomputed after preemption; a prefix-cache
hit) takes a fresh slot and a copy of its source's row, queued here and run by the worker at the
start of the next step: the source has run nothing since (a fan-out or beam request sits out
while its token is pending; a reshare copies exactly when the source has computed the shared
prefix; a snapshot is never written while registered), and copies read every source row before
writing any. The engine's seats (max_num_seqs, reserved before a fan-out) bound live sequences,
so max_num_seqs slots never run out.

Snapshots (prefix caching for hybrids). A KV block alone cannot resume a sequence: the state
after its tokens must come with it. A snapshot row holds the state after the last token of one
full block, keyed like that block in the prefix cache (hash, parent hash, tokens), so a hit that
walks a verified chain of cached KV blocks may resume at the deepest block that has one. The
scheduler ends a step exactly at a block boundary where it wants one (`Sequence.
state_checkpoints`) and calls `snapshot` after emitting that step; the copy seat -> snapshot is
emitted with the next step's copies (after the forward that computed it, before the next one
can overwrite the seat), and only then is the snapshot registered, so a hit never reads a row
whose copy is still queued. Snapshots are evicted least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict

# (block hash, parent hash, the block's tokens): the prefix cache's key of the block the state
# stands at the end of (core/block_manager.py).
BlockKey = tuple[int, int | None, tuple[int, ...]]


class StateSlots:
    def __init__(self, num_slots: int, num_snapshots: int = 0) -> None:
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        self._free = list(range(num_slots - 1, -1, -1))
        self._copies: list[tuple[int, int]] = []  # (src row, dst row) for the next step
        # Snapshot rows: free ones, registered ones (block hash -> (row, parent, tokens), least
        # recently used first), and the ones taken this step (registered at the next step).
        self._free_snapshots = list(range(num_slots + num_snapshots - 1, num_slots - 1, -1))
        self._snapshots: OrderedDict[int, tuple[int, int | None, tuple[int, ...]]] = OrderedDict()
        self._taken: list[tuple[int, BlockKey]] = []  # (seat row, key) since the last step
        self.snapshot_hits = 0  # admissions resumed from a snapshot

    @property
    def num_rows(self) -> int:
        """Rows the worker's pools need, the scratch row excluded."""
        return self.num_slots + self.num_snapshots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached_snapshots(self) -> int:
        return len(self._snapshots)

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
        # be taken again: the copy must not overwrite the next owner's fresh state). A snapshot
        # taken from it stays: the row keeps that state until the next step's forward.
        if self._copies:
            self._copies = [c for c in self._copies if c[1] != slot]

    def copy(self, src: int, dst: int) -> None:
        self._copies.append((src, dst))

    def take_copies(self) -> list[tuple[int, int]]:
        """This step's copies: forks and hits, and the snapshots taken when the previous step
        was emitted (registered now). One batch: every source is read before any write."""
        copies, self._copies = self._copies, []
        if self._taken:
            taken, self._taken = self._taken, []
            written: set[int] = set()
            for seat, key in taken:
                if (row := self._register(key, written)) is not None:
                    copies.append((seat, row))
        return copies

    # ---- snapshots -------------------------------------------------------------------------
    def lookup(self, key: BlockKey) -> int | None:
        """The snapshot row holding the state after the block `key`, or None."""
        entry = self._snapshots.get(key[0])
        if entry is None or entry[1:] != key[1:]:
            return None
        self._snapshots.move_to_end(key[0])
        return entry[0]

    def snapshot(self, seat: int, key: BlockKey) -> None:
        """Keep the state seat `seat` will hold after the step just emitted (which ends at the
        last token of the block `key`)."""
        if self.num_snapshots:
            self._taken.append((seat, key))

    def _register(self, key: BlockKey, written: set[int]) -> int | None:
        """The row a new snapshot goes to (None: not kept). `written`: rows this batch writes
        already (one batch writes a row once)."""
        if key[0] in self._snapshots:  # the same content, or a hash collision: first one wins
            return None
        if self._free_snapshots:
            row = self._free_snapshots.pop()
        else:  # evict the least recently used (a hit reading it this step reads it first)
            row = next(iter(self._snapshots.values()))[0]
            if row in written:  # more snapshots this step than rows
                return None
            self._snapshots.popitem(last=False)
        self._snapshots[key[0]] = (row, key[1], key[2])
        written.add(row)
        return row

    def reset_snapshots(self) -> None:
        """Forget every snapshot (LLM.reset_prefix_cache)."""
        self._free_snapshots.extend(row for row, *_ in self._snapshots.values())
        self._snapshots.clear()
        self._taken.clear()
