"""`speculative_config`, vLLM's names: {"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_max": 4, "prompt_lookup_min": 2}."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_KNOWN = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

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
        method = value.get("method", "ngram" if "model" not in value else "draft_model")
        if value.get("model") is not None or method != "ngram":
            raise ValueError(
                f"speculative_config: method {method!r} is not supported; this engine "
                'speculates with {"method": "ngram"} (prompt lookup) only'
            )
        k = value.get("num_speculative_tokens")
        lo, hi = value.get("prompt_lookup_min", 2), value.get("prompt_lookup_max", 4)
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
        return cls("ngram", k, hi, lo)
