"""`speculative_config`, vLLM's names:

    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "suffix", "suffix_decoding_max_tree_depth": 24, ...}   (suffix decoding: the
        suffix_decoding_* keys below; num_speculative_tokens defaults to the tree depth)
    {"model": "<draft model path or hub id>", "num_speculative_tokens": k}   (method "draft_model")
    {"method": "eagle3", "model": "<EAGLE-3 head path or hub id>", "num_speculative_tokens": k}
    {"method": "eagle", "model": "<EAGLE-1 head path or hub id>", "num_speculative_tokens": k}
    {"method": "mtp", "num_speculative_tokens": k}   (the target's own MTP layer; vLLM's
        per-family names, "deepseek_mtp", "qwen3_next_mtp", "ernie_mtp", ...: MTP_ALIASES)
    {"method": "gemma4_assistant", "model": "<Gemma 4 assistant>", "num_speculative_tokens": k}
    {"method": "mlp_speculator", "model": "<IBM MLPSpeculator>", "num_speculative_tokens": k}
    {"method": "medusa", "model": "<Medusa heads>", "num_speculative_tokens": k <= num_heads}

A "model" key without a method implies "draft_model"; without either the method is "ngram".

Also vLLM's: `revision` (of a hub draft or head; `code_revision` only if the same),
`draft_tensor_parallel_size` (1 or the target's: a draft always runs sharded like the target,
so 1 gives the same tokens), `draft_sample_method` ("probabilistic", the default here: drafts
drawn from the draft's distribution q, which the verification uses; "greedy", vLLM's default:
the draft's argmax, verified as a point mass), `rejection_sample_method` ("standard" only),
`max_model_len` (the draft's; at least the engine's), `num_speculative_tokens_per_batch_size`
([[first, last, k], ...]: a row drafts at most k while first..last requests run; 0 turns
speculation off there), "ngram_gpu" as "ngram", and the knobs that change no token here:
`enforce_eager` (drafts run eagerly) and `disable_padded_drafter_batch` (drafter batches are
never padded)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

_KNOWN = {
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "model",
    "revision",
    "code_revision",
    "draft_tensor_parallel_size",
    "tensor_parallel_size",
    "draft_sample_method",
    "rejection_sample_method",
    "max_model_len",
    "enforce_eager",
    "disable_padded_drafter_batch",
    "num_speculative_tokens_per_batch_size",
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
}
_DRAFT_SAMPLE_METHODS = ("probabilistic", "greedy")
# suffix decoding's deepest pattern (vLLM sets no bound; 24 by default): past it, the drafts a
# row may run (the depth by default) and the proposer's per-depth arrays only cost memory
MAX_SUFFIX_TREE_DEPTH = 1024
METHODS = (
    "ngram",
    "suffix",
    "draft_model",
    "eagle",
    "eagle3",
    "mtp",
    "gemma4_assistant",
    "mlp_speculator",
    "medusa",
)
_WITH_MODEL = ("draft_model", "eagle", "eagle3", "gemma4_assistant", "mlp_speculator", "medusa")
# Methods that run under pipeline parallelism: the host's n-gram / suffix drafts, and proposers
# the last stage runs whole (it holds the target's final hidden states). As vLLM's model runner
# V2: EAGLE-3 refused there (it reads layers of every stage), Medusa, the MLP speculator and
# Gemma 4's assistant not run (V2 has no path for them; it has none for a draft model either).
PIPELINE_METHODS = ("ngram", "suffix", "draft_model", "eagle", "mtp")
# vLLM's per-family MTP method names (model cards name them: Qwen3.5's "qwen3_next_mtp"), which
# vLLM rewrites to "mtp" as here; check_mtp then says whether paged runs that target's layer
MTP_ALIASES = (
    "deepseek_mtp", "dots3_note_mtp", "mimo_mtp", "mimo_v2_mtp", "glm4_moe_mtp",
    "glm4_moe_lite_mtp", "glm_ocr_mtp", "ernie_mtp", "nemotron_h_mtp", "exaone_moe_mtp",
    "exaone4_5_mtp", "qwen3_next_mtp", "qwen3_5_mtp", "longcat_flash_mtp", "bailing_hybrid_mtp",
    "bailing_hybrid_v3_mtp", "minimax_m3_mtp", "kimi_k3_mtp", "pangu_ultra_moe_mtp",
    "step3p5_mtp", "hy_v3_mtp", "inkling_mtp",
)  # fmt: skip
# ... and vLLM's GPU n-gram proposer (the same proposals); vLLM's "gemma4_mtp" drafts with the
# Gemma 4 assistant named by `model` (its Gemma4Proposer), paged's "gemma4_assistant"
_ALIASES = {
    **dict.fromkeys(MTP_ALIASES, "mtp"),
    "ngram_gpu": "ngram",
    "gemma4_mtp": "gemma4_assistant",
}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str  # one of METHODS
    num_speculative_tokens: int  # 0 only before the engine read it from a model's config
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None  # the draft model or EAGLE-3 head
    revision: str | None = None  # of a hub draft or head
    draft_tensor_parallel_size: int | None = None  # 1 or the target's (checked by EngineConfig)
    greedy_drafts: bool = False  # draft_sample_method="greedy"
    max_model_len: int | None = None  # the draft's (checked against the engine's)
    # (first, last, k): drafts a row runs while the running requests number first..last
    per_batch_size: tuple[tuple[int, int, int], ...] = ()
    # method "suffix" (spec_decode/suffix_proposer.py), vLLM's keys and defaults
    suffix_decoding_max_tree_depth: int = 24  # match + draft length
    suffix_decoding_max_cached_requests: int = 10000  # finished outputs kept; 0: none
    suffix_decoding_max_spec_factor: float = 1.0  # drafts <= factor * match length
    suffix_decoding_min_token_prob: float = 0.1  # stop below this estimated probability

    def num_tokens_at(self, batch_size: int) -> int:
        """The drafts a row may run while `batch_size` requests run."""
        for first, last, k in self.per_batch_size:
            if first <= batch_size <= last:
                return k
        return self.num_speculative_tokens

    @property
    def max_draft_tokens(self) -> int:
        """The most drafts a row ever carries: num_speculative_tokens, or for suffix decoding
        the longest its caps allow (a match of m tokens drafts at most floor(factor * m) and
        depth - m: 12 at vLLM's defaults, against k = 24). Verification graphs and the memory
        profile are sized by it."""
        k = self.num_speculative_tokens
        if not self.is_suffix:
            return k
        depth, factor = self.suffix_decoding_max_tree_depth, self.suffix_decoding_max_spec_factor
        return min(k, max(min(int(m * factor + 1e-6), depth - m) for m in range(depth + 1)))

    @property
    def uses_draft_model(self) -> bool:
        """A model proposes on the worker (a draft model, an EAGLE-3 head, an MTP layer)."""
        return self.method in (*_WITH_MODEL, "mtp")

    def check_pipeline(self, pipeline_parallel_size: int) -> None:
        """Raise ValueError, naming the method, unless it runs with these pipeline stages."""
        if pipeline_parallel_size > 1 and self.method not in PIPELINE_METHODS:
            raise ValueError(
                f"speculative_config method {self.method!r} is not supported with "
                f"pipeline_parallel_size > 1; methods that are: {', '.join(PIPELINE_METHODS)}"
            )

    @property
    def is_suffix(self) -> bool:
        return self.method == "suffix"

    @property
    def is_eagle(self) -> bool:  # EAGLE-1 / EAGLE-2 heads
        return self.method == "eagle"

    @property
    def is_mtp(self) -> bool:
        return self.method == "mtp"

    @property
    def is_eagle3(self) -> bool:
        return self.method == "eagle3"

    @property
    def is_gemma4_assistant(self) -> bool:
        return self.method == "gemma4_assistant"

    @property
    def is_mlp_speculator(self) -> bool:  # IBM's MLPSpeculator (spec_decode/mlp_speculator.py)
        return self.method == "mlp_speculator"

    @property
    def is_medusa(self) -> bool:  # Medusa heads (spec_decode/medusa.py)
        return self.method == "medusa"

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
        if method in ("ngram", "suffix") and model is not None:
            raise ValueError(
                f"speculative_config.model is given with method {method!r}: drop the method (or "
                "pass 'draft_model') to speculate with a draft model"
            )
        extra = _vllm_options(value) | _suffix_options(value)
        k = value.get("num_speculative_tokens")
        depth = extra["suffix_decoding_max_tree_depth"]
        if k is None and method == "suffix":  # vLLM's default: drafts as long as the tree allows
            k = depth
        lo, hi = value.get("prompt_lookup_min", 2), value.get("prompt_lookup_max", 4)
        if k is None and (model is not None or method == "mtp"):
            # 0: the engine takes it from the model's own config (a speculators checkpoint's
            # proposal method, the MTP layer count) before anything else reads it, or refuses
            # naming this key
            return cls(method, 0, hi, lo, model, **extra)
        for name, v in (("num_speculative_tokens", k), ("prompt_lookup_min", lo)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{name} must be an int >= 1, got {v!r}")
        if not isinstance(hi, int) or isinstance(hi, bool) or hi < lo:
            raise ValueError(
                f"speculative_config.prompt_lookup_max must be an int >= prompt_lookup_min="
                f"{lo}, got {hi!r}"
            )
        most = max(16, depth) if method == "suffix" else 16  # suffix: vLLM's default k = depth
        if k > most:
            name = "speculative_config.num_speculative_tokens"
            raise ValueError(f"{name} must be <= {most}, got {k}")
        schedule = _per_batch_size(value.get("num_speculative_tokens_per_batch_size"), k)
        return cls(method, k, hi, lo, model, **extra, per_batch_size=schedule)


def _per_batch_size(value: Any, k: int) -> tuple[tuple[int, int, int], ...]:
    """vLLM's num_speculative_tokens_per_batch_size: [(first, last, drafts), ...], inclusive
    ranges of the running requests' count, drafts in 0..num_speculative_tokens (0: none)."""
    if value is None:
        return ()
    name = "speculative_config.num_speculative_tokens_per_batch_size"
    if not isinstance(value, list | tuple):
        raise ValueError(f"{name} must be a list of [first, last, num_tokens], got {value!r}")
    out = []
    for entry in value:
        ok = isinstance(entry, list | tuple) and len(entry) == 3
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in entry)
        if not ok or not 1 <= entry[0] <= entry[1] or not 0 <= entry[2] <= k:
            raise ValueError(
                f"{name}: each entry is [first, last, num_tokens] with 1 <= first <= last and "
                f"0 <= num_tokens <= num_speculative_tokens={k}, got {entry!r}"
            )
        out.append(tuple(entry))
    return tuple(out)


