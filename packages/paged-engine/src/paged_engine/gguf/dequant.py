"""Dequantizers for ggml tensor types, vectorized over blocks with numpy.

Block layouts (bytes, little-endian; d/m/dmin are float16):
  Q4_0 [d, qs:16]             32 values: (nibble - 8) * d; low nibbles are values 0..15
  Q4_1 [d, m, qs:16]          nibble * d + m
  Q5_0 [d, qh:u32, qs:16]     ((nibble | bit << 4) - 16) * d; bit j of qh belongs to value j
  Q5_1 [d, m, qh:u32, qs:16]  (nibble | bit << 4) * d + m
  Q8_0 [d, qs:i8 x 32]        q * d
  Q4_K [d, dmin, scales:12, qs:128]           256 values, 8 sub-blocks with 6-bit scale/min
  Q5_K [d, dmin, scales:12, qh:32, qs:128]    as Q4_K plus a fifth bit from qh
  Q6_K [ql:128, qh:64, scales:i8 x 16, d]     (6-bit q - 32) * d * scale, 16 sub-blocks of 16
  Q2_K [scales:16, qs:64, d, dmin]            2-bit q * d * (scale & 15) - dmin * (scale >> 4),
                                              16 sub-blocks of 16
  Q3_K [hmask:32, qs:64, scales:12, d]        (2-bit q - 4 * !high bit) * d * (6-bit scale - 32),
                                              16 sub-blocks of 16
  IQ4_NL [d, qs:16]                           32 values: d * IQ4_GRID[nibble] (low nibbles first)
  IQ4_XS [d, scales_h:u16, scales_l:4, qs:128]  256 values, 8 sub-blocks of 32:
                                              d * (6-bit scale - 32) * IQ4_GRID[nibble]
  MXFP4 [e:u8, qs:16]                         32 values: 2**(e - 128) * MXFP4_GRID[nibble]
                                              (E2M1 doubled, E8M0 scale halved; gpt-oss)

In the K-quants of 16 sub-blocks (Q2_K, Q3_K), value v of a block sits in sub-block v // 16, in
byte v % 32 of its 128-value half's 32 quant bytes, at bits 2 * (v % 128 // 32); Q3_K's high bit
of value v is bit 4 * (v // 128) + v % 128 // 32 of hmask byte v % 32.

numpy asks the kernel for huge pages on every large array (madvise). Where transparent huge pages
are on "madvise" with defrag "madvise" (common distribution defaults), the first such allocations
of a process can stall in memory compaction: ~1.4 s for the default model's 28M-value embedding
on our 2-core VM, against 0.1-0.2 s without. Dequantizing makes short-lived arrays in one pass,
which huge pages do not speed up, so `dequantize` asks for none meanwhile.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from math import prod

import numpy as np
import torch

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16 = 0, 1, 2, 3, 6, 7, 8, 30
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4 = 10, 11, 12, 13, 14, 20, 23, 39

# the 16 levels of IQ4_NL / IQ4_XS (ggml's kvalues_iq4nl), a nibble's value before the scale
IQ4_GRID = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32
)

# MXFP4's E2M1 values, doubled (ggml's kvalues_mxfp4): the sign is the nibble's top bit
MXFP4_GRID = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)

# ggml type -> (name, values per block, bytes per block); the dequantizable ones and a few more
# that only need sizes so a file using them still parses.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}  # fmt: skip


def type_name(ggml_type: int) -> str:
    return GGML_TYPES.get(ggml_type, (f"type#{ggml_type}",))[0]


def tensor_nbytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    if ggml_type not in GGML_TYPES:
        raise ValueError(f"unknown ggml tensor type {ggml_type}")
    _, block, nbytes = GGML_TYPES[ggml_type]
    n = prod(shape)
    if n % block:
        raise ValueError(f"{type_name(ggml_type)} tensor of shape {shape} is not whole blocks")
    return n // block * nbytes


def _f16(cols: np.ndarray) -> np.ndarray:  # [nb, 2] uint8 -> [nb, 1] float32
    return np.ascontiguousarray(cols).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:  # [nb, 16] -> [nb, 32]: low nibbles, then high
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _bits32(qh: np.ndarray) -> np.ndarray:  # [nb, 4] uint8 -> [nb, 32] bit j of the u32
    word = np.ascontiguousarray(qh).view("<u4")  # [nb, 1]
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _q4_0(b):
    return _f16(b[:, 0:2]) * (_nibbles(b[:, 2:18]).astype(np.float32) - 8)


def _q4_1(b):
    return _f16(b[:, 0:2]) * _nibbles(b[:, 4:20]).astype(np.float32) + _f16(b[:, 2:4])


def _q5_0(b):
    q = _nibbles(b[:, 6:22]) | (_bits32(b[:, 2:6]) << 4)
    return _f16(b[:, 0:2]) * (q.astype(np.float32) - 16)


def _q5_1(b):
    q = _nibbles(b[:, 8:24]) | (_bits32(b[:, 4:8]) << 4)
    return _f16(b[:, 0:2]) * q.astype(np.float32) + _f16(b[:, 2:4])


def _q8_0(b):
    return _f16(b[:, 0:2]) * np.ascontiguousarray(b[:, 2:34]).view(np.int8).astype(np.float32)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 packed bytes -> 8 six-bit scales and 8 six-bit mins: [nb, 8] each."""
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """[nb, 128] -> [nb, 8, 32]: 32-byte chunk c gives sub-block 2c (low) and 2c+1 (high)."""
    ql = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 8, 32)


