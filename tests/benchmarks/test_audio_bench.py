"""benchmarks/audio.py's harness on its `tiny` preset (one-layer, 64-wide Whisper and Qwen2-Audio
built from the committed configs; no timing checked): every section runs both systems, the JSON
names what was measured, both systems get the same prompt ids and features (float32 greedy
outputs equal), and the guards flag sequences of the wrong prompt or length."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers.models.whisper")
pytest.importorskip("transformers.models.qwen2_audio")

from benchmarks import audio


def test_tiny_preset_end_to_end(tmp_path):
    out = tmp_path / "out"
    argv = ["--preset", "tiny", "--device", "cpu", "--out", str(out)]
    assert audio.main([*argv, "--work-dir", str(tmp_path / "work")]) == 0
    res = json.loads((out / "audio.json").read_text())
    assert res["complete"] and res["dtype"] == "float32" and res["preset"] == "tiny"
    assert res["command"].startswith("python -m benchmarks.audio --preset tiny")
    assert set(res["load_avg"]) == {"before", "after"} and res["env"]["cpu_count"] >= 1
    tiny = audio.PRESETS["tiny"]
    sizes = {
        "whisper": (tiny.clips, tiny.max_tokens),
        "llm": (tiny.llm_clips, tiny.llm_max_tokens),
        "encoder": (tiny.clips, 0),
    }
    assert list(res["sections"]) == ["whisper", "llm", "encoder"]
    for name, (clips, max_tokens) in sizes.items():
        sec = res["sections"][name]
        assert "error" not in sec, sec
        paged, hf = sec["records"]
        assert paged["system"] == "paged" and hf["system"].startswith("hf")
        assert paged["vs_hf"] > 0 and hf["batch_size"] == tiny.hf_batch_size
        for r in (paged, hf):
            assert r["num_clips"] == clips and r["clips_per_s"] > 0 and r["audio_seconds"] > 0
            assert r.get("output_tokens", 0) == clips * max_tokens
        for check in sec.get("checks", {}).values():
            assert check["ok"] in (True, None), sec["checks"]
        if name != "encoder":  # the same ids and features: float32 greedy tokens agree
            assert sec["checks"]["greedy_outputs_equal"]["equal"] == clips
            # and the first logprobs (the tiny models' tokens repeat; these tell clips apart)
            lps = sec["checks"]["first_token_logprobs"]
            assert lps["of"] == min(clips, audio.CHECKED) and lps["max_abs_diff"] < 1e-3
    assert res["sections"]["whisper"]["model"]["config"] == "benchmarks/configs/whisper-tiny"
    assert res["sections"]["llm"]["prompt_tokens"] > 16 * tiny.llm_clips  # audio runs expanded
    assert (out / "audio.png").stat().st_size > 0


def test_checks_flag_wrong_prompts_and_lengths():
    prompts = [[1, 2], [3]]
    good = [[1, 2, 7, 7], [3, 7, 7]]
    res = audio.checks(good, good, prompts, None, 2)
    assert res["paged_prompts_and_lengths"]["ok"] and res["hf_prompts_and_lengths"]["ok"]
    assert res["greedy_outputs_equal"] == {"ok": None, "equal": 2, "of": 2}
    short = [[1, 2, 7], [3, 7, 7]]
    other_prompt = [[1, 9, 7, 7], [3, 7, 7]]
    res = audio.checks(short, other_prompt, prompts, None, 2)
    assert res["paged_prompts_and_lengths"]["ok"] is False
    assert res["hf_prompts_and_lengths"]["ok"] is False
    assert res["greedy_outputs_equal"]["equal"] == 1
    # Whisper's form: one fixed sequence length for every clip
    assert audio.checks([[1, 2, 5]], [[1, 2, 5]], [[1, 2]], 3, None)["hf_prompts_and_lengths"]["ok"]


def test_whisper_prefix_from_the_real_configs():
    """<|startoftranscript|><|en|><|transcribe|><|notimestamps|> as the released tokenizers
    number them (large-v3 added <|yue|>, moving the task and timestamp ids by one)."""
    for name, want in [
        ("whisper-large-v3", [50258, 50259, 50360, 50364]),
        ("whisper-tiny", [50258, 50259, 50359, 50363]),
    ]:
        cfg = json.loads((audio.CONFIG_DIR / name / "config.json").read_text())
        assert audio.whisper_prefix(cfg) == want


def test_clips_and_arguments():
    a, b = audio.speech_clip(3, 1.5), audio.speech_clip(3, 1.5)
    assert a.dtype == np.float32 and a.size == 24_000 and np.array_equal(a, b)
    assert 0.4 < np.abs(a).max() <= 0.5 and not np.array_equal(a, audio.speech_clip(4, 1.5))
    bad_args = (["--clips", "0"], ["--seconds", "5", "31"], ["--llm-seconds", "3", "2"])
    for bad in (*bad_args, ["--whisper-config", "nope"]):
        with pytest.raises(SystemExit):
            audio.parse_args(bad)
    args = audio.parse_args(["--preset", "cpu", "--clips", "5", "--seconds", "2", "3"])
    p = audio.resolve_preset(args, "cpu")
    assert (p.clips, p.seconds, p.llm) == (5, (2.0, 3.0), "qwen2-audio-7b")
    assert p.llm_overrides == audio.QWEN2_AUDIO_CPU
