"""Process checks shared by the tests of worker ranks (Linux /proc)."""

from __future__ import annotations

import time


def pid_running(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    """Wait until none of `pids` runs; returns those still running at the timeout."""
    deadline = time.monotonic() + timeout
    while any(map(pid_running, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if pid_running(p)]