def _q4_k(b):
    sc, mn = _k_scales(b[:, 4:16])
    q = _k_nibbles(b[:, 16:144]).astype(np.float32)
    d, dmin = _f16(b[:, 0:2])[:, :, None], _f16(b[:, 2:4])[:, :, None]
    return (d * sc[:, :, None] * q - dmin * mn[:, :, None]).reshape(-1, 256)


def _q5_k(b):
    sc, mn = _k_scales(b[:, 4:16])
    qh = b[:, 16:48][:, None, :]  # bit k of qh[l] is the fifth bit of sub-block k, value l
    high = (qh >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q = (_k_nibbles(b[:, 48:176]) | (high << 4)).astype(np.float32)
    d, dmin = _f16(b[:, 0:2])[:, :, None], _f16(b[:, 2:4])[:, :, None]
    return (d * sc[:, :, None] * q - dmin * mn[:, :, None]).reshape(-1, 256)


def _q6_k(b):
    ql = b[:, 0:128].reshape(-1, 2, 64)  # per half of 128 values
    qh = b[:, 128:192].reshape(-1, 2, 32)
    lo, hi = ql[..., :32], ql[..., 32:]
    q = (
        np.stack(
            [
                (lo & 0x0F) | ((qh & 3) << 4),
                (hi & 0x0F) | (((qh >> 2) & 3) << 4),
                (lo >> 4) | (((qh >> 4) & 3) << 4),
                (hi >> 4) | (((qh >> 6) & 3) << 4),
            ],
            axis=2,
        ).astype(np.float32)
        - 32
    )  # [nb, 2 halves, 4 quarters, 32]
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32).reshape(-1, 2, 4, 2)
    d = _f16(b[:, 208:210]).reshape(-1, 1, 1, 1, 1)
    return (d * sc[..., None] * q.reshape(-1, 2, 4, 2, 16)).reshape(-1, 256)


def _two_bits(qs: np.ndarray) -> np.ndarray:
    """[nb, 64] -> [nb, 256]: each 128-value half's 32 bytes give 4 runs of 32 values, bits
    0-1 first, then 2-3, 4-5, 6-7."""
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    return ((qs.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 256)


def _q2_k(b):
    sc = b[:, 0:16]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])  # [nb, 1]
    scale, low = d * (sc & 0x0F).astype(np.float32), dmin * (sc >> 4).astype(np.float32)
    q = _two_bits(b[:, 16:80]).astype(np.float32).reshape(-1, 16, 16)
    return (scale[:, :, None] * q - low[:, :, None]).reshape(-1, 256)


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """12 packed bytes -> 16 six-bit scales, 32 subtracted: [nb, 16]. Scale k has its low four
    bits in a nibble of byte k % 8 (low nibble for k < 8) and its top two bits in byte 8 + k % 4,
    at bits 2 * (k // 4)."""
    low = np.concatenate([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], axis=1)
    high = (s[:, 8:12][:, None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, :, None]) & 3
    return (low | (high.reshape(-1, 16) << 4)).astype(np.float32) - 32


