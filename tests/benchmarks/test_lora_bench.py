"""benchmarks/lora.py end to end on the tiny model (2 requests, a few tokens): every system runs,
the JSON names what was measured, and the guards hold; the guard logic itself flags failures."""

from __future__ import annotations

import json

from benchmarks import lora


def test_lora_bench_smallest_run(tiny_spec, tmp_path):
    argv = ["--device", "cpu", "--model-config", str(tiny_spec.path), "--requests", "2"]
    argv += ["--input-len", "6", "10", "--output-len", "3", "4"]
    argv += ["--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work")]
    assert lora.main(argv) == 0
    res = json.loads((tmp_path / "out" / "lora.json").read_text())
    assert res["complete"] and res["device"] == "cpu" and res["dtype"] == "float32"
    assert res["cuda_graphs"] is False and res["command"].startswith("python -m benchmarks.lora")
    assert res["workload"]["num_requests"] == 2 and "greedy" in res["workload"]["sampling"]
    assert res["lora"]["rank"] == 16 and len(res["lora"]["target_modules"]) == 7
    records = {r["key"]: r for r in res["records"]}
    assert list(records) == ["a", "b", "c", "d", "e"]
    for r in records.values():
        assert "error" not in r, r
        assert r["output_tokens_per_s"] > 0 and r["elapsed_s"] > 0 and r["vs_base"] > 0
        assert r["output_tokens"] == res["workload"]["output_tokens"]
        assert r["elapsed_runs_s"] == [r["elapsed_s"]]
    assert res["repeat"] == 1 and res["rounds_identical"] == list("abcde")
    assert records["a"]["vs_base"] == 1.0 and not records["a"]["enable_lora"]
    assert (records["d"]["max_loras"], records["e"]["max_loras"]) == (4, 2)
    assert records["e"]["engine"]["max_cpu_loras"] == 4
    checks = res["checks"]
    for name in ("unused_lora_equals_base", "one_adapter_applied", "four_adapters_applied"):
        assert checks[name]["ok"] is True and checks[name]["of"] == 2, checks[name]
    assert checks["unused_lora_equals_base"]["requests_differing"] == 0
    assert checks["four_adapters_applied"]["requests_differing"] == 2


def test_guards_flag_failures():
    same = [[1, 2], [3, 4], [5, 6]]
    res = lora.checks(
        {"a": same, "b": [[1, 2], [3, 9], [5, 6]], "c": same, "d": [[7], [8], [5, 6]]}
    )
    unused = res["unused_lora_equals_base"]
    assert unused["ok"] is False and unused["requests_differing"] == 1  # one token differs
    assert res["one_adapter_applied"]["ok"] is False  # no request changed
    assert res["four_adapters_applied"]["ok"] is True  # 2 of 3 changed
    assert "two_slots_vs_four_slots" not in res
    assert lora.checks({"a": same})["one_adapter_applied"]["ok"] is None  # (c) did not run


def test_rounds_keep_each_systems_fastest():
    best: dict[str, dict] = {}
    for key, elapsed, tok_s in [("a", 2.0, 10), ("b", 1.0, 40), ("a", 1.0, 20), ("b", 4.0, 5)]:
        lora.keep_fastest(best, {"key": key, "elapsed_s": elapsed, "output_tokens_per_s": tok_s})
    a, b = lora.with_ratios(best)
    assert (a["elapsed_s"], a["elapsed_runs_s"], a["vs_base"]) == (1.0, [2.0, 1.0], 1.0)
    assert (b["elapsed_s"], b["elapsed_runs_s"], b["vs_base"]) == (1.0, [1.0, 4.0], 2.0)
