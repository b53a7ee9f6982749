"""`speculative_config`, vLLM's names:

    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"model": "<draft model path or hub id>", "num_speculative_tokens": k}   (method "draft_model")
    {"method": "eagle3", "model": "<EAGLE-3 head path or hub id>", "num_speculative_tokens": k}
    {"method": "eagle", "model": "<EAGLE-1 head path or hub id>", "num_speculative_tokens": k}
    {"method": "mtp", "num_speculative_tokens": k}   (the target's own MTP layer; "deepseek_mtp")

A "model" key without a method implies "draft_model"; without either the method is "ngram"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_KNOWN = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}
METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
_WITH_MODEL = ("draft_model", "eagle", "eagle3")
_ALIASES = {"deepseek_mtp": "mtp"}  # vLLM's earlier name


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str  # "ngram" | "draft_model" | "eagle" | "eagle3" | "mtp"
    num_speculative_tokens: int  # 0 only before the engine read it from a model's config
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None  # the draft model or EAGLE-3 head

    @property
    def uses_draft_model(self) -> bool:
        """A model proposes on the worker (a draft model, an EAGLE-3 head, an MTP layer)."""
        return self.method in (*_WITH_MODEL, "mtp")

    @property
    def is_eagle(self) -> bool:  # EAGLE-1 / EAGLE-2 heads
        return self.method == "eagle"

    @property
    def is_mtp(self) -> bool:
        return self.method == "mtp"

    @property
    def is_eagle3(self) -> bool:
        return self.method == "eagle3"

    @classmethod
    def from_dict(cls, value: dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """Validate the user's dict; every error names `speculative_config` and the key."""
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        unknown = sorted(set(value) - _KNOWN)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {unknown}; known: {sorted(_KNOWN)}"
            )
        model = value.get("model")
        method = value.get("method", "ngram" if model is None else "draft_model")
        if isinstance(method, str):
            method = _ALIASES.get(method, method)
        if method not in METHODS:
            raise ValueError(
                f"speculative_config.method {method!r} is not supported; choose from {METHODS}"
            )
        if method in _WITH_MODEL and (not isinstance(model, str) or not model):
            raise ValueError(
                "speculative_config.model must name the draft model (a path or hub id) for "
                f"method {method!r}, got {model!r}"
            )
        if method == "mtp" and model is not None:
            raise ValueError(
                "speculative_config.model is given with method 'mtp': the target's own MTP "
                "layer drafts; drop the model"
            )
        if method == "ngram" and model is not None:
            raise ValueError(
                "speculative_config.model is given with method 'ngram': drop the method (or "
                "pass 'draft_model') to speculate with a draft model"
            )
        k = value.get("num_speculative_tokens")
        lo, hi = value.get("prompt_lookup_min", 2), value.get("prompt_lookup_max", 4)
        if k is None and (model is not None or method == "mtp"):
            # 0: the engine takes it from the model's own config (a speculators checkpoint's
            # proposal method, the MTP layer count) before anything else reads it, or refuses
            # naming this key
            return cls(method, 0, hi, lo, model)
        for name, v in (("num_speculative_tokens", k), ("prompt_lookup_min", lo)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{name} must be an int >= 1, got {v!r}")
        if not isinstance(hi, int) or isinstance(hi, bool) or hi < lo:
            raise ValueError(
                f"speculative_config.prompt_lookup_max must be an int >= prompt_lookup_min="
                f"{lo}, got {hi!r}"
            )
        if k > 16:
            raise ValueError(f"speculative_config.num_speculative_tokens must be <= 16, got {k}")
        return cls(method, k, hi, lo, model)