def _q3_k(b):
    high_bit = (b[:, 0:32][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q = _two_bits(b[:, 32:96]).astype(np.float32) - 4 * (1 - high_bit.reshape(-1, 256))
    scale = _f16(b[:, 108:110]) * _q3_k_scales(b[:, 96:108])  # [nb, 16]
    return (scale[:, :, None] * q.reshape(-1, 16, 16)).reshape(-1, 256)


def _iq4_nl(b):
    return _f16(b[:, 0:2]) * IQ4_GRID[_nibbles(b[:, 2:18])]


def _iq4_xs(b):
    high = np.ascontiguousarray(b[:, 2:4]).view("<u2")  # [nb, 1]: 2 bits per sub-block
    high = (high >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [nb, 8]
    low = np.stack([b[:, 4:8] & 0x0F, b[:, 4:8] >> 4], axis=2).reshape(-1, 8)
    scale = _f16(b[:, 0:2]) * ((low | (high << 4)).astype(np.float32) - 32)  # [nb, 8]
    q = IQ4_GRID[_nibbles(b[:, 8:136].reshape(-1, 16)).reshape(-1, 8, 32)]
    return (scale[:, :, None] * q).reshape(-1, 256)


def _mxfp4(b):
    scale = np.ldexp(np.float32(1), b[:, 0:1].astype(np.int32) - 128)  # exact, subnormals too
    return scale * MXFP4_GRID[_nibbles(b[:, 1:17])]


_BLOCK_DEQUANT = {
    Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1, Q8_0: _q8_0,
    Q2_K: _q2_k, Q3_K: _q3_k, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k,
    IQ4_NL: _iq4_nl, IQ4_XS: _iq4_xs, MXFP4: _mxfp4,
}  # fmt: skip


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """raw bytes (uint8) of one tensor -> a CPU tensor of `shape`.

    F32/F16/BF16 keep their dtype (copied out of the memory map); quantized types -> float32.
    """
    if ggml_type == F32:
        return torch.from_numpy(np.array(raw).view(np.float32).reshape(shape))
    if ggml_type == F16:
        return torch.from_numpy(np.array(raw).view(np.float16).reshape(shape))
    if ggml_type == BF16:
        return torch.from_numpy(np.array(raw).view(np.int16).reshape(shape)).view(torch.bfloat16)
    fn = _BLOCK_DEQUANT.get(ggml_type)
    if fn is None:
        supported = ", ".join(type_name(t) for t in (F32, F16, BF16, *_BLOCK_DEQUANT))
        raise ValueError(
            f"cannot dequantize ggml type {type_name(ggml_type)}; supported: {supported}"
        )
    _, _, block_bytes = GGML_TYPES[ggml_type]
    blocks = np.asarray(raw).reshape(-1, block_bytes)
    with _small_pages():
        return torch.from_numpy(fn(blocks).reshape(shape))


_set_madvise_hugepage = getattr(
    getattr(np, "_core", getattr(np, "core", None)).multiarray, "_set_madvise_hugepage", None
)
_pages_lock = threading.Lock()
_pages_users = 0  # threads inside _small_pages
_pages_saved = True  # numpy's setting before the first of them entered


@contextlib.contextmanager
def _small_pages() -> Iterator[None]:
    """numpy's huge-page requests off while any thread is inside (see the module docstring);
    the process's own setting is back once the last one leaves."""
    global _pages_users, _pages_saved
    if _set_madvise_hugepage is None:  # a numpy without the switch
        yield
        return
    with _pages_lock:
        if _pages_users == 0:
            _pages_saved = _set_madvise_hugepage(False)  # returns the previous setting
        _pages_users += 1
    try:
        yield
    finally:
        with _pages_lock:
            _pages_users -= 1
            if _pages_users == 0:
                _set_madvise_hugepage(_pages_saved)
