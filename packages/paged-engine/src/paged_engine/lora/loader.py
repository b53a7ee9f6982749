"""`AdapterLoader`: adapters read and packed on a thread of their own, ahead of their install.

Reading an adapter (its files, the checks, the conversion into this rank's slot layout) takes
as long as its size asks; installing a packed one takes a dict entry. Callers that know an
adapter is coming (a request naming one, `add_lora`) `submit` it from their own thread and wait
for the Future; the step thread later `take`s the result, so it never waits on a disk read. A
read that fails keeps its ValueError for the `take` that installs it, so a bad adapter fails
the same call, with the same message, as a read on the step thread would.

Invariants: one read per (adapter id, path) at a time; results wait in `_reads` until taken or
discarded, at most `max_kept` of them finished (the oldest are dropped: a `take` that finds
none reads on its own thread, slower but the same result).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class AdapterLoader:
    def __init__(self, read: Callable[[str], Any], max_kept: int) -> None:
        self._read = read  # path -> a packed adapter; ValueError when it cannot be served
        self.max_kept = max(1, max_kept)
        self._lock = threading.Lock()  # guards _reads and _pool (any thread may submit)
        self._reads: OrderedDict[tuple[int, str], Future] = OrderedDict()  # oldest first
        self._pool: ThreadPoolExecutor | None = None  # one thread: reads run one at a time

    def submit(self, lora_id: int, path: str) -> Future:
        """Start reading (lora_id, path) unless a read of it is in flight or waiting; its
        Future is done once the read ended (`take` raises what it raised)."""
        key = (lora_id, path)
        with self._lock:
            fut = self._reads.get(key)
            if fut is None:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="paged-lora-load")
                fut = self._reads[key] = self._pool.submit(self._read, path)
                self._drop_oldest()
            return fut

    def take(self, lora_id: int, path: str) -> Any | None:
        """The packed adapter read for (lora_id, path), waiting for a read in flight; None when
        none was submitted (or it was dropped). Raises the read's ValueError."""
        with self._lock:
            fut = self._reads.pop((lora_id, path), None)
        return None if fut is None else fut.result()

    def discard(self, lora_id: int) -> None:
        """Forget reads of `lora_id` (removed: a later load reads its files again)."""
        with self._lock:
            for key in [k for k in self._reads if k[0] == lora_id]:
                del self._reads[key]

    def pending(self) -> int:
        with self._lock:
            return len(self._reads)

    def _drop_oldest(self) -> None:
        done = [k for k, f in self._reads.items() if f.done()]
        for key in done[: max(0, len(done) - self.max_kept)]:
            del self._reads[key]

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            self._reads.clear()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
