"""multimodal/processor_cache.py: least recently used entries go first past the byte budget;
an entry larger than the budget is not kept; keys tell pixels and processor arguments apart."""

from __future__ import annotations

import pytest
import torch

from paged_engine.multimodal.processor_cache import ProcessorCache, image_key

Image = pytest.importorskip("PIL.Image")


def _loaded(n: int):
    return torch.zeros(n, dtype=torch.float32), None  # n * 4 bytes


def test_least_recently_used_go_first():
    cache = ProcessorCache(max_bytes=100)  # 25 floats
    cache.put("a", _loaded(10))
    cache.put("b", _loaded(10))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", _loaded(10))  # 120 bytes: b goes
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert cache.bytes == 80 and len(cache) == 2
    cache.put("huge", _loaded(30))  # over the whole budget: not kept, nothing evicted
    assert cache.get("huge") is None and len(cache) == 2
    assert (cache.hits, cache.misses) == (3, 2)


def test_keys_tell_pixels_mode_and_arguments_apart():
    red = Image.new("RGB", (4, 4), (255, 0, 0))
    keys = {
        image_key(red, {}),
        image_key(Image.new("RGB", (4, 4), (0, 0, 255)), {}),
        image_key(red.convert("RGBA"), {}),
        image_key(red, {"max_pixels": 64}),
        image_key(red, {"size": {"longest_edge": 8}}),
    }
    assert len(keys) == 5
    assert image_key(red, {"a": 1, "b": 2}) == image_key(red.copy(), {"b": 2, "a": 1})
