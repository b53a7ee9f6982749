"""A spy on tensor methods that read device memory on the host (each one a host-device sync on
a GPU: an error inside a CUDA-graph capture, a stall for async scheduling)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

HOST_READS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


@contextlib.contextmanager
def spy_host_reads(record: Callable[[str], None]) -> Iterator[None]:
    """Call `record(method name)` on every host read while the block runs. torch.Tensor is
    restored exactly: a name it inherits from its C base is deleted again, not set."""
    originals = {name: torch.Tensor.__dict__.get(name) for name in HOST_READS}

    def spy(name: str, fn):
        def wrapper(t, *args, **kwargs):
            record(name)
            return fn(t, *args, **kwargs)

        return wrapper

    for name in originals:
        setattr(torch.Tensor, name, spy(name, getattr(torch.Tensor, name)))
    try:
        yield
    finally:
        for name, fn in originals.items():
            if fn is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, fn)
