"""The engine's side of LoRA: which adapters the workers hold, and which requests use them.

An adapter is loaded on every worker (read, checked against the model and packed into host
memory) the first time a request or `add_lora` names it; a bad adapter fails that call with a
ValueError and nothing else (it is read before any other is unloaded). At most `max_cpu_loras`
stay loaded: adding one more unloads the least recently used adapters that no unfinished
request needs; when every one is needed the cache grows past the limit, and `trim` (after each
step and abort) unloads the extra ones once their requests finished. An id names one directory
for as long as it is loaded.

The files are read off the step thread when the caller asks first: `prefetch` (any thread)
starts rank 0's read on the loader thread (lora/loader.py) and returns its Future; the caller
waits for it, then `ensure` (the step thread) installs what was read. Without a prefetch,
`ensure` reads on its own thread, as it must for the other ranks of a multi-process engine.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future

from paged_engine.executor.base import Executor
from paged_engine.lora.loader import AdapterLoader
from paged_engine.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRARegistry:
    def __init__(
        self,
        executor: Executor,
        max_cpu_loras: int,
        in_use: Callable[[], set[int]],
        loader: AdapterLoader | None = None,
    ) -> None:
        self.executor = executor
        self.capacity = max_cpu_loras
        self.in_use = in_use  # adapter ids of unfinished requests
        self.loader = loader  # rank 0's (whose `add_lora` takes what it read); None: none
        # Least recently used first. Written by the step thread only; `prefetch` reads it.
        self.loaded: OrderedDict[int, LoRARequest] = OrderedDict()

    def prefetch(self, lora: LoRARequest) -> Future | None:
        """Start reading `lora`'s adapter off the step thread (any thread may call this).
        Returns the read's Future (done when it ended; its error is raised by the `ensure`
        that installs it), or None when there is nothing to read ahead (loaded, no loader, or
        not a LoRARequest: `ensure` answers those)."""
        if self.loader is None or not isinstance(lora, LoRARequest):
            return None
        if lora.lora_int_id in self.loaded:  # loaded (or another path: `ensure` refuses it)
            return None
        return self.loader.submit(lora.lora_int_id, lora.lora_path)

    def ensure(self, lora: LoRARequest) -> None:
        """Load `lora` unless it is loaded; ValueError when it cannot be served."""
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        known = self.loaded.get(lora.lora_int_id)
        if known is not None:
            if known.lora_path != lora.lora_path:
                raise ValueError(
                    f"lora_request: lora_int_id {lora.lora_int_id} is loaded from "
                    f"{known.lora_path!r}, not {lora.lora_path!r}: one id names one adapter "
                    "(remove_lora it first, or pick another id)"
                )
            self.loaded.move_to_end(lora.lora_int_id)
            return
        # Loaded before anything is unloaded: a bad adapter (ValueError) evicts no good one.
        self.executor.add_lora(lora.lora_int_id, lora.lora_path)
        self.loaded[lora.lora_int_id] = lora
        logger.info("LoRA adapter %r (id %d) loaded", lora.lora_name, lora.lora_int_id)
        self._make_room(keep=lora.lora_int_id)

    def trim(self) -> None:
        """Back to `capacity` adapters, as far as unfinished requests let go of the extra ones
        (cheap while within it: the engine calls it after every step)."""
        self._make_room(keep=None)

    def _make_room(self, keep: int | None) -> None:
        """Unload idle adapters, least recently used first, down to `capacity` (never `keep`)."""
        if len(self.loaded) <= self.capacity:
            return
        busy = self.in_use() | {keep}
        for lora_id in list(self.loaded):
            if len(self.loaded) <= self.capacity:
                return
            if lora_id not in busy:
                self._unload(lora_id)

    def _unload(self, lora_id: int) -> None:
        lora = self.loaded.pop(lora_id)
        self.executor.remove_lora(lora_id)
        logger.info("LoRA adapter %r (id %d) unloaded", lora.lora_name, lora_id)

    def remove(self, lora_id: int) -> bool:
        """Unload an adapter; False when it is not loaded or unfinished requests use it. Reads
        ahead of `lora_id` are dropped either way (a request that read it and never reached
        the engine leaves one): after a remove, the next load of the id reads its files."""
        if self.loader is not None:
            self.loader.discard(lora_id)
        if lora_id not in self.loaded or lora_id in self.in_use():
            return False
        self._unload(lora_id)
        return True

    def ids(self) -> set[int]:
        return set(self.loaded)

    def shutdown(self) -> None:
        if self.loader is not None:
            self.loader.shutdown()