def _suffix_options(value: dict[str, Any]) -> dict[str, Any]:
    """The suffix_decoding_* keys (vLLM's bounds), checked whatever the method (others ignore
    them, as vLLM does)."""
    out: dict[str, Any] = {}
    for key, low in (("max_tree_depth", 1), ("max_cached_requests", 0)):
        name = f"suffix_decoding_{key}"
        v = value.get(name, SpeculativeConfig.__dataclass_fields__[name].default)
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ValueError(f"speculative_config.{name} must be an int >= {low}, got {v!r}")
        out[name] = v
    depth = out["suffix_decoding_max_tree_depth"]
    if depth > MAX_SUFFIX_TREE_DEPTH:  # the proposer's arrays and the drafts per row grow with it
        raise ValueError(
            f"speculative_config.suffix_decoding_max_tree_depth must be <= "
            f"{MAX_SUFFIX_TREE_DEPTH}, got {depth}"
        )
    for key, high in (("max_spec_factor", math.inf), ("min_token_prob", 1.0)):
        name = f"suffix_decoding_{key}"
        v = value.get(name, SpeculativeConfig.__dataclass_fields__[name].default)
        ok = isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= high
        if not ok or not math.isfinite(v):
            bound = ">= 0" if high == math.inf else "in [0, 1]"
            raise ValueError(f"speculative_config.{name} must be a number {bound}, got {v!r}")
        out[name] = float(v)
    # a factor past the depth drafts as the depth allows (a draft and its match fit in it);
    # held at the depth, factor x match length stays finite (1e308 x 2 would not)
    factor = "suffix_decoding_max_spec_factor"
    out[factor] = min(out[factor], float(depth))
    return out


