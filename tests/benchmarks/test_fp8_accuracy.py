"""benchmarks/fp8_accuracy.py on one tiny architecture, a few positions (no thresholds)."""

from __future__ import annotations

import json

from benchmarks import fp8_accuracy


def test_fp8_accuracy_smoke(tmp_path):
    out = tmp_path / "r.json"
    fp8_accuracy.main(["--archs", "llama", "--prompts", "2", "--tokens", "4", "--kv", "fp8",
                       "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    runs = result["models"]["llama"]
    assert set(runs) == {"fp8/calibrated", "fp8/unit"}
    assert all(r["positions"] == 8 and 0 <= r["agree"] <= 8 for r in runs.values())
    assert runs["fp8/unit"]["k_scale_range"] == [1.0, 1.0]
    assert runs["fp8/calibrated"]["k_scale_range"] != [1.0, 1.0]
    assert set(result["tiny_architectures"]) == set(runs)
