"""GGUF container reader: header, metadata key/values, tensor infos, memory-mapped tensor data.

Layout (little-endian, version 2/3): magic "GGUF", u32 version, u64 tensor_count, u64 kv_count;
kv_count x (string key, u32 type, value); tensor_count x (string name, u32 n_dims,
u64 dims[n_dims] innermost first, u32 ggml type, u64 offset); padding to `general.alignment`
(default 32); tensor data, each tensor at data_start + offset.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format (8 = string, 9 = array are special)
_SCALAR_TYPES: dict[int, struct.Struct] = {
    t: struct.Struct("<" + c)
    for t, c in {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
                 10: "Q", 11: "q", 12: "d"}.items()
}  # fmt: skip
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS


@dataclass(slots=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major (PyTorch order): the GGUF dims reversed
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """A parsed GGUF file. `metadata` holds plain Python values (lists for arrays)."""

    def __init__(self, path: str | Path) -> None:
        from paged_engine.checkpoint_checks import check_disjoint
        from paged_engine.gguf.dequant import GGML_TYPES, tensor_nbytes

        self.path = Path(path)
        if self.path.stat().st_size < 4:
            raise ValueError(f"{self.path} is not a GGUF file (shorter than its magic)")
        with open(self.path, "rb") as fh:
            self._mmap = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self._data = np.frombuffer(self._mmap, dtype=np.uint8)  # zero-copy, read-only
        self._pos = 0
        if self._mmap[:4] != GGUF_MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (bad magic)")
        self._pos = 4
        self.version = self._scalar(4)
        if self.version not in (2, 3):
            raise ValueError(f"{self.path}: unsupported GGUF version {self.version}")
        tensor_count, kv_count = self._scalar(10), self._scalar(10)
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):  # a count past the file's end stops at its first short read
            key = self._string()
            if key in self.metadata:
                raise ValueError(f"{self.path}: duplicate GGUF metadata key {key!r}")
            self.metadata[key] = self._value(self._scalar(4))
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            n_dims = self._scalar(4)
            if n_dims > _MAX_DIMS:
                raise ValueError(f"{self.path}: tensor {name!r} has {n_dims} dimensions")
            dims = [self._scalar(10) for _ in range(n_dims)]
            infos.append((name, tuple(reversed(dims)), self._scalar(4), self._scalar(10)))
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        # llama.cpp's rule: a power of two
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: general.alignment {alignment!r} is not a power of two")
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape, ggml_type, offset in infos:
            if name in self.tensors:
                raise ValueError(f"{self.path}: duplicate GGUF tensor {name!r}")
            if ggml_type not in GGML_TYPES:
                raise ValueError(f"{self.path}: tensor {name!r} has unknown ggml type {ggml_type}")
            if offset % alignment:
                raise ValueError(
                    f"{self.path}: tensor {name!r} offset {offset} is not a multiple of the "
                    f"alignment {alignment}"
                )
            block = GGML_TYPES[ggml_type][1]
            if shape and shape[-1] % block:  # ggml's rule: rows of whole blocks
                raise ValueError(
                    f"{self.path}: tensor {name!r} has rows of {shape[-1]} values, not whole "
                    f"{block}-value blocks of its ggml type"
                )
            try:
                nbytes = tensor_nbytes(ggml_type, shape)
            except ValueError as e:
                raise ValueError(f"{self.path}: tensor {name!r}: {e}") from None
            start = data_start + offset
            if start + nbytes > len(self._data):
                raise ValueError(f"{self.path}: tensor {name} runs past the end of the file")
            self.tensors[name] = GGUFTensorInfo(name, shape, ggml_type, start, nbytes)
        # [offset, offset + nbytes) ranges must not overlap (llama.cpp lays them end to end)
        spans = [(t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values()]
        check_disjoint(spans, self.path)

    # -- metadata parsing: a cursor over the memory map --------------------------------------
    def _read(self, n: int) -> bytes:
        if self._pos + n > len(self._mmap):
            raise ValueError(f"{self.path}: truncated GGUF header")
        out = self._mmap[self._pos : self._pos + n]
        self._pos += n
        return out

    def _scalar(self, vtype: int) -> Any:
        st = _SCALAR_TYPES[vtype]
        if self._pos + st.size > len(self._mmap):
            raise ValueError(f"{self.path}: truncated GGUF header")
        (value,) = st.unpack_from(self._mmap, self._pos)
        self._pos += st.size
        return value

    def _string(self) -> str:
        return self._read(self._scalar(10)).decode("utf-8", errors="replace")

    def _strings(self, count: int) -> list[str]:
        mm, pos, unpack, out = self._mmap, self._pos, _SCALAR_TYPES[10].unpack_from, []
        size = len(mm)
        if count > (size - pos) // 8:  # each string takes at least its 8-byte length
            raise ValueError(f"{self.path}: truncated GGUF header")
        for _ in range(count):
            if pos + 8 > size:
                raise ValueError(f"{self.path}: truncated GGUF header")
            (n,) = unpack(mm, pos)
            if n > size - pos - 8:
                raise ValueError(f"{self.path}: truncated GGUF header")
            out.append(mm[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace"))
            pos += 8 + n
        self._pos = pos
        return out

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._scalar(4), self._scalar(10)
            if etype in _SCALAR_TYPES:  # one vectorized read
                dt = np.dtype(_SCALAR_TYPES[etype].format)
                return np.frombuffer(self._read(dt.itemsize * count), dtype=dt).tolist()
            if etype == _STRING:  # hot: vocabularies and merges hold ~10^5 strings
                return self._strings(count)
            if count > len(self._mmap) - self._pos:  # every value takes at least one byte
                raise ValueError(f"{self.path}: truncated GGUF header")
            return [self._value(etype) for _ in range(count)]
        if vtype not in _SCALAR_TYPES:
            raise ValueError(f"{self.path}: unknown GGUF metadata type {vtype}")
        return self._scalar(vtype)

    # -- tensors --------------------------------------------------------------------------------
    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, zero-copy from the memory map."""
        info = self.tensors[name]
        return self._data[info.offset : info.offset + info.nbytes]

    def tensor(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32 (F16/BF16 kept exact), shaped `info.shape`."""
        from paged_engine.gguf.dequant import dequantize

        info = self.tensors[name]
        try:
            return dequantize(self.raw(name), info.ggml_type, info.shape)
        except ValueError as e:  # a type we read but cannot dequantize (I32, Q8_K, IQ2_XXS)
            raise ValueError(f"{self.path}: tensor {name!r}: {e}") from None

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)
