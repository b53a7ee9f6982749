"""paged-server's Hub options reach the engine config under vLLM's names: --revision,
--tokenizer, --tokenizer-revision, --download-dir (tests/engine/test_hub.py covers resolving)."""

from __future__ import annotations

import paged_engine
from paged_server.cli import build_engine, parse_args


def engine_config(monkeypatch, argv: list[str]):
    seen = {}
    monkeypatch.setattr(paged_engine, "LLMEngine", lambda config: seen.setdefault("c", config))
    build_engine(parse_args(argv))
    return seen["c"]


def test_hub_options_are_passed(monkeypatch):
    argv = ["--model", "Qwen/Qwen3-0.6B", "--revision", "v1", "--tokenizer", "org/tok"]
    argv += ["--tokenizer-revision", "abc", "--download-dir", "/tmp/hub", "--hf-token", "t0k"]
    config = engine_config(monkeypatch, argv)
    assert (config.model, config.revision, config.tokenizer) == ("Qwen/Qwen3-0.6B", "v1", "org/tok")
    assert (config.tokenizer_revision, config.download_dir) == ("abc", "/tmp/hub")
    assert config.hf_token == "t0k"


def test_hub_options_default_to_none(monkeypatch):
    config = engine_config(monkeypatch, ["m"])
    assert (config.revision, config.tokenizer, config.tokenizer_revision) == (None, None, None)
    assert config.download_dir is None
