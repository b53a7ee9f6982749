"""Shared pieces: the throughput record, timing, environment facts, process isolation."""

from __future__ import annotations

import gc
import json
import multiprocessing
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.workloads import Workload


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def now(device: str) -> float:
    sync(device)
    return time.perf_counter()


def cpu_seconds() -> float:
    """User + system CPU time of this process, all its threads (the CPU-second denominator)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def throughput_record(
    system: str, wl: Workload, elapsed_s: float, cpu_s: float | None = None, **extra: Any
) -> dict:
    """requests/s, total tokens/s (prompt + output) and output tokens/s of one timed run, and
    output tokens per CPU-second when `cpu_s` (the run's CPU time) is given.

    Output tokens are the requested ones (sum of max_tokens, ignore_eos): tokens a static batch
    generates past a request's own max_tokens (padding) are not counted.
    """
    if cpu_s is not None:
        extra = {
            "cpu_s": round(cpu_s, 3),
            "output_tokens_per_cpu_s": round(wl.output_tokens / cpu_s, 2),
            **extra,
        }
    return {
        "system": system,
        "workload": wl.name,
        "workload_desc": wl.describe(),
        "num_requests": wl.num_requests,
        "prompt_tokens": wl.prompt_tokens,
        "output_tokens": wl.output_tokens,
        "elapsed_s": round(elapsed_s, 4),
        "requests_per_s": round(wl.num_requests / elapsed_s, 4),
        "total_tokens_per_s": round((wl.prompt_tokens + wl.output_tokens) / elapsed_s, 2),
        "output_tokens_per_s": round(wl.output_tokens / elapsed_s, 2),
        **extra,
    }


def environment(device: str) -> dict:
    """Versions and hardware, stated next to every number."""
    import transformers

    env = {
        "device": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": _cpu_count(),
        "platform": platform.platform(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        env["cuda"] = torch.version.cuda
    for pkg in ("paged_engine", "paged_kernels", "paged_server"):
        try:
            env[pkg] = __import__(pkg).__version__
        except (ImportError, AttributeError):
            env[pkg] = None
    return env


def write_result(path: Path, result: dict) -> None:
    """A benchmark's JSON record, its folder made if need be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


def _cpu_count() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _call(fn: Callable, args: tuple, kwargs: dict) -> Any:
    return fn(*args, **kwargs)


def call(fn: Callable, *args: Any, isolate: bool = False, **kwargs: Any) -> Any:
    """Run `fn`, in a fresh spawned process when `isolate` (each system gets the whole GPU)."""
    if not isolate:
        try:
            return fn(*args, **kwargs)
        finally:
            free_memory("cuda" if torch.cuda.is_available() else "cpu")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_call, (fn, args, kwargs))


def error_record(system: str, what: str, exc: BaseException) -> dict:
    return {"system": system, "workload": what, "error": f"{type(exc).__name__}: {exc}"}
