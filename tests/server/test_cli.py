"""How `paged-server` starts: the command forms vLLM users type, a busy port failing before
the model loads, each startup stage logged, --trust-remote-code."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_proc import REAL_ARGS, ServerProc, launch

from paged_server.cli import parse_args

STAGES = [
    "resolving model",
    "config and tokenizer loaded",
    "loading weights",
    "loaded ",  # "loaded N tensors (X MiB) in Y s"
    "sizing the KV cache",
    "allocating the KV cache",
    "engine ready",
]


@pytest.mark.parametrize(
    "argv",
    [["serve", "m"], ["m"], ["--model", "m"], ["serve", "--model", "m"], ["m", "--model", "m"]],
)
def test_the_model_goes_positionally_or_as_model(argv: list[str]) -> None:
    assert parse_args([*argv, "--port", "1"]).model == "m"


def test_two_different_models_are_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse_args(["serve", "a", "--model", "b"])
    assert "two models given" in capsys.readouterr().err


def test_keep_alive_on_engine_death_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from paged_server.cli_args import keep_alive_on_engine_death

    assert keep_alive_on_engine_death({}) is False  # vLLM's default: a dead engine ends it
    assert keep_alive_on_engine_death({"VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"}) is True
    both = {"PAGED_KEEP_ALIVE_ON_ENGINE_DEATH": "0", "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"}
    assert keep_alive_on_engine_death(both) is False  # ours first
    assert keep_alive_on_engine_death({"PAGED_KEEP_ALIVE_ON_ENGINE_DEATH": " True "}) is True
    monkeypatch.setenv("PAGED_KEEP_ALIVE_ON_ENGINE_DEATH", "1")
    assert parse_args(["m"]).keep_alive_on_engine_death is True
    monkeypatch.setenv("PAGED_KEEP_ALIVE_ON_ENGINE_DEATH", "maybe")
    with pytest.raises(SystemExit):
        parse_args(["m"])
    assert "PAGED_KEEP_ALIVE_ON_ENGINE_DEATH='maybe' is invalid" in capsys.readouterr().err


def test_startup_logs_each_stage_before_serving(real_server: ServerProc) -> None:
    lines = real_server.lines[
        : next(i for i, x in enumerate(real_server.lines) if "serving on" in x)
    ]
    at = [next((i for i, x in enumerate(lines) if stage in x), None) for stage in STAGES]
    assert None not in at, "".join(lines)
    assert at == sorted(at), "".join(lines)  # in the order they happen


@pytest.fixture
def busy_port() -> Iterator[int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


@pytest.mark.parametrize("module", ["paged_server", "paged_server.entrypoints.openai.api_server"])
def test_a_busy_port_fails_before_the_model_loads(
    tiny_model: str, busy_port: int, module: str
) -> None:
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", module, "--model", tiny_model]
        + ["--port", str(busy_port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert f"cannot listen on 127.0.0.1:{busy_port}" in r.stderr
    assert "resolving model" not in r.stderr  # the engine never started
    # fast (~0.25 s) because nothing heavy is imported: asked of -X importtime's list rather
    # than of a wall-clock bound, which a loaded CI machine can exceed
    imported = {
        line.rsplit("|", 1)[1].strip().split(".")[0]
        for line in r.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "paged_server" in imported and not imported & {"torch", "transformers"}, imported


@pytest.fixture(scope="module")
def remote_code_model(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with its config class in the repository's own code (`auto_map`)."""
    path = tmp_path_factory.mktemp("remote-code") / "model"
    shutil.copytree(tiny_model, path)
    (path / "configuration_tiny_remote.py").write_text(
        "from transformers import LlamaConfig\n\n\n"
        "class TinyRemoteConfig(LlamaConfig):\n"
        '    model_type = "tiny_remote"\n'
    )
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "tiny_remote"
    config["auto_map"] = {"AutoConfig": "configuration_tiny_remote.TinyRemoteConfig"}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_trust_remote_code_is_refused_clearly_then_honoured(
    remote_code_model: Path, tmp_path: Path
) -> None:
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules")}
    cmd = [sys.executable, "-m", "paged_server", str(remote_code_model), "--port", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert r.returncode == 2 and "--trust-remote-code" in r.stderr, r.stderr
    server = launch(
        [str(remote_code_model), "--trust-remote-code", *REAL_ARGS], fake=False, env=env
    )
    try:
        status, _, body = server.request(
            "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}
        )
        assert status == 200, body
    finally:
        assert server.stop() == 0
