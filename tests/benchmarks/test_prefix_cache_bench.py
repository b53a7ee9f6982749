"""benchmarks/prefix_cache.py end to end at a tiny size (no timings checked): with prefix
caching the later turns and requests take prompt tokens from the cache, without it none, and
the answers are the same."""

from __future__ import annotations

import json

from benchmarks import prefix_cache


def test_runs_on_tiny_models(tmp_path):
    out = tmp_path / "r.json"
    argv = ["--archs", "qwen3_5", "qwen3", "--hidden-size", "64", "--layers", "4"]
    argv += ["--device", "cpu"]
    argv += ["--conversations", "3", "--turns", "2", "--system-tokens", "40", "--max-tokens", "4"]
    prefix_cache.main([*argv, "--out", str(out)])
    records = json.loads(out.read_text())["records"]
    assert [(r["arch"], r["prefix_caching"]) for r in records] == [
        ("qwen3_5", False),
        ("qwen3_5", True),
        ("qwen3", False),
        ("qwen3", True),
    ]
    for off, on in zip(records[::2], records[1::2], strict=True):
        assert off["cached_prompt_tokens"] == 0 and on["cached_prompt_tokens"] > 0
        assert on["prompt_tokens"] == off["prompt_tokens"] and on["identical_answers"]
