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
walks a verified chain of cached KV blocks may resume at the deepest block that has one. Two
kinds are taken:

- prompt snapshots: the scheduler ends a step exactly at a block boundary where it wants one
  (`Sequence.state_checkpoints`: where a shared prefix diverges, the prompt's last full block);
- decode snapshots: a one-output sequence whose step ends at a block boundary past its prompt
  keeps its state there in a row of its own, overwritten at each later boundary, so that the
  next turn of a chat (the whole conversation so far) resumes within a block of where the
  answer ended. Live sequences hold at most half the rows this way (`max_held`); when a
  sequence leaves, its row becomes an ordinary snapshot. Not for models whose state after a
  token depends on whether it was a prompt token (`past_prompt` false: Mamba2 layers with a dt
  limit, which transformers applies to prompt tokens only): their prefix cache holds prompt
  tokens only, KV blocks too (BlockManager.prompt_only).

`snapshot` is called when the step reaching the boundary is emitted. The copy seat -> row is
emitted with the next step's copies (after the forward that computed it, before the next one
can overwrite the seat); the row is registered once its block's tokens are all known to the
host (under async scheduling the last one may still be pending), so a hit never reads a row
whose copy is still queued. Snapshots are evicted least recently used first, never a live
sequence's decode snapshot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paged_engine.core.request import Sequence

# (block hash, parent hash, the block's tokens): the prefix cache's key of the block the state
# stands at the end of (core/block_manager.py).
BlockKey = tuple[int, int | None, tuple[int, ...]]
# (sequence, block index) -> the block's key, or None while some of its tokens are pending
KeyOf = Callable[["Sequence", int], BlockKey | None]


class StateSlots:
    def __init__(self, num_slots: int, num_snapshots: int = 0, *, past_prompt: bool = True) -> None:
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        # Snapshots may stand after generated tokens: false for a model whose layers update
        # the state differently for prompt tokens (Mamba2's dt limit): a prompt of the same
        # tokens would not reach the same state.
        self.past_prompt = past_prompt
        self._free = list(range(num_slots - 1, -1, -1))
        self._copies: list[tuple[int, int]] = []  # (src row, dst row) for the next step
        # Snapshot rows: free ones, registered ones (block hash -> (row, parent, tokens), least
        # recently used first), and the ones taken this step (registered at the next step).
        self._free_snapshots = list(range(num_slots + num_snapshots - 1, num_slots - 1, -1))
        self._snapshots: OrderedDict[int, tuple[int, int | None, tuple[int, ...]]] = OrderedDict()
        # Taken since the last step: (seat, sequence, block index, decode snapshot). Copied,
        # waiting for their keys: (row, sequence, block index).
        self._taken: list[tuple[int, Sequence, int, bool]] = []
        self._unkeyed: list[tuple[int, Sequence, int]] = []
        self._row_hash: dict[int, int] = {}  # registered row -> its block hash
        # Rows holding a live sequence's decode snapshot (Sequence.snapshot_row), never evicted.
        self._held: dict[int, Sequence] = {}
        self.max_held = num_snapshots // 2 if past_prompt else 0
        self.snapshot_hits = 0  # admissions resumed from a snapshot
        self.decode_snapshots = 0  # decode snapshots copied

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

    def take_copies(self, key_of: KeyOf) -> list[tuple[int, int]]:
        """This step's copies: forks and hits, and the snapshots taken when the previous step
        was emitted. One batch: every source is read before any write."""
        copies, self._copies = self._copies, []
        if self._unkeyed:
            self._register(key_of)
        if self._taken:
            taken, self._taken = self._taken, []
            written: set[int] = set()
            keys: set[int] = set()  # the known keys this batch copies (one row each)
            for seat, seq, index, decode in taken:
                key = key_of(seq, index)
                if key is not None:
                    if key[0] in self._snapshots or key[0] in keys:
                        continue  # the same content, or a hash collision: the first one stays
                    keys.add(key[0])
                row = self._reserve(seq if decode else None, written)
                if row is None:
                    continue
                written.add(row)
                copies.append((seat, row))
                self._unkeyed.append((row, seq, index))
                self.decode_snapshots += decode
        if self._unkeyed:
            self._register(key_of)
        return copies

    # ---- snapshots -------------------------------------------------------------------------
    def lookup(self, key: BlockKey) -> int | None:
        """The snapshot row holding the state after the block `key`, or None."""
        entry = self._snapshots.get(key[0])
        if entry is None or entry[1:] != key[1:]:
            return None
        self._snapshots.move_to_end(key[0])
        return entry[0]

    def snapshot(self, seat: int, seq: Sequence, index: int, decode: bool = False) -> None:
        """Keep the state seat `seat` will hold after the step just emitted, which ends at the
        last token of `seq`'s block `index` (`decode`: in the sequence's own row)."""
        if self.num_snapshots:
            self._taken.append((seat, seq, index, decode))

    def release(self, seq: Sequence) -> None:
        """`seq` left its seat (finished, aborted, preempted): its decode snapshot, if any, is
        an ordinary one from now on."""
        if seq.snapshot_row >= 0:
            del self._held[seq.snapshot_row]
            seq.snapshot_row = -1

    def _reserve(self, seq: Sequence | None, written: set[int]) -> int | None:
        """The row a snapshot is copied to (None: not kept). `seq`: a decode snapshot of this
        live sequence. `written`: rows this batch writes already (one batch writes a row once;
        a hit reading a row in the same batch reads it first)."""
        if seq is not None and seq.state_slot < 0:
            seq = None  # left since: an ordinary snapshot
        if seq is not None and seq.snapshot_row >= 0:  # overwrite its own
            row = seq.snapshot_row
            if row in written:
                return None
            if (h := self._row_hash.pop(row, None)) is not None:
                del self._snapshots[h]
            else:  # its last one never got its key: its state is overwritten now
                self._unkeyed = [u for u in self._unkeyed if u[0] != row]
            return row
        if seq is not None and len(self._held) >= self.max_held:
            return None
        if self._free_snapshots:
            row = self._free_snapshots.pop()
        else:  # evict the least recently used one that no live sequence holds
            held = self._held
            victim = next(
                (h for h, (r, *_) in self._snapshots.items() if r not in written and r not in held),
                None,
            )
            if victim is None:
                return None
            row = self._snapshots.pop(victim)[0]
            del self._row_hash[row]
        if seq is not None:
            self._held[row] = seq
            seq.snapshot_row = row
        return row

    def _register(self, key_of: KeyOf) -> None:
        """Make the copied rows whose blocks' tokens are known findable; drop those whose
        tokens will never be (the sequence ended before its last one landed)."""
        waiting = []
        for row, seq, index in self._unkeyed:
            key = key_of(seq, index)
            if key is None and seq.num_pending:
                waiting.append((row, seq, index))
            elif key is None or key[0] in self._snapshots:
                self._drop(row)
            else:
                self._snapshots[key[0]] = (row, key[1], key[2])
                self._row_hash[row] = key[0]
        self._unkeyed = waiting

    def _drop(self, row: int) -> None:
        if (seq := self._held.pop(row, None)) is not None:
            seq.snapshot_row = -1
        self._free_snapshots.append(row)

    def reset_snapshots(self) -> None:
        """Forget every snapshot (LLM.reset_prefix_cache)."""
        for row in [*self._row_hash, *(row for row, *_ in self._unkeyed)]:
            self._drop(row)
        self._snapshots.clear()
        self._row_hash.clear()
        self._unkeyed.clear()
        self._taken.clear()
