"""Shared weight-loading plumbing for models/*.py."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

# (fragment of our param name, fragment of the HF name, shard id for the param's weight_loader)
StackedRule = tuple[str, str, str | int]

# HF's separate q_proj / k_proj / v_proj into our fused qkv_proj (Llama family, OPT).
QKV_PROJ_RULES: tuple[StackedRule, ...] = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
)


def default_weight_loader(
    param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None
) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"shape mismatch: expected {tuple(param.shape)}, got {tuple(loaded_weight.shape)}"
        )
    param.data.copy_(loaded_weight)


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    stacked: Iterable[StackedRule] = (),
    skip: Callable[[str], bool] = lambda name: False,
    rename: Callable[[str], str] = lambda name: name,
    convert: Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]] | None = None,
) -> None:
    """Copy HF-named tensors into `model`'s parameters.

    Each HF name goes through `rename`, then `convert` (which may split one tensor into several,
    e.g. a fused qkv), then `skip`; `stacked` rules route it to a fused parameter's
    `weight_loader` with a shard id. Raises ValueError naming unexpected and missing weights.
    """
    params = dict(model.named_parameters())
    stacked = list(stacked)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for hf_name, tensor in weights:
        name = rename(hf_name)
        items = convert(name, tensor) if convert is not None else ((name, tensor),)
        for name, w in items:
            if skip(name):
                continue
            rule = next((r for r in stacked if r[1] in name), None)
            if rule is None:
                pname, shard_id = name, None
            else:
                pname, shard_id = name.replace(rule[1], rule[0]), rule[2]
            param = params.get(pname)
            if param is None:
                unexpected.append(hf_name)
                continue
            loader = getattr(param, "weight_loader", default_weight_loader)
            with torch.no_grad():
                try:
                    if shard_id is None:
                        loader(param, w.to(param.dtype))
                    else:
                        loader(param, w.to(param.dtype), shard_id)
                except ValueError as e:
                    raise ValueError(f"cannot load weight {hf_name!r} into {pname!r}: {e}") from e
            loaded.add(pname)
    missing = sorted(n for n in params if n not in loaded)
    if unexpected or missing:
        parts = []
        if unexpected:
            parts.append(f"unexpected weights {_short(unexpected)}")
        if missing:
            parts.append(f"missing weights {_short(missing)}")
        raise ValueError(f"{type(model).__name__}: checkpoint does not match: " + "; ".join(parts))


def _short(names: list[str], limit: int = 12) -> str:
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def cfg_get(config, name: str, default):
    """getattr with a default that also replaces an explicit None."""
    value = getattr(config, name, None)
    return default if value is None else value


def layer_sliding_window(config, layer_idx: int) -> int | None:
    """The sliding window of one decoder layer, or None for full attention."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return int(window) if layer_types[layer_idx] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)
