"""benchmarks/structured_overhead.py end to end on a tiny model (4 rows, 2 steps; no timings
checked): every workload runs with all rows, the constrained parts are timed only for the
constrained workloads, and the patched functions are restored; a slow grammar compiler (a loaded
machine) delays rows' starts without failing the run."""

from __future__ import annotations

import json
import time

import pytest

from benchmarks import structured_overhead

pytest.importorskip("llguidance")


@pytest.mark.parametrize("compile_delay", [0.0, 0.05])
def test_runs_on_a_tiny_model(tmp_path, monkeypatch, compile_delay):
    from paged_engine.core.engine_core import EngineCore
    from paged_engine.structured_output.manager import StructuredOutputManager
    from paged_engine.testing import write_tiny_model

    if compile_delay:  # the four schemas compile one after another: rows start ~50 ms apart
        compile_now = StructuredOutputManager._compile_now

        def slow(self, text):
            time.sleep(compile_delay)
            return compile_now(self, text)

        monkeypatch.setattr(StructuredOutputManager, "_compile_now", slow)

    model = write_tiny_model(tmp_path / "m", "llama")
    original = EngineCore._fill_token_bitmask
    out = tmp_path / "r.json"
    argv = ["--model", str(model), "--batch", "4", "--steps", "2", "--repeats", "1"]
    structured_overhead.main([*argv, "--out", str(out)])
    res = json.loads(out.read_text())
    assert EngineCore._fill_token_bitmask is original
    runs = {r["workload"]: r for r in res["runs"]}
    assert set(runs) == {"unconstrained", "json", "regex"}
    assert all(r["steps_timed"] == 2 for r in runs.values())
    assert runs["unconstrained"]["parts_ms_per_step"]["fill_bitmask"] == 0
    assert runs["json"]["parts_ms_per_step"]["fill_bitmask"] > 0
    assert set(res["summary"]) == {"unconstrained", "json", "regex"}
