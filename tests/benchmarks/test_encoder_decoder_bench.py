"""benchmarks/encoder_decoder.py end to end on a minuscule BART (no timings checked): the
record has its rates, the encoder's time was measured, and the timing hook is taken off."""

from __future__ import annotations

import json

from benchmarks import encoder_decoder


def test_runs_on_a_tiny_bart(tmp_path):
    from paged_engine.models.bart import BartForConditionalGeneration

    original = BartForConditionalGeneration.encode_cross
    out = tmp_path / "r.json"
    argv = ["--d-model", "32", "--layers", "1", "--heads", "2", "--max-positions", "64"]
    argv += ["--prompts", "3", "--min-len", "5", "--max-len", "20", "--max-tokens", "2"]
    argv += ["--repeats", "2", "--device", "cpu", "--work-dir", str(tmp_path)]
    encoder_decoder.main([*argv, "--out", str(out)])
    result = json.loads(out.read_text())
    assert len(result["runs"]) == 2 and result["same_tokens_each_run"]
    m = result["median"]
    assert m["prompt_tokens_per_s"] > 0 and m["output_tokens_per_s"] > 0 and m["cpu_s"] > 0
    assert 0 < m["encoder_s"] <= m["wall_s"] and 0 < m["encoder_share"] <= 1
    assert 0 < m["encoder_cpu_s"] <= m["cpu_s"]
    assert BartForConditionalGeneration.encode_cross is original
