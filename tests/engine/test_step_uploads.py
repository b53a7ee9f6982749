"""The model runner's host -> device upload of a step's arrays (one pinned buffer, views)."""

from __future__ import annotations

import numpy as np
import pytest

from paged_engine.worker.model_runner import pack_aligned


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_])
def test_uploads_start_16_byte_aligned(dtype):
    """A step's host arrays go up in one buffer: every view starts on a 16-byte boundary
    whatever the token and sequence counts, so Triton (which specializes on pointer alignment)
    builds no new kernel variant when a count changes parity."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        arrays = [rng.integers(0, 100, int(n)).astype(dtype) for n in rng.integers(0, 40, 5)]
        buf, starts = pack_aligned(arrays)
        for start, a in zip(starts, arrays, strict=True):
            assert start * buf.itemsize % 16 == 0
            assert np.array_equal(buf[start : start + a.size], a)


def test_mixed_dtypes_take_the_common_one():
    """As np.concatenate: an int32 array beside int64 ones is widened, never truncated."""
    big = np.array([2**40, 3], dtype=np.int64)
    buf, starts = pack_aligned([np.array([1, 2, 3], dtype=np.int32), big])
    assert buf.dtype == np.int64 and starts == [0, 4]
    assert buf[starts[1] : starts[1] + 2].tolist() == [2**40, 3]
