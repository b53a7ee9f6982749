"""The worker's side of LoRA: packed adapters in host memory, and slots for live sequences.

The engine decides which adapters are loaded (`add` / `remove`, on every rank). A sequence
arriving with an adapter takes that adapter's slot, loading it into a slot no live sequence uses
when it has none: the scheduler never runs more distinct adapters than `max_loras`, so such a
slot always exists. Slots load on the step's stream before its forward, after the previous
step's kernels: a slot reloaded here is never read by a step that ran with its old adapter.

`loader` reads and packs adapters on a thread of its own (lora/loader.py): `add` installs what
it read ahead, and reads on the calling thread only what nobody asked it to read.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from paged_engine.lora.adapter import read_peft_adapter
from paged_engine.lora.loader import AdapterLoader
from paged_engine.lora.model import LoRAModel, PackedAdapter

# Finished reads waiting for their installs (each holds a packed adapter): callers install what
# they waited for within a step, so a few suffice; past them the oldest are dropped.
MAX_READ_AHEAD = 4


class LoRAManager:
    def __init__(self, lora_model: LoRAModel, max_num_seqs: int) -> None:
        self.model = lora_model
        self.loader = AdapterLoader(self.read, MAX_READ_AHEAD)
        self.num_slots = lora_model.mapping.num_slots
        self.packed: dict[int, PackedAdapter] = {}  # adapter id -> this rank's slot contents
        self.paths: dict[int, str] = {}
        self.slot_of: dict[int, int] = {}  # adapter id -> slot
        self.slot_ids: list[int | None] = [None] * self.num_slots
        self._slot_age = [0] * self.num_slots  # last use, for least-recently-used reuse
        self._clock = 0
        self.users: Counter[int] = Counter()  # adapter id -> live rows
        self.row_slot = np.full(max_num_seqs, -1, dtype=np.int64)

    # ---- adapters (the engine's calls) ------------------------------------------------------
    def read(self, path: str) -> PackedAdapter:
        """The adapter at `path` read and packed for this rank (any thread: it reads the
        model's layout only); ValueError when it cannot be served."""
        return self.model.pack(read_peft_adapter(path, self.model.max_rank))

    def add(self, lora_id: int, path: str) -> None:
        """Install the adapter, read ahead by `loader` or read now; ValueError (the engine's
        registry keeps it unloaded) when it cannot be served."""
        if lora_id in self.packed and self.paths[lora_id] == path:
            return
        packed = self.loader.take(lora_id, path)  # a read in flight: waits for the rest
        self.packed[lora_id] = packed if packed is not None else self.read(path)
        self.paths[lora_id] = path
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:  # re-added with new contents: its slot reloads on next use
            self.slot_ids[slot] = None

    def remove(self, lora_id: int) -> None:
        self.loader.discard(lora_id)
        self.packed.pop(lora_id, None)
        self.paths.pop(lora_id, None)
        if not self.users[lora_id]:
            slot = self.slot_of.pop(lora_id, None)
            if slot is not None:
                self.slot_ids[slot] = None

    # ---- rows -------------------------------------------------------------------------------
    def acquire(self, row: int, lora_id: int, path: str | None) -> None:
        if not lora_id:
            self.row_slot[row] = -1
            return
        slot = self.slot_of.get(lora_id)
        if slot is None:
            slot = self._free_slot()
            if lora_id not in self.packed:  # e.g. evicted from the host cache while waiting
                assert path is not None, f"adapter {lora_id} unknown to this worker"
                self.add(lora_id, path)
            self.model.load_slot(slot, self.packed[lora_id])
            old = self.slot_ids[slot]
            if old is not None:
                del self.slot_of[old]
            self.slot_ids[slot], self.slot_of[lora_id] = lora_id, slot
        self._clock += 1
        self._slot_age[slot] = self._clock
        self.users[lora_id] += 1
        self.row_slot[row] = slot

    def release(self, row: int, lora_id: int) -> None:
        if lora_id:
            self.users[lora_id] -= 1
            if not self.users[lora_id]:
                del self.users[lora_id]
                if lora_id not in self.packed:  # removed while in use: free its slot now
                    slot = self.slot_of.pop(lora_id, None)
                    if slot is not None:
                        self.slot_ids[slot] = None
        self.row_slot[row] = -1

    def _free_slot(self) -> int:
        free = [s for s, i in enumerate(self.slot_ids) if i is None]
        if free:
            return free[0]
        idle = [s for s, i in enumerate(self.slot_ids) if i is not None and not self.users[i]]
        assert idle, f"more than max_loras={self.num_slots} adapters in one batch"
        return min(idle, key=self._slot_age.__getitem__)

    # ---- per step ---------------------------------------------------------------------------
    def set_mapping(self, token_rows: np.ndarray) -> None:
        """The step's tokens (their InputBatch rows) -> each token's slot."""
        self.model.mapping.set(self.row_slot[token_rows])
