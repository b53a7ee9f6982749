"""benchmarks/fp8_dequant.py on a tiny tile: every conversion runs and gives torch's values."""

from __future__ import annotations

import json

from benchmarks import fp8_dequant


def test_fp8_dequant_smoke(tmp_path):
    out = tmp_path / "r.json"
    fp8_dequant.main(["--slots", "256", "--seqs", "2", "--context", "16", "--iters", "2",
                      "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    for fmt in ("float8_e4m3fn", "float8_e5m2"):
        ways = result[fmt]
        assert all(w["ns_per_element"] > 0 for w in ways.values())
        assert all(w["exact"] for w in ways.values() if "exact" in w)
        assert "bits (fp8_to_float)" in ways
