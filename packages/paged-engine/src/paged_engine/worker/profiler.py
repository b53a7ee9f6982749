"""torch.profiler traces of a running engine on request: vLLM's `start_profile` / `stop_profile`.

Enabled by a trace directory in the environment, read when a worker starts:

    PAGED_TORCH_PROFILER_DIR (or vLLM's VLLM_TORCH_PROFILER_DIR)   where traces go
    ..._RECORD_SHAPES, ..._WITH_STACK, ..._WITH_PROFILE_MEMORY, ..._WITH_FLOPS
                                                   1 / 0: the profiler's options (stacks on)

Between `start()` and `stop()` every rank records its process's CPU ops (and CUDA kernels on a
GPU); `stop()` writes one gzipped Chrome trace per rank, `rank{R}.{pid}.{time}-{n}.pt.trace.json.gz`
(`<profile_prefix>_tp{R}-{n}.pt.trace.json.gz` when start_profile named a prefix)
(Perfetto and chrome://tracing open it as it is). Only for development: a trace of a few
requests runs to tens of megabytes, and recording slows every step.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

PREFIXES = ("PAGED_", "VLLM_")
# torch.profiler records a whole process and cannot run twice at once in one (it crashes):
# the profiler of whichever engine in this process is recording, else None.
_RECORDING: WorkerProfiler | None = None
DIR_ENV = "PAGED_TORCH_PROFILER_DIR"


def _env(name: str) -> str | None:
    """TORCH_PROFILER_<name>, PAGED_ first; None when neither prefix sets it (an empty
    value counts as unset)."""
    for prefix in PREFIXES:
        value = os.environ.get(f"{prefix}TORCH_PROFILER_{name}")
        if value:
            return value
    return None


def _flag(name: str, default: bool) -> bool:
    value = _env(name)
    if value is None:
        return default
    if value.strip().lower() not in ("0", "1", "true", "false"):
        raise ValueError(f"{PREFIXES[0]}TORCH_PROFILER_{name}={value!r}: expected 1 or 0")
    return value.strip().lower() in ("1", "true")


def profiler_dir() -> str | None:
    """The trace directory the environment names, or None (profiling off)."""
    return _env("DIR")


class WorkerProfiler:
    """One rank's profiler: `start()`, then `stop()` -> the trace file it wrote."""

    def __init__(self, directory: str, rank: int, device: torch.device) -> None:
        self.directory = Path(directory).expanduser().resolve()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.options = {
            "record_shapes": _flag("RECORD_SHAPES", False),
            "with_stack": _flag("WITH_STACK", True),
            "profile_memory": _flag("WITH_PROFILE_MEMORY", False),
            "with_flops": _flag("WITH_FLOPS", False),
        }
        self._running: torch.profiler.profile | None = None
        self._traces = 0  # traces written: part of each file name, unique within the process
        self._prefix: str | None = None  # the running trace's file-name prefix

    @classmethod
    def from_env(cls, rank: int, device: torch.device) -> WorkerProfiler | None:
        directory = profiler_dir()
        return None if directory is None else cls(directory, rank, device)

    def start(self, prefix: str | None = None) -> None:
        """`prefix` (vLLM's profile_prefix): the trace file is `<prefix>_tp<rank>-<n>...`."""
        global _RECORDING
        if self._running is not None:
            raise RuntimeError("the profiler is already running: stop_profile() first")
        if _RECORDING is not None:
            raise RuntimeError(
                "another engine in this process is profiling (torch.profiler records one "
                "session per process): stop its profile first"
            )
        prof = torch.profiler.profile(activities=self.activities, **self.options)
        prof.start()
        self._running, _RECORDING = prof, self
        self._prefix = prefix

    def stop(self) -> str:
        """Stop recording and write this rank's trace; returns its path."""
        prof = self._running
        if prof is None:
            raise RuntimeError("the profiler is not running: start_profile() first")
        global _RECORDING
        self._running, _RECORDING = None, None
        prof.stop()
        self._traces += 1
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = f"rank{self.rank}.{os.getpid()}.{stamp}-{self._traces}.pt.trace.json.gz"
        if self._prefix is not None:
            name = f"{self._prefix}_tp{self.rank}-{self._traces}.pt.trace.json.gz"
        path = self.directory / name
        prof.export_chrome_trace(str(path))  # gzipped (the name ends in .gz)
        return str(path)
