"""Zeroed host memory that costs nothing until it is written: the CPU KV cache's pool.

`torch.zeros` writes every byte up front: a 1 GiB CPU KV cache (the default) took ~0.6 s of an
engine's start and held 1 GiB of resident memory from the first step, however few blocks were
ever used. A private anonymous mapping is zero by the kernel's guarantee, page by page on first
touch, so `zeroed` returns at once and the process grows only as blocks are written. After a
fork the pages are copy-on-write, as the heap's are.

`release` gives such a tensor's pages back (`MADV_DONTNEED`: the mapping stays, reads see zeros
again): sleep mode's "kv_cache" tag frees and re-zeroes the CPU cache with it, since these
storages cannot be resized as other storages are.
"""

from __future__ import annotations

import math
import mmap
import weakref

import torch

# the mapping behind each live tensor `zeroed` made, by data pointer; an entry goes with its
# mapping (the tensors hold the mapping's buffer, so it lives as long as any of them)
_MAPPINGS: weakref.WeakValueDictionary[int, mmap.mmap] = weakref.WeakValueDictionary()


def zeroed(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose pages are committed only when written."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(mapping, dtype=torch.uint8)
    _MAPPINGS[flat.data_ptr()] = mapping
    return flat.view(dtype).view(shape)


def cache_zeros(
    shape, *, dtype: torch.dtype, device: torch.device | None = None, pin_memory: bool = False
) -> torch.Tensor:
    """A zeroed cache tensor (KV blocks, the CPU block pool, cross-attention slots): `zeroed`
    in host memory that is not pinned, `torch.zeros` elsewhere."""
    if (device is None or device.type == "cpu") and not pin_memory:
        return zeroed(tuple(shape), dtype)
    return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)


def is_lazy(storage: torch.UntypedStorage) -> bool:
    """Whether `storage` is one `zeroed` made (whole)."""
    mapping = _MAPPINGS.get(storage.data_ptr())
    return mapping is not None and len(mapping) == storage.nbytes()


def release(storage: torch.UntypedStorage) -> bool:
    """Hand the pages of a `zeroed` storage back to the OS; it reads as zeros afterwards.
    False (nothing done) for any other storage."""
    if not is_lazy(storage):
        return False
    _MAPPINGS[storage.data_ptr()].madvise(mmap.MADV_DONTNEED)
    return True


def resident_bytes(storage: torch.UntypedStorage) -> int:
    """The bytes of physical memory that `storage` holds on its own now (Linux:
    /proc/self/pagemap's pages both present and exclusively mapped; a page only read maps the
    kernel's shared zero page, which is not this process's); its full size where the kernel
    does not say."""
    page = mmap.PAGESIZE
    start, nbytes = storage.data_ptr(), storage.nbytes()
    first, last = start // page, (start + nbytes - 1) // page
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first * 8)
            entries = f.read((last - first + 1) * 8)
    except OSError:
        return nbytes
    flags = memoryview(entries).cast("Q")
    return sum(page for entry in flags if (entry >> 63) & (entry >> 56) & 1)
