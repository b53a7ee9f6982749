"""A start that tells the user what it is doing: `LLM()` logs each stage at INFO on its own,
weight loads over a second get a progress bar, and a model that is not there names the command
that fetches it, in one short error."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from paged_engine.load_progress import count_weights, track_weights
from paged_engine.loader import resolve_model

STAGES = [
    "resolving model",
    "config and tokenizer loaded",
    "loading weights",
    " tensors (",  # "loaded N tensors (X MiB) in Y s"
    "sizing the KV cache",
    "allocating the KV cache",
    "engine ready",
]
SCRIPT = (
    "from paged_engine import LLM\n"
    "LLM({model!r}, dtype='float32', max_model_len=64, num_gpu_blocks_override=8)\n"
)


def _run(script: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


def test_llm_logs_each_stage_at_info_by_default(tiny_llama_dir: Path) -> None:
    r = _run(SCRIPT.format(model=str(tiny_llama_dir)))
    assert r.returncode == 0, r.stderr
    at = [r.stderr.find(stage) for stage in STAGES]
    assert -1 not in at and at == sorted(at), r.stderr
    assert "INFO" in r.stderr


# One interpreter imports the engine once, then forks a child for each way of leaving logging
# alone (the choice is made at LLM(), from the environment and the root logger as they are
# then): PAGED_CONFIGURE_LOGGING=0, and logging configured by the application first.
FORKED = """import logging, os, sys, traceback
from paged_engine import LLM
for told in (True, False):
    print("=== told" if told else "=== configured", file=sys.stderr, flush=True)
    pid = os.fork()
    if pid == 0:
        try:
            if told:
                os.environ["PAGED_CONFIGURE_LOGGING"] = "0"
            else:
                logging.basicConfig(level="WARNING")
            LLM({model!r}, dtype="float32", max_model_len=64, num_gpu_blocks_override=8)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        sys.stderr.flush()
        os._exit(0)
    print("=== exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), file=sys.stderr)
"""


def test_llm_leaves_logging_alone_when_told_or_configured(tiny_llama_dir: Path) -> None:
    r = _run(FORKED.format(model=str(tiny_llama_dir)))
    assert r.returncode == 0, r.stderr
    runs = r.stderr.split("=== ")[1:]
    assert [run.split(None, 1)[0] for run in runs] == ["told", "exit", "configured", "exit"]
    for output, exit_line in zip(runs[::2], runs[1::2]):
        assert exit_line.split()[1] == "0", r.stderr
        assert "resolving model" not in output, r.stderr


def _slow(n: int, pause: float):
    for i in range(n):
        time.sleep(pause)
        yield f"w{i}", torch.zeros(4, 2)


def test_a_slow_weight_load_shows_a_progress_bar(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="paged_engine")
    names = [name for name, _ in track_weights(_slow(6, 0.05), 6, delay=0.1)]
    assert names == [f"w{i}" for i in range(6)]
    err = capsys.readouterr().err
    assert "Loading weights" in err and "/6" in err, err
    assert "loaded 6 tensors (0.0 MiB)" in caplog.text


def test_a_fast_weight_load_logs_without_a_bar(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="paged_engine")
    assert len(list(track_weights(_slow(3, 0.0), 3))) == 3
    assert "Loading weights" not in capsys.readouterr().err
    assert "loaded 3 tensors" in caplog.text


def test_weights_are_counted_from_the_headers(tiny_llama_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(tiny_llama_dir / "model.safetensors"), framework="pt") as f:
        expected = len(list(f.keys()))
    resolved = resolve_model(tiny_llama_dir)
    assert count_weights(resolved, "auto") == expected == count_weights(resolved, "safetensors")
    assert count_weights(resolved, "pt") is None


def test_a_missing_model_names_hf_download_in_one_short_error(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # tests never reach the network
    with pytest.raises(FileNotFoundError) as e:
        resolve_model("paged-tests/no-such-model-anywhere")
    message = str(e.value)
    assert "`hf download paged-tests/no-such-model-anywhere`" in message
    assert "huggingface-cli" not in message
    assert e.value.__cause__ is None and e.value.__suppress_context__  # no chained traceback
    scripts = {ep.name for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert "hf" in scripts  # the command we name is the one huggingface_hub installs
