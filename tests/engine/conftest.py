"""Shared fixtures for engine tests: tiny HF-format model dirs, written once per session."""

from __future__ import annotations

import json
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