def _vllm_options(value: dict[str, Any]) -> dict[str, Any]:
    """The fields of vLLM's other keys (see the module docstring), checked by name."""

    def positive_int(name: str) -> int | None:
        v = value.get(name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"speculative_config.{name} must be an int >= 1, got {v!r}")
        return v

    if "tensor_parallel_size" in value:
        raise ValueError(
            "speculative_config.tensor_parallel_size: pass draft_tensor_parallel_size (as vLLM "
            "says too)"
        )
    revision, code_revision = value.get("revision"), value.get("code_revision")
    for name, v in (("revision", revision), ("code_revision", code_revision)):
        if v is not None and not isinstance(v, str):
            raise ValueError(f"speculative_config.{name} must be a str, got {v!r}")
    if code_revision is not None and code_revision != revision:
        raise ValueError(
            "speculative_config.code_revision differs from revision: the draft's code is read "
            "at its revision; drop code_revision or make them equal"
        )
    sample = value.get("draft_sample_method", "probabilistic")
    if sample not in _DRAFT_SAMPLE_METHODS:
        raise ValueError(
            f"speculative_config.draft_sample_method must be one of {_DRAFT_SAMPLE_METHODS}, "
            f"got {sample!r}"
        )
    rejection = value.get("rejection_sample_method", "standard")
    if rejection != "standard":
        raise ValueError(
            f"speculative_config.rejection_sample_method {rejection!r} is not supported: "
            "'standard' (exact rejection sampling) only"
        )
    for name in ("enforce_eager", "disable_padded_drafter_batch"):
        v = value.get(name)
        if v is not None and not isinstance(v, bool):
            raise ValueError(f"speculative_config.{name} must be a bool, got {v!r}")
    return {
        "revision": revision,
        "draft_tensor_parallel_size": positive_int("draft_tensor_parallel_size"),
        "greedy_drafts": sample == "greedy",
        "max_model_len": positive_int("max_model_len"),
    }
