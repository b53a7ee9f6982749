"""start_profile / stop_profile (vLLM's): torch.profiler traces of the engine, one gzipped
Chrome trace per rank in the directory the environment names; clear errors otherwise, and the
engine goes on serving."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from paged_engine import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 6, 7]}


def _llm(model_dir: Path) -> LLM:
    return LLM(model=str(model_dir), device="cpu", dtype="float32", max_model_len=64)


def _tokens(llm: LLM) -> list[int]:
    return list(llm.generate([PROMPT], PARAMS, use_tqdm=False)[0].outputs[0].token_ids)


def test_a_profiled_run_writes_a_trace_of_the_engine_step(
    tiny_llama_dir, tmp_path, monkeypatch
) -> None:
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.setenv("PAGED_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    monkeypatch.setenv("PAGED_TORCH_PROFILER_WITH_STACK", "0")
    llm = _llm(tiny_llama_dir)
    want = _tokens(llm)
    llm.start_profile()
    with pytest.raises(RuntimeError, match="already running"):
        llm.start_profile()
    assert _tokens(llm) == want  # profiling changes no output
    paths = llm.stop_profile()
    assert len(paths) == 1 and Path(paths[0]).parent == tmp_path / "traces"
    assert paths[0].endswith(".pt.trace.json.gz")
    with gzip.open(paths[0], "rt") as f:
        events = json.load(f)["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("aten::") for n in names)  # the forward's operators were recorded
    with pytest.raises(RuntimeError, match="not running"):
        llm.stop_profile()
    # One recording per process: a second engine here waits for the first's stop.
    other = _llm(tiny_llama_dir)
    llm.start_profile()
    with pytest.raises(RuntimeError, match="another engine in this process"):
        other.start_profile()
    llm.stop_profile()
    other.start_profile()
    other.stop_profile()
    # A second trace gets a file of its own.
    llm.start_profile()
    assert llm.stop_profile()[0] != paths[0]
    assert _tokens(llm) == want


def test_profiling_off_is_a_clear_error_and_the_engine_goes_on(tiny_llama_dir, monkeypatch):
    for prefix in ("PAGED_", "VLLM_"):
        monkeypatch.delenv(f"{prefix}TORCH_PROFILER_DIR", raising=False)
    llm = _llm(tiny_llama_dir)
    want = _tokens(llm)
    for call in (llm.start_profile, llm.stop_profile):
        with pytest.raises(RuntimeError, match="PAGED_TORCH_PROFILER_DIR"):
            call()
    assert _tokens(llm) == want


def test_vllm_variable_and_bad_options(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("PAGED_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_TORCH_PROFILER_RECORD_SHAPES", "maybe")
    with pytest.raises(ValueError, match="TORCH_PROFILER_RECORD_SHAPES"):
        _llm(tiny_llama_dir)
    monkeypatch.setenv("VLLM_TORCH_PROFILER_RECORD_SHAPES", "1")
    llm = _llm(tiny_llama_dir)
    llm.start_profile()
    _tokens(llm)
    (path,) = llm.stop_profile()
    assert Path(path).parent == tmp_path
