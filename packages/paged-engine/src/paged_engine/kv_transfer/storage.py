"""One file per (block, tensor-parallel rank): the block's K/V of every layer this rank caches.

    MAGIC | header length (8 bytes, little-endian) | header (JSON) | tensor bytes, in order

The header holds the block's key and each tensor's (name, dtype, shape); tensors are in the
canonical [block_size, num_kv_heads, head_dim] layout whatever the attention backend's. Files
are written to a temporary name and renamed (`os.replace`), so a reader sees a whole file or
none. A file is used only if its key, tensor list and size are exactly what the reader expects
(`check_block`); anything else (missing, truncated, another model's) is a miss.
Files come from other processes: a header past `MAX_HEADER` bytes, or JSON no reader could
expect (nested past Python's recursion limit), is a miss too, a file's size is checked
before its bytes are read, and only a regular file is read (a FIFO or device under a block's
name is a miss, never a reader blocked on it).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import uuid
from typing import BinaryIO

import torch

MAGIC = b"PAGEDKV1"
_LEN = 8
MAX_HEADER = 1 << 20  # a block's header names its key and a few tensors per layer
# (name, dtype name, shape) of each tensor a block file holds, in file order
Spec = list[tuple[str, str, tuple[int, ...]]]


def block_path(root: str, key: str, rank: int, world: int) -> str:
    return os.path.join(root, f"{key}.tp{rank}of{world}.kv")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _itemsize(name: str) -> int:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return torch.empty((), dtype=dtype).element_size()


def _nbytes(spec: Spec) -> int:
    total = 0
    for _, dtype, shape in spec:
        n = _itemsize(dtype)
        for d in shape:
            n *= d
        total += n
    return total


def _read_header(f, key: str, spec: Spec, size: int) -> bool:
    if f.read(len(MAGIC)) != MAGIC:
        return False
    hlen = int.from_bytes(f.read(_LEN), "little")
    if hlen <= 0 or hlen > MAX_HEADER or len(MAGIC) + _LEN + hlen + _nbytes(spec) != size:
        return False
    header = json.loads(f.read(hlen))
    tensors = [(n, d, tuple(s)) for n, d, s in header["tensors"]]
    expected = len(MAGIC) + _LEN + hlen + _nbytes(spec)
    return header["key"] == key and tensors == list(spec) and size == expected


def _open_regular(path: str) -> tuple[BinaryIO, int]:
    """`path` opened for reading, and its size; OSError unless it is a regular file (opened
    without blocking: a FIFO would wait for a writer)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


def check_block(path: str, key: str, spec: Spec) -> bool:
    """Is `path` a whole block file for `key` with exactly `spec`'s tensors? (Header only.)"""
    try:
        f, size = _open_regular(path)
        with f:
            return _read_header(f, key, spec, size)
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return False


def read_block(path: str, key: str, spec: Spec) -> list[torch.Tensor] | None:
    """The block's tensors (CPU), or None when the file is not `check_block`'s whole file."""
    try:
        f, size = _open_regular(path)
        limit = len(MAGIC) + _LEN + MAX_HEADER + _nbytes(spec)
        with f:
            if size > limit:
                return None  # not read: no whole block file is this long
            data = f.read(limit + 1)  # (bounded: a writer may still be appending)
    except OSError:
        return None
    try:
        if not _read_header(io.BytesIO(data), key, spec, len(data)):
            return None
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    offset = len(MAGIC) + _LEN + int.from_bytes(data[len(MAGIC) : len(MAGIC) + _LEN], "little")
    buf = bytearray(data[offset:])  # writable: torch.frombuffer shares it
    out, pos = [], 0
    for _, dtype, shape in spec:
        n = _itemsize(dtype)
        for d in shape:
            n *= d
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=pos)
        out.append(raw.view(getattr(torch, dtype)).reshape(shape))
        pos += n
    return out


def write_block(path: str, key: str, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Write atomically: a temporary file in the same directory, then `os.replace`. The
    temporary name is random: producers on other hosts (same pid and thread id) may share the
    directory. Raises OSError (disk full, no permission); nothing is left behind then."""
    header = {
        "key": key,
        "tensors": [[name, dtype_name(t.dtype), list(t.shape)] for name, t in tensors],
    }
    raw = json.dumps(header).encode()
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + len(raw).to_bytes(_LEN, "little") + raw)
            for _, t in tensors:
                f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            with contextlib.suppress(OSError):
                os.remove(tmp)
