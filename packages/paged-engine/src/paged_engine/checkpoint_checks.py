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


def _int(config: Any, field: str) -> int | None:
    """The field's value where it is a plain int (per-layer lists, None: not checked)."""
    value = getattr(config, field, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_config(config: Any, source: str | Path) -> None:
    """ValueError naming `source` (config.json or the .gguf file) and the field where a size
    is not positive or the KV heads do not divide the attention heads."""
    archs = getattr(config, "architectures", None)
    if archs is not None and not (
        isinstance(archs, (list, tuple)) and all(isinstance(a, str) for a in archs)
    ):
        raise ValueError(f"{source}: architectures={archs!r} is not a list of class names")
    for field in _POSITIVE:
        value = _int(config, field)
        if value is not None and value <= 0:
            raise ValueError(f"{source}: {field}={value} must be a positive integer")
    heads, kv = _int(config, "num_attention_heads"), _int(config, "num_key_value_heads")
    if heads is not None and heads < 0:
        raise ValueError(f"{source}: num_attention_heads={heads} must not be negative")
    head_dim = _int(config, "head_dim")
    if head_dim is not None and head_dim <= 0:
        raise ValueError(f"{source}: head_dim={head_dim} must be a positive integer")
    if heads and kv is not None and (kv <= 0 or kv > heads or heads % kv):
        raise ValueError(
            f"{source}: num_key_value_heads={kv} must be between 1 and num_attention_heads="
            f"{heads} and divide it"
        )


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
