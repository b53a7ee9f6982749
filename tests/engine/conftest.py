"""Shared fixtures for engine tests: tiny HF-format model dirs, written once per session."""

from __future__ import annotations

import contextlib
import functools
import json
import os
from pathlib import Path

import pytest

from paged_engine.testing import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory):
    """tiny_model_factory(arch, **overrides) -> Path; cached per (arch, overrides)."""
    cache: dict[str, Path] = {}

    def make(arch: str, **overrides) -> Path:
        key = json.dumps([arch, overrides], sort_keys=True)
        if key not in cache:
            cache[key] = write_tiny_model(tmp_path_factory.mktemp(arch), arch, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def hf_default_model(tmp_path_factory: pytest.TempPathFactory):
    """(HF model in float32, HF tokenizer) from transformers' own GGUF loading of the default
    model (~25 s, most of it gguf-py reading the file: loaded once for every test that compares
    against it); generate() stops at max_new_tokens only. Under xdist the first worker to get
    here saves what it loaded (weights, config, tokenizer files) for the others, which rebuild
    the same model from it in a second or two."""
    pytest.importorskip("gguf")  # transformers needs it to read GGUF; paged does not
    from filelock import FileLock

    from paged_engine.default_model import default_model_path

    try:
        gguf = default_model_path()
    except (FileNotFoundError, RuntimeError) as exc:
        pytest.skip(f"default model missing: {exc}")
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        model, tok = _hf_from_gguf(gguf)
    else:  # the workers of one run share the parent of their base temp dirs
        shared = tmp_path_factory.getbasetemp().parent / "hf-default-model"
        with FileLock(f"{shared}.lock"):
            if (shared / "complete").exists():
                model, tok = _hf_from_saved(shared)
            else:
                model, tok = _hf_from_gguf(gguf)
                _hf_save(model, tok, shared)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = tok.eos_token_id
    return model.eval(), tok


def _hf_from_gguf(gguf: Path):
    import torch
    import transformers

    with _gguf_read_once():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return model, tok


@contextlib.contextmanager
def _gguf_read_once():
    """transformers parses the GGUF file's header anew for the config, the weights and the
    tokenizer, and rebuilds gguf-py's tensor-name table for every submodule (most of the load's
    time): both are pure functions of their arguments, so they are computed once here. The
    values transformers builds from them are unchanged."""
    from unittest import mock

    import gguf

    readers: dict[str, gguf.GGUFReader] = {}

    def reader(path, mode: str = "r"):
        key = f"{os.fspath(path)}|{mode}"
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    real_reader = gguf.GGUFReader
    name_map = functools.cache(gguf.get_tensor_name_map)
    with (
        mock.patch.object(gguf, "GGUFReader", reader),
        mock.patch.object(gguf, "get_tensor_name_map", name_map),
    ):
        yield


def _hf_save(model, tok, path: Path) -> None:
    import torch

    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)  # a GGUF-loaded model refuses save_pretrained
    torch.save(model.state_dict(), path / "state_dict.pt")
    tok.save_pretrained(path)
    (path / "complete").touch()


def _hf_from_saved(path: Path):
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(torch.load(path / "state_dict.pt", weights_only=True))
    return model, transformers.AutoTokenizer.from_pretrained(path)


# Modules whose every test runs twice: synchronous and async scheduling must give the same
# outputs (HF parity, sampling, n > 1, beams, stop strings, aborts, preemption, prefix cache).
BOTH_MODES = {"test_llm_vs_hf", "test_edge_cases", "test_engine", "test_default_model"}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.module.__name__.rpartition(".")[2] in BOTH_MODES:
        metafunc.fixturenames.append("scheduling")
        metafunc.parametrize("scheduling", ["sync", "async"])


@pytest.fixture(autouse=True)
def _scheduling_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines left at async_scheduling=None (auto) follow the test's `scheduling` parameter."""
    mode = (
        request.node.callspec.params.get("scheduling")
        if hasattr(request.node, "callspec")
        else None
    )
    if mode is not None:
        import paged_engine.engine.llm_engine as llm_engine

        monkeypatch.setattr(llm_engine, "auto_async_scheduling", lambda device: mode == "async")


@pytest.fixture
def no_isolated_step_failures(monkeypatch: pytest.MonkeyPatch):
    """Fail the test if an engine step raised during it. The engine isolates such a step
    (core/step_isolation.py: its requests recompute, each alone, and outputs stay right), so
    without this a proposer that raises passes every output check. Recorded where the engine
    core isolates the step (`StepIsolation._step_failed`, which planning failures reach too)."""
    import traceback

    from paged_engine.core.step_isolation import StepIsolation

    errors: list[Exception] = []
    isolate = StepIsolation._step_failed

    def recording(self, error: Exception, *args, **kwargs):
        errors.append(error)
        return isolate(self, error, *args, **kwargs)

    monkeypatch.setattr(StepIsolation, "_step_failed", recording)
    yield
    if errors:
        first = "".join(traceback.format_exception(errors[0]))
        pytest.fail(f"{len(errors)} engine step(s) failed and were isolated; the first:\n{first}")
