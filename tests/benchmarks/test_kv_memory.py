"""benchmarks/kv_memory.py end to end on a tiny model (a handful of requests; no timings)."""

from __future__ import annotations

from benchmarks import kv_memory


def test_fp8_section(tmp_path):
    model = kv_memory.tiny_llama(tmp_path / "m", hidden=64, layers=2)
    res = kv_memory.run_fp8(model, "cpu", 2**-10, 4, ((20, 40), (5, 10)), backends=("cpu",))
    by_kv = {r["kv_cache_dtype"]: r for r in res["records"]}
    assert {r["attention_backend"] for r in res["records"]} == {"cpu"}
    assert set(by_kv) == {"auto", "fp8", "fp8_e5m2"}
    assert by_kv["fp8"]["blocks_vs_auto"] == 4.0  # float32 model: 4 bytes -> 1
    assert all(r["output_tokens_per_s"] > 0 and r["max_running_seqs"] >= 1 for r in by_kv.values())


def test_chat_section(tmp_path):
    model = kv_memory.tiny_llama(tmp_path / "m", hidden=64, layers=2)
    res = kv_memory.run_chat(model, "cpu", 12, 2**-11, 4, 3, 40, (10, 20), 4)
    assert res["outputs_identical"]
    none, tier = res["records"]
    assert none["prefix_cache_cpu_hit_tokens"] == 0 and tier["prefix_cache_cpu_hit_tokens"] > 0
    assert tier["prefix_cache_hit_rate"] > none["prefix_cache_hit_rate"]


def test_fp8_section_16bit(tmp_path):
    """A bfloat16 model: the cache is bfloat16, fp8 holds twice its blocks."""
    model = kv_memory.tiny_llama(tmp_path / "m", hidden=64, layers=2)
    res = kv_memory.run_fp8(
        model, "cpu", 2**-10, 4, ((20, 40), (5, 10)), backends=("cpu",), dtype="bfloat16"
    )
    by_kv = {r["kv_cache_dtype"]: r for r in res["records"]}
    assert by_kv["auto"]["cache_dtype"] == "bfloat16"
    assert by_kv["fp8"]["cache_dtype"] == "float8_e4m3fn"
    assert by_kv["fp8"]["blocks_vs_auto"] == by_kv["fp8_e5m2"]["blocks_vs_auto"] == 2.0


def test_swap_section(tmp_path):
    model = kv_memory.tiny_llama(tmp_path / "m", hidden=64, layers=2)
    res = kv_memory.run_swap(model, "cpu", 12, 6, ((40, 80), (10, 20)))  # float32: exact
    assert res["outputs_identical"]
    recompute, swap = res["records"]
    assert recompute["preemptions"] > 0 and recompute["swap_preemptions"] == 0
    assert swap["swap_preemptions"] == swap["preemptions"] > 0


def test_smoke_shortens_every_section(tmp_path):
    """--smoke: the fp8 / swap workload and the chat take short prompts and outputs (what
    gpu_run.sh's rehearsal runs on a CPU in seconds instead of minutes)."""
    out = tmp_path / "kv.json"
    res = kv_memory.main([
        "--smoke", "--hidden", "64", "--layers", "2", "--requests", "3", "--backends", "torch",
        "--sections", "fp8", "chat", "--convs", "2", "--turns", "2", "--out", str(out),
    ])  # fmt: skip
    assert "input 16-64 tokens, output 4-12 tokens" in res["fp8"]["workload"]
    assert "system prompt 40 tokens" in res["chat"]["workload"]
    assert "greedy replies of 4" in res["chat"]["workload"]
    assert out.exists() and res["chat"]["outputs_identical"]
