"""Reading a PEFT LoRA adapter directory.

A directory holds `adapter_config.json` (r, lora_alpha, use_rslora, target_modules, ...) and
`adapter_model.safetensors` (or `adapter_model.bin`) with, per adapted linear layer,

    base_model.model.<module path>.lora_A.weight   [r, in]
    base_model.model.<module path>.lora_B.weight   [out, r]

and the layer computes y = x W^T + scale * (x A^T) B^T, scale = lora_alpha / r (lora_alpha /
sqrt(r) with use_rslora). Only that plain form is served; adapters that need more (DoRA, LoRA
biases, replaced modules, per-module ranks, embedding LoRA) are refused with a ValueError.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

_PREFIX = "base_model.model."
_MAX_CONFIG_BYTES = 1 << 20  # PEFT writes ~1 KB; a larger file is not read
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# PEFT drops the adapter name ("default") when saving; accept it either way.
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")


@dataclass(frozen=True, slots=True)
class LoRAModule:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float


@dataclass(frozen=True, slots=True)
class PeftAdapter:
    path: str
    rank: int  # the largest rank of any module
    modules: dict[str, LoRAModule]  # module path as in the base model's checkpoint


def _refuse(path: str, why: str) -> ValueError:
    return ValueError(f"lora_request: the adapter at {path!r} cannot be served: {why}")


def _read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        if not os.path.isdir(path):
            raise ValueError(f"lora_request: lora_path {path!r} is not a directory")
        raise _refuse(path, "it has no adapter_config.json (a PEFT LoRA directory is expected)")
    size = os.path.getsize(cfg_path)
    if size > _MAX_CONFIG_BYTES:
        raise _refuse(path, f"adapter_config.json is {size} bytes, more than a config holds")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise _refuse(path, f"adapter_config.json is unreadable: {e}") from e
    if not isinstance(cfg, dict):
        raise _refuse(path, "adapter_config.json is not a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _refuse(path, f"peft_type is {peft_type!r}, only LORA is supported")
    if cfg.get("use_dora"):
        raise _refuse(path, "DoRA adapters (use_dora) are not supported")
    if cfg.get("bias", "none") not in ("none", None):
        raise _refuse(path, f"bias={cfg['bias']!r}: LoRA biases are not supported")
    if cfg.get("modules_to_save"):
        raise _refuse(path, f"modules_to_save={cfg['modules_to_save']!r} is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise _refuse(path, f"{key} (per-module ranks or alphas) is not supported")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _refuse(path, f"adapter_config.json has r={r!r}, expected an int >= 1")
    alpha = cfg.get("lora_alpha", 8)
    try:  # a JSON integer past float's range raises OverflowError in isfinite
        finite = math.isfinite(alpha) if isinstance(alpha, (int, float)) else False
    except OverflowError:
        finite = False
    if isinstance(alpha, bool) or not finite:
        raise _refuse(path, f"adapter_config.json has lora_alpha={alpha!r}, expected a number")
    return cfg


def _targeted(path: str, cfg: dict) -> Callable[[str], bool]:
    """Whether PEFT, building the adapter from `cfg`, puts a LoRA layer on module path `key`:
    PEFT loads a saved tensor only into such a layer (any other tensor is dropped), so the
    engine must not serve one either. target_modules is a regex (full match) or a list of
    names (the key or its last parts); exclude_modules likewise; layers_to_transform keeps the
    list form's matches in those layer indices. No target_modules (PEFT's per-architecture
    default) or "all-linear" (resolved to names when PEFT saves): every tensor is loaded."""

    def matcher(field: str) -> Callable[[str], bool] | None:
        spec = cfg.get(field)
        if spec is None or spec == "all-linear":
            return None
        if isinstance(spec, str):
            try:
                pattern = re.compile(spec)
            except re.error as e:
                raise _refuse(path, f"{field}={spec!r} is not a regular expression: {e}") from e
            return lambda key: pattern.fullmatch(key) is not None
        if not isinstance(spec, list) or not all(isinstance(t, str) for t in spec):
            raise _refuse(path, f"{field}={spec!r}, expected a string or a list of strings")
        names = set(spec)
        return lambda key: key in names or any(key.endswith(f".{t}") for t in names)

    target, exclude = matcher("target_modules"), matcher("exclude_modules")
    layers = cfg.get("layers_to_transform")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    elif layers is not None and not (
        isinstance(layers, list) and all(type(i) is int for i in layers)  # type(): bool is no index
    ):
        raise _refuse(path, f"layers_to_transform={layers!r}, expected an int or a list of ints")
    # With a layers_pattern PEFT finds the index its own way: the index is not checked then.
    by_layer = bool(layers) and isinstance(cfg.get("target_modules"), list)
    by_layer = by_layer and not cfg.get("layers_pattern")

    def targeted(key: str) -> bool:
        if exclude is not None and exclude(key):
            return False
        if target is None:
            return True
        if not target(key):
            return False
        if by_layer and key not in cfg["target_modules"]:
            m = re.match(r".*\.[^.]*\.(\d+)\.", key)
            return m is not None and int(m[1]) in layers
        return True

    return targeted


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    pt = os.path.join(path, "adapter_model.bin")
    try:
        if os.path.isfile(st):
            from safetensors.torch import load_file

            return load_file(st)
        if os.path.isfile(pt):
            tensors = torch.load(pt, map_location="cpu", weights_only=True)
        else:
            tensors = None
    except Exception as e:  # a truncated or foreign file: the adapter is bad, not the engine
        raise _refuse(path, f"its weights are unreadable: {e}") from e
    if tensors is not None:  # a .bin pickles any object: only {name: tensor} is a state dict
        if not isinstance(tensors, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()
        ):
            raise _refuse(path, "adapter_model.bin is not a dict of tensor names to tensors")
        return tensors
    raise _refuse(path, "it has no adapter_model.safetensors or adapter_model.bin")


def read_peft_adapter(path: str, max_rank: int) -> PeftAdapter:
    """The adapter's modules with their scales; ValueError (naming lora_request) when the
    directory is not a servable LoRA adapter or its rank exceeds `max_rank`."""
    cfg = _read_config(path)
    tensors = _read_tensors(path)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key[len(_PREFIX) :] if key.startswith(_PREFIX) else key
        m = _KEY.match(name)
        if m is None:
            raise _refuse(path, f"unsupported tensor {key!r} (only lora_A / lora_B weights)")
        parts.setdefault(m["module"], {})[m["which"]] = tensor
    if not parts:
        raise _refuse(path, "it holds no LoRA weights")
    targeted = _targeted(path, cfg)
    for module in parts:
        if not targeted(module):
            raise _refuse(
                path,
                f"it holds weights for module {module!r}, which adapter_config.json's "
                "target_modules / exclude_modules / layers_to_transform leave out (PEFT would "
                "not load them)",
            )
    alpha, rslora = float(cfg.get("lora_alpha", 8)), bool(cfg.get("use_rslora", False))
    modules: dict[str, LoRAModule] = {}
    for module, ab in parts.items():
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None:
            raise _refuse(path, f"module {module!r} has only lora_{'A' if b is None else 'B'}")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise _refuse(
                path,
                f"module {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are "
                "not [r, in] and [out, r]",
            )
        if a.dtype not in _FLOATS or b.dtype not in _FLOATS:  # (float8 has no isfinite)
            raise _refuse(
                path,
                f"module {module!r}: LoRA weights are {a.dtype} / {b.dtype}, expected float16, "
                "bfloat16, float32 or float64",
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise _refuse(path, f"module {module!r}: LoRA weights hold NaN or infinity")
        r = int(a.shape[0])
        if r != cfg["r"]:  # PEFT scales by the config's r: a mismatch would scale wrongly
            raise _refuse(path, f"module {module!r} has rank {r}, adapter_config.json r={cfg['r']}")
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        modules[module] = LoRAModule(a, b, scale)
    rank = max(int(m.a.shape[0]) for m in modules.values())
    if rank > max_rank:
        raise ValueError(
            f"lora_request: the adapter at {path!r} has rank {rank}, more than "
            f"max_lora_rank={max_rank}: start the engine with a larger max_lora_rank"
        )
    return PeftAdapter(path, rank, modules)
