"""Classes named by users as text ("module:Class" or "module.Class"), as vLLM's options take
them (logits_processors, worker_extension_cls)."""

from __future__ import annotations

import importlib
from typing import Any


def load_named(spec: str, where: str) -> Any:
    """The object `spec` names; ValueError naming `where` (the option) if it cannot be had."""
    module_name, sep, qualname = spec.partition(":")
    if not sep:
        module_name, _, qualname = spec.rpartition(".")
    if not module_name or not qualname:
        raise ValueError(f"{where}={spec!r}: expected 'module:Class' or 'module.Class'")
    try:
        obj = importlib.import_module(module_name)
        for attr in qualname.split("."):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{where}={spec!r} cannot be loaded: {e}") from None
    return obj
