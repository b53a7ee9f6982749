"""Checks on a downloaded checkpoint's config before anything is built from it.

A broken or hostile config.json / GGUF header must fail with a ValueError naming the file and
the field, before the model is built: a layer count of 10**9 would otherwise spend minutes
building modules, a hidden size of 10**12 would ask the allocator for terabytes. Two checks:

- `check_config`: `architectures` a list of names, the sizes the models read positive
  integers, the KV heads dividing the attention heads.
- `check_config_size`: a lower bound on the weights the config describes (embedding, attention
  output and MLP matrices) is not far above the tensor elements the checkpoint's files hold.
  The files are read only as headers (safetensors JSON headers, GGUF tensor infos).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paged_engine.loader import ResolvedModel

# How many times the checkpoint's stored elements the config's lower bound may reach: packed
# integer weights store up to 16 values per element (2-bit GPTQ in int32), and the bound
# counts hybrid models' attention and MLP terms on every layer.
SIZE_SLACK = 64

# (an MLP width may be 0)
_POSITIVE = ("hidden_size", "num_hidden_layers", "vocab_size", "max_position_embeddings")
# Widths and ranks that may be 0 (no MLP, no bottleneck) but never negative: a negative one
# reached torch as "negative dimension" while the model was built.
_NON_NEGATIVE = (
    "intermediate_size",
    "n_inner",
    "ffn_dim",
    "ffn_hidden_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "word_embed_proj_dim",
)


def _int(config: Any, field: str) -> int | None:
    """The field's value where it is a plain int (per-layer lists, None: not checked)."""
    value = getattr(config, field, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _nan_field(value: Any, name: str) -> str | None:
    """The dotted name of the first NaN number in `value` (dicts and lists walked), or None."""
    if isinstance(value, float):
        return name if math.isnan(value) else None
    items = value.items() if isinstance(value, dict) else None
    if isinstance(value, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(value))
    for key, item in items or ():
        found = _nan_field(item, f"{name}.{key}" if name else str(key))
        if found is not None:
            return found
    return None


def _partial_rotary_factors(config: Any) -> list[tuple[str, Any]]:
    """(field, value) of each fraction of head_dim the config rotates, at the top level and
    in its rope dict."""
    out = [(f, getattr(config, f, None)) for f in ("partial_rotary_factor", "rotary_pct")]
    for rope_field in ("rope_parameters", "rope_scaling"):
        rope = getattr(config, rope_field, None)
        if isinstance(rope, dict):
            out.append((f"{rope_field}.partial_rotary_factor", rope.get("partial_rotary_factor")))
    return [(f, v) for f, v in out if v is not None]


def check_heads_divide(hidden: int, heads: int, hidden_field: str, heads_field: str) -> int:
    """hidden // heads, the head size of models that derive it so; ValueError naming both
    fields where the heads are not positive or do not divide the hidden size (the product of
    the head size and the heads would not be the hidden size the weights have)."""
    if heads <= 0 or hidden % heads:
        raise ValueError(
            f"{heads_field}={heads} must be positive and divide {hidden_field}={hidden}"
        )
    return hidden // heads


def check_config(config: Any, source: str | Path) -> None:
    """ValueError naming `source` (config.json or the .gguf file) and the field where a size
    is not positive (or a width negative), the KV heads do not divide the attention heads, a
    number is NaN, the rotated fraction of the head or a norm's eps is negative, or a scaled
    rope's original context or LongRoPE factors are not positive."""
    archs = getattr(config, "architectures", None)
    if archs is not None and not (
        isinstance(archs, (list, tuple)) and all(isinstance(a, str) for a in archs)
    ):
        raise ValueError(f"{source}: architectures={archs!r} is not a list of class names")
    for field in _POSITIVE:
        value = _int(config, field)
        if value is not None and value <= 0:
            raise ValueError(f"{source}: {field}={value} must be a positive integer")
    for field in _NON_NEGATIVE:
        value = _int(config, field)
        if value is not None and value < 0:
            raise ValueError(f"{source}: {field}={value} must not be negative")
    # NaN passes every comparison the models make (a scale, an eps, a rope parameter) and
    # turns the logits to NaN; no released config holds one (Infinity is Mamba's dt limit)
    fields = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    nan = _nan_field(fields, "")
    if nan is not None:
        raise ValueError(f"{source}: {nan} is NaN")
    for field, value in _partial_rotary_factors(config):
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ValueError(f"{source}: {field}={value!r} must be a number from 0 to 1")
    heads, kv = _int(config, "num_attention_heads"), _int(config, "num_key_value_heads")
    if heads is not None and heads < 0:
        raise ValueError(f"{source}: num_attention_heads={heads} must not be negative")
    head_dim = _int(config, "head_dim")
    # MLA configs (a kv_lora_rank) mirror qk_rope_head_dim in head_dim: 0 in NoPE MLA (GLM-5)
    nope_mla = head_dim == 0 and _int(config, "kv_lora_rank") is not None
    if head_dim is not None and head_dim <= 0 and not nope_mla:
        raise ValueError(f"{source}: head_dim={head_dim} must be a positive integer")
    if heads and kv is not None and (kv <= 0 or kv > heads or heads % kv):
        raise ValueError(
            f"{source}: num_key_value_heads={kv} must be between 1 and num_attention_heads="
            f"{heads} and divide it"
        )
    _check_rope_dicts(config, source)
    for field in ("layer_norm_eps", "layer_norm_epsilon", "rms_norm_eps", "norm_eps", "eps"):
        value = getattr(config, field, None)  # a negative eps: NaN rows where the variance < |eps|
        if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
            raise ValueError(f"{source}: {field}={value} must not be negative")


def _check_rope_dicts(config: Any, source: str | Path) -> None:
    """The original context a scaled rope divides by is positive, and LongRoPE's per-frequency
    factors are positive numbers (a factor of 0 divides the frequency by 0: NaN logits)."""
    fields: list[tuple[str, Any]] = [
        (
            "original_max_position_embeddings",
            getattr(config, "original_max_position_embeddings", None),
        )
    ]
    for rope_field in ("rope_parameters", "rope_scaling"):
        rope = getattr(config, rope_field, None)
        ropes = [rope]
        if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
            ropes = list(rope.values())  # Gemma 3: a rope dict per layer type
        for one in ropes:
            if not isinstance(one, dict):
                continue
            key = "original_max_position_embeddings"
            fields.append((f"{rope_field}.{key}", one.get(key)))
            for key in ("short_factor", "long_factor"):
                factors = one.get(key)
                if factors is not None and not (
                    isinstance(factors, list)
                    and all(
                        isinstance(f, int | float) and not isinstance(f, bool) and f > 0
                        for f in factors
                    )
                ):
                    raise ValueError(
                        f"{source}: {rope_field}.{key} must be a list of positive numbers"
                    )
    for field, value in fields:
        if isinstance(value, int | float) and not isinstance(value, bool) and value <= 0:
            raise ValueError(f"{source}: {field}={value} must be positive")


def check_disjoint(spans: list[tuple[int, int, str]], source: str | Path) -> None:
    """ValueError naming `source` and two tensors whose [begin, end) byte ranges in the file
    overlap (safetensors and GGUF files lay tensors end to end)."""
    ordered = sorted(spans)
    for (_, end, prev), (begin, _, name) in itertools.pairwise(ordered):
        if begin < end:
            raise ValueError(f"{source}: tensors {prev!r} and {name!r} overlap in the file")


def config_weight_lower_bound(config: Any) -> int:
    """Weights any model of this config holds, at least: the embedding, and per layer the
    attention output projection and two MLP matrices (fields that are absent count 0)."""
    hidden = _int(config, "hidden_size") or 0
    layers = _int(config, "num_hidden_layers") or 0
    heads = _int(config, "num_attention_heads") or 0
    head_dim = _int(config, "head_dim") or (hidden // heads if heads else 0)
    per_layer = hidden * heads * head_dim + 2 * hidden * (_int(config, "intermediate_size") or 0)
    return (_int(config, "vocab_size") or 0) * hidden + layers * per_layer


def checkpoint_elements(resolved: ResolvedModel) -> int | None:
    """Tensor elements the checkpoint's files hold (from their headers); None where the weights
    are not a GGUF file or safetensors files (no files yet, .bin, Mistral's format)."""
    from paged_engine.loader import _open_gguf, _weight_files, safetensors_header, weights_format

    if resolved.is_gguf:
        infos = _open_gguf(resolved.gguf_file).tensors.values()
        return sum(math.prod(info.shape) for info in infos)
    try:
        if weights_format(resolved) != "safetensors":
            return None
    except FileNotFoundError:  # a tokenizer-only download, or load_format="dummy"
        return None
    total = 0
    for file in _weight_files(resolved.path, "safetensors"):
        with open(file, "rb") as f:
            header, _ = safetensors_header(f)
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


def check_config_size(config: Any, resolved: ResolvedModel, source: str | Path) -> None:
    """ValueError where the config describes far more weights than the checkpoint holds (an
    absurd layer count, hidden, vocab or MLP size), before a model of that size is built."""
    from paged_engine.models.ultravox_linked import _linked_ids

    if not resolved.is_gguf and _linked_ids(resolved.path):  # Ultravox: weights in other repos
        return
    want = config_weight_lower_bound(config)
    if want <= SIZE_SLACK * 2**20:  # tiny models: nothing to guard
        return
    have = checkpoint_elements(resolved)
    if have is not None and want > SIZE_SLACK * have:
        names = (*_POSITIVE, "intermediate_size", "num_attention_heads", "head_dim")
        fields = {f: getattr(config, f, None) for f in names}
        raise ValueError(
            f"{source} describes a model of at least {want:,} weights ({fields}), but the "
            f"checkpoint's files hold only {have:,} tensor elements: the config does not "
            "match the checkpoint"
        )
