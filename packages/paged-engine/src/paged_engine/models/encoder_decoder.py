"""What paged's encoder-decoder models share (Mllama, Whisper, Moonshine, Florence-2, Donut): a
sequence's cross-attention plan, the decoder's length check, and the image encoder-decoders'
config set-up (one image a prompt, a sub-config's fields lifted to the top level).

`CrossPlan` is what a sequence's cross-attention slot holds (worker/cross_attention.py keeps
the slots; Mllama's `cross_plan` builds it in models/mllama.py, Moonshine's in
models/moonshine.py, Whisper's is built in worker/cross_attention.py). `fit_decoder_length`
sets or checks max_model_len against the decoder's position table, as vLLM's model config
derives max_model_len from the decoder's max positions. Both stand apart from any one model
so that every encoder-decoder imports them without importing another's model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class CrossPlan:
    """A sequence's cross-attention states (worker/cross_attention.py): `key` names its
    content (sequences with one key share a slot), `rows` its K / V rows, `payload` what
    `encode_cross` takes. The keys a row sees are a prefix of the slot: a row at position
    start + j sees the first `seen[min(j, len(seen) - 1)]`, a row before `start` (the model
    zeroes its MLP branch) the first `masked_seen`."""

    key: str
    rows: int
    seen: tuple[int, ...]
    start: int
    masked_seen: int
    payload: Any


def fit_decoder_length(config: Any, limit: int, field: str, table: str = "position") -> None:
    """max_model_len of an encoder-decoder (Mllama, Whisper, Moonshine): the decoder's `limit`
    positions (config.`field`) when unset, ValueError naming both when over them."""
    if config.max_model_len is None:
        config.max_model_len = limit
    elif config.max_model_len > limit:
        raise ValueError(
            f"max_model_len={config.max_model_len} exceeds the decoder's {table} table "
            f"({field}={limit})"
        )


def tp_divides_heads(config: Any, heads: int, field: str) -> None:
    """ValueError unless tensor_parallel_size divides the `heads` attention heads of `field`
    (each rank runs a whole share of them)."""
    if heads % config.tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size={config.tensor_parallel_size} does not divide the {heads} "
            f"attention heads of {field}"
        )


def one_image_a_prompt(config: Any, family: str) -> None:
    """ValueError unless `limit_mm_per_prompt`'s image limit is unset or 1 (Florence-2 and
    Donut read exactly one image a prompt, as vLLM limits them)."""
    limit = config.image_limit
    if limit is not None and limit != 1:
        raise ValueError(
            f"limit_mm_per_prompt={{'image': {limit}}} is not supported for {family}: every "
            "prompt takes exactly one image (as vLLM's limit of 1)"
        )


def lift_fields(hf_config: Any, sub: Any, names: tuple[str, ...]) -> None:
    """Copy `sub`'s fields `names` to the top level of `hf_config` where it lacks them (the
    engine reads a wrapper's text model's sizes there)."""
    for name in names:
        if getattr(hf_config, name, None) is None and getattr(sub, name, None) is not None:
            setattr(hf_config, name, getattr(sub, name))
