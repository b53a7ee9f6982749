"""torch's intra-op threads on CPU: one per physical core this process may run on.

Hyper-threads share a core's vector units, so a second OpenMP thread per core only adds
spin-waiting to every matmul; extra threads over the allowed cores (containers, taskset) make
each parallel op wait for descheduled threads.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def allowed_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return set(range(os.cpu_count() or 1))


def physical_cores(
    cpus: set[int] | None = None, sysfs: Path = Path("/sys/devices/system/cpu")
) -> int:
    """Distinct (package, core) pairs among `cpus` (default: this process's affinity); the
    number of CPUs where the topology is not readable."""
    cpus = allowed_cpus() if cpus is None else cpus
    cores = set()
    for cpu in cpus:
        topo = sysfs / f"cpu{cpu}" / "topology"
        try:
            package = (topo / "physical_package_id").read_text().strip()
            core = (topo / "core_id").read_text().strip()
        except OSError:
            return len(cpus)
        cores.add((package, core))
    return max(1, len(cores))


def default_threads() -> int:
    """OMP_NUM_THREADS when the environment sets it (the standard way to limit OpenMP), else
    the physical cores."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(env) if env.isdigit() and int(env) > 0 else physical_cores()


def set_cpu_threads(num_threads: int | None) -> int:
    """Set torch's intra-op threads for the calling thread's OpenMP team (None:
    `default_threads()`); returns the number set."""
    n = default_threads() if num_threads is None else num_threads
    torch.set_num_threads(n)
    return n
