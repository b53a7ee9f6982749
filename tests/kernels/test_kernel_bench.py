"""benchmarks.kernel_bench smoke mode writes its JSON (on CPU: tiny interpreter shapes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root: `benchmarks` package
from benchmarks import kernel_bench


def test_kernel_bench_smoke(tmp_path):
    report = kernel_bench.run(smoke=True, out_dir=tmp_path)
    saved = json.loads((tmp_path / "kernel_bench.json").read_text())
    assert saved["results"] and len(saved["results"]) == len(report["results"])
    for row in saved["results"]:
        assert row["paged_ms"] > 0 and row["sdpa_ms"] > 0
        assert row["max_abs_diff_vs_sdpa"] < 5e-2
    assert saved["meaningful"] == kernel_bench.HAS_CUDA
    race = saved["sampler_race"]  # the sampler's one-pass race beside torch's
    assert race and all(r["gumbel_race_ms"] > 0 and r["torch_race_ms"] > 0 for r in race)


def test_split_sweep_smoke(tmp_path):
    """--split-sweep: every forced split count timed at each shape, beside the heuristic's pick."""
    kernel_bench.main(["--split-sweep", "--smoke", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "split_sweep.json").read_text())
    assert rows
    for row in rows:
        assert row["heuristic"] >= 1
        assert all(row[f"splits_{s}_ms"] > 0 for s in (1, 2, 4, 8))


def test_tile_sweep_smoke(tmp_path):
    """--tile-sweep: each (BLOCK_N, warps, stages) timed at each shape beside the default tile,
    the best named; the default tile is back in place afterwards."""
    from paged_kernels import attention

    default = attention._tile_config
    kernel_bench.main(["--tile-sweep", "--smoke", "--out", str(tmp_path)])
    assert attention._tile_config is default
    rows = json.loads((tmp_path / "tile_sweep.json").read_text())
    assert rows and all(len(r["configs"]) == 2 for r in rows)
    for row in rows:
        assert set(row["default"]) == {"block_n", "num_warps", "num_stages"}
        assert all(c["ms"] > 0 and c["of_copy_bw"] >= 0 for c in row["configs"])  # (tiny here)
        assert row["best"] in row["configs"]


def test_mla_sweep_smoke(tmp_path):
    """--mla-sweep: the defaults, each (heads a program, BLOCK_N, warps) unsplit and forced
    split counts, timed at each shape; `mla._tiles` is back in place afterwards."""
    from paged_kernels import mla

    default = mla._tiles
    kernel_bench.main(["--mla-sweep", "--smoke", "--out", str(tmp_path)])
    assert mla._tiles is default
    rows = json.loads((tmp_path / "mla_sweep.json").read_text())
    assert rows and all(len(r["configs"]) == 1 + 2 + 3 for r in rows)
    for row in rows:
        assert all(c["ms"] > 0 for c in row["configs"]), row["configs"]
        assert row["configs"][0]["heads_per_program"] is None  # the defaults first
        assert row["best"] in row["configs"]
