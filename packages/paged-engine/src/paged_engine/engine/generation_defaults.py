"""Default sampling parameters from the model's `generation_config.json` (vLLM's
`--generation-config` / `--override-generation-config`).

A model's creator often recommends sampling settings there (Qwen3: temperature 0.6, top_p 0.95,
top_k 20). As in vLLM, they replace SamplingParams' neutral defaults wherever a request leaves a
field unset: `LLM.generate` without sampling_params, and server requests that omit a field.

    generation_config="auto"   the model's generation_config.json (none for a GGUF file)
    generation_config="vllm"   none: SamplingParams' own defaults
    generation_config=PATH     generation_config.json in that directory (or that file)
    override_generation_config={"temperature": 0.5, ...}   applied on top, with any of the above

Only these fields are read: temperature, top_p, top_k, min_p, repetition_penalty, and
max_new_tokens (as max_tokens: a cap on every request's output length, as in vLLM).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json name -> SamplingParams name
FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def check_setting(generation_config: object, override: object) -> None:
    """Validate the two engine options (types and override keys; ValueError naming them)."""
    if not isinstance(generation_config, str) or not generation_config:
        raise ValueError(
            f"generation_config={generation_config!r} is invalid: expected 'auto', 'vllm' or "
            "a directory holding generation_config.json"
        )
    if override is None:
        return
    if not isinstance(override, dict):
        raise ValueError(
            f"override_generation_config={override!r} is invalid: expected a dict such as "
            '{"temperature": 0.5}'
        )
    unknown = sorted(str(k) for k in override if k not in FIELDS)
    if unknown:
        raise ValueError(
            f"override_generation_config has unknown key(s) {unknown}: expected some of "
            f"{sorted(FIELDS)}"
        )


def _read(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{what}: cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what}: {path} does not hold a JSON object")
    return data


def generation_defaults(
    model_dir: Path | None,
    generation_config: str = "auto",
    override: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """SamplingParams keyword arguments that replace its defaults ({} when none apply).

    `model_dir`: the model's directory (None for a GGUF file: it carries no generation config).
    Raises ValueError naming the file or option when a value is not a valid SamplingParams
    value (`generation_config="vllm"` ignores the model's file)."""
    from paged_engine.sampling_params import SamplingParams

    check_setting(generation_config, override)
    raw: dict[str, Any] = {}
    source = "the model's generation_config.json"
    if generation_config == "auto":
        path = None if model_dir is None else model_dir / "generation_config.json"
        if path is not None and path.is_file():
            try:
                raw = _read(path, "generation_config")
            except ValueError as e:  # a broken optional file costs its defaults, not the model
                logger.warning("%s; sampling defaults are SamplingParams' own", e)
    elif generation_config != "vllm":
        path = Path(generation_config)
        if path.is_dir():
            path = path / "generation_config.json"
        if not path.is_file():
            raise ValueError(
                f"generation_config={generation_config!r}: no generation_config.json there "
                "(expected 'auto', 'vllm' or a directory holding one)"
            )
        raw = _read(path, "generation_config")
        source = str(path)
    defaults = {FIELDS[k]: v for k, v in raw.items() if k in FIELDS and v is not None}
    for key, value in (override or {}).items():
        if value is None:
            defaults.pop(FIELDS[key], None)
        else:
            defaults[FIELDS[key]] = value
    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"default sampling parameters {defaults} (from {source} and "
            f"override_generation_config) are invalid: {e}. Fix them, override them, or start "
            "with generation_config='vllm' (--generation-config vllm) to ignore the file"
        ) from None
    if defaults:
        cap = " and max_tokens caps what they ask" if "max_tokens" in defaults else ""
        logger.info(
            "default sampling parameters from the model's generation config: %s (a request's "
            "own values replace them field by field%s; generation_config='vllm' ignores them)",
            defaults,
            cap,
        )
    return defaults
