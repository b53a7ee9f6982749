"""Device and interpreter helpers shared by the kernel wrappers.

Plain Python and torch only: this module must stay importable without triton.
"""

from __future__ import annotations

import functools
import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# 8-bit KV caches: values stored as x / scale (saturated to the format's max), read as q * scale.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
KV_CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES

# (mantissa bits, exponent bias, largest finite value) of each fp8 format.
FP8_FORMATS = {torch.float8_e4m3fn: (3, 7, 448.0), torch.float8_e5m2: (2, 15, 57344.0)}


def is_interpreter() -> bool:
    """True when Triton runs kernels in its numpy interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Whether this process's kernels run in the interpreter: Triton reads TRITON_INTERPRET when a
# @triton.jit function is decorated, and the kernel modules decorate when they are imported,
# after this one. The wrappers' launch options read this (is_interpreter() reads the variable
# now: ~0.5 us a call on their hot path).
INTERPRETED = is_interpreter()


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; a nominal 8 off CUDA (interpreter runs)."""
    if device.type != "cuda":
        return 8
    index = device.index if device.index is not None else torch.cuda.current_device()
    return num_sms(index)


@functools.cache
def capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def check_fp8_readable(cache_dtype: torch.dtype, device: torch.device) -> None:
    """The attention kernel casts an e4m3 cache with Triton's fp8e4nv type, which exists from
    compute capability 8.9 (Ada, Hopper) on; e5m2 loads everywhere."""
    if cache_dtype != torch.float8_e4m3fn or device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = capability(index)
    check(
        (major, minor) >= (8, 9),
        f"an fp8 e4m3 KV cache needs compute capability 8.9+ (this GPU is {major}.{minor}): "
        "use kv_cache_dtype='fp8_e5m2' (torch.float8_e5m2) here",
    )


def check_kv_scales(cache_dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
    """Scales are an fp8 cache's alone: positive and finite there, exactly 1.0 elsewhere."""
    if cache_dtype in FP8_DTYPES:
        ok = all(0.0 < s < float("inf") for s in (k_scale, v_scale))
        if not ok:
            raise ValueError(
                f"k_scale / v_scale must be positive and finite, got {k_scale}, {v_scale}"
            )
    else:
        ok = k_scale == 1.0 and v_scale == 1.0
        if not ok:
            raise ValueError(
                f"k_scale / v_scale apply to fp8 caches only (cache dtype {cache_dtype})"
            )


def check(cond: bool, msg: str) -> None:
    """Raise ValueError(msg) unless cond: wrapper argument validation."""
    if not cond:
        raise ValueError(msg)


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


# The largest head size paged_attention takes (its tiles hold whole heads in registers; 512:
# Gemma 4's full-attention layers).
MAX_HEAD_DIM = 512
