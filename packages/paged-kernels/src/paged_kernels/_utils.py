"""Device and interpreter helpers shared by the kernel wrappers.

Plain Python and torch only: this module must stay importable without triton.
"""

from __future__ import annotations

import functools
import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_interpreter() -> bool:
    """True when Triton runs kernels in its numpy interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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


def check(cond: bool, msg: str) -> None:
    """Raise ValueError(msg) unless cond: wrapper argument validation."""
    if not cond:
        raise ValueError(msg)


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    check(t.stride(-1) == 1, f"{name} must be contiguous in its last dim, got strides {t.stride()}")
