"""vLLM's multi-modal processor cache: an image processed once is not processed again.

    key:   SHA-256 of the image's pixels as loaded (mode, size, bytes) and the processor
           arguments it ran with
    value: the layout's `Loaded` (pixel values, size), shared read-only by every prompt that
           holds the image (a chat resends its images with every turn)

Least recently used entries go first once the pixel values held pass `max_bytes`
(mm_processor_cache_gb); 0 turns the cache off. Safe to share between threads (a server
processes images on its request threads).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any

from paged_engine.multimodal.layouts import Loaded


def image_key(image: Any, kwargs: dict[str, Any]) -> str:
    """The cache key of a PIL image processed with `kwargs`."""
    h = hashlib.sha256(image.tobytes())  # (faster than blake2b where the CPU has SHA-NI)
    h.update(repr((image.mode, image.size, sorted(kwargs.items(), key=str))).encode())
    return h.hexdigest()[:32]


class ProcessorCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, Loaded] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Loaded | None:
        with self._lock:
            loaded = self._entries.get(key)
            if loaded is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return loaded

    def put(self, key: str, loaded: Loaded) -> None:
        size = loaded[0].numel() * loaded[0].element_size()
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = loaded
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self.bytes -= old[0].numel() * old[0].element_size()

    def __len__(self) -> int:
        return len(self._entries)
