"""torch intra-op threads on CPU: physical cores by default, `cpu_num_threads` to choose."""

from __future__ import annotations

import pytest
import torch

from paged_engine import LLM, EngineConfig
from paged_engine.worker.cpu_threads import physical_cores


def write_topology(root, cpus: dict[int, tuple[int, int]]) -> None:
    for cpu, (package, core) in cpus.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")


def test_physical_cores_counts_hyperthread_siblings_once(tmp_path):
    # cpus 0/2 and 1/3 are sibling pairs of one package; 4 sits alone on a second package
    write_topology(tmp_path, {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1), 4: (1, 0)})
    assert physical_cores({0, 1, 2, 3, 4}, tmp_path) == 3
    assert physical_cores({0, 2}, tmp_path) == 1  # the affinity allows one core's two threads
    assert physical_cores({0, 9}, tmp_path) == 2  # unreadable topology: count the CPUs


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_cpu_num_threads_is_validated(bad):
    with pytest.raises(ValueError, match="cpu_num_threads"):
        EngineConfig(cpu_num_threads=bad)


def test_engine_sets_threads_on_its_thread(tiny_llama_dir, monkeypatch):
    before = torch.get_num_threads()
    kw = dict(model=str(tiny_llama_dir), device="cpu", async_scheduling=False)
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        LLM(cpu_num_threads=1, **kw)
        assert torch.get_num_threads() == 1
        LLM(**kw)
        assert torch.get_num_threads() == physical_cores()
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        LLM(**kw)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
