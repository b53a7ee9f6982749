"""bitsandbytes checkpoints (`quant_method` "bitsandbytes": the `*-bnb-4bit` NF4 / FP4 ones and
LLM.int8's 8-bit ones), dequantized to the model dtype as they load, so any architecture runs
them with its unquantized layers.

Each quantized linear layer `X` arrives as several tensors (any order, maybe split across
files); once its set is complete it leaves the stream as one `X.weight` [N, K]:

    4-bit   X.weight              uint8 [ceil(N * K / 2), 1]: two codes a byte, the first in
                                  the high nibble, over the row-major flattened weight
            X.weight.quant_map    float32 [16]: the code book (NF4 or FP4)
            X.weight.absmax       float32 [blocks]: each block of `blocksize` values' scale
            X.weight.quant_state.bitsandbytes__nf4 (or __fp4): JSON as uint8 (quant_type,
                                  blocksize, dtype, shape, and with double quantization
                                  nested_blocksize, nested_offset)
            W.flat[i] = quant_map[code i] * absmax[i // blocksize]
            double quantization (bnb_4bit_use_double_quant): absmax is uint8 and
            absmax[j] = nested_quant_map[absmax[j]] * nested_absmax[j // nested_blocksize]
                        + nested_offset   (X.weight.nested_absmax, X.weight.nested_quant_map)
    8-bit   X.weight int8 [N, K], X.SCB float32 [N] (each row's absmax), X.weight_format
            (0: row-major, read and dropped);  W = q * SCB / 127

Layers bitsandbytes left alone (`llm_int8_skip_modules`, the LM head) arrive as plain
float `X.weight` and pass through. The weights take the model dtype's memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

_AUX_4BIT = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state")
_INV_127 = 7.874015718698502e-3  # bitsandbytes' 1 / 127 (float32)


def _get(obj, key: str, default=None):
    return obj.get(key, default) if isinstance(obj, dict) else getattr(obj, key, default)


@dataclass(frozen=True)
class BnbScheme:
    bits: int  # 4 or 8
    required: tuple[str, ...]  # one layer's parts ("weight", "weight.absmax", ...)


def bnb_scheme(config) -> BnbScheme | None:
    """The checkpoint's bitsandbytes scheme, or None when it is not a bitsandbytes one.
    Raises ValueError naming what is unsupported."""
    quant = getattr(config, "quantization_config", None)
    if quant is None or _get(quant, "quant_method") != "bitsandbytes":
        return None
    if _get(quant, "load_in_8bit", False):
        return BnbScheme(8, ("weight", "SCB"))
    if not _get(quant, "load_in_4bit", False):
        raise ValueError("bitsandbytes checkpoint with neither load_in_4bit nor load_in_8bit set")
    kind = _get(quant, "bnb_4bit_quant_type", "fp4")
    if kind not in ("nf4", "fp4"):
        raise ValueError(f"bitsandbytes bnb_4bit_quant_type {kind!r} is not supported")
    storage = _get(quant, "bnb_4bit_quant_storage", "uint8")
    if storage not in (None, "uint8"):
        raise ValueError(
            f"bitsandbytes bnb_4bit_quant_storage {storage!r} is not supported: only uint8"
        )
    required = ("weight", "weight.absmax", "weight.quant_map", "weight.quant_state")
    if _get(quant, "bnb_4bit_use_double_quant", False):
        required += ("weight.nested_absmax", "weight.nested_quant_map")
    return BnbScheme(4, required)


def _part(scheme: BnbScheme, name: str, t: torch.Tensor) -> tuple[str, str] | None:
    """(layer prefix, part) when `name` is a piece of a quantized layer, else None."""
    if scheme.bits == 8:
        if name.endswith(".SCB"):
            return name[: -len(".SCB")], "SCB"
        if name.endswith(".weight") and t.dtype == torch.int8:
            return name[: -len(".weight")], "weight"
        return None
    if ".weight." in name:
        prefix, _, aux = name.rpartition(".weight.")
        aux = "quant_state" if aux.startswith("quant_state.") else aux
        if aux in _AUX_4BIT:
            return prefix, "weight." + aux
        return None
    if name.endswith(".weight") and t.dtype == torch.uint8:
        return name[: -len(".weight")], "weight"
    return None


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _quant_state(t: torch.Tensor, name: str) -> dict:
    """A layer's quant_state JSON, checked: its shape and block sizes positive integers."""
    what = f"{name}.weight.quant_state"
    try:
        state = json.loads(bytes(t.cpu().to(torch.uint8).tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what}: not UTF-8 JSON: {e}") from None
    if not isinstance(state, dict):
        raise ValueError(f"{what}: expected a JSON object, got {type(state).__name__}")
    shape = state.get("shape")
    if not isinstance(shape, list) or not shape or not all(_positive_int(v) for v in shape):
        raise ValueError(f"{what}: shape {shape!r} is not a list of positive integers")
    keys = ("blocksize", "nested_blocksize") if "nested_blocksize" in state else ("blocksize",)
    for key in keys:
        if not _positive_int(state.get(key)):
            raise ValueError(f"{what}: {key} {state.get(key)!r} is not a positive integer")
    if "nested_blocksize" in state and not isinstance(state.get("nested_offset"), (int, float)):
        raise ValueError(f"{what}: nested_offset {state.get('nested_offset')!r} is not a number")
    return state


def _finite(t: torch.Tensor, what: str) -> torch.Tensor:
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{what}: holds NaN or infinite scales")
    return t


def dequantize_4bit(parts: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """One 4-bit layer's parts (on one device) -> its float32 weight."""
    state = _quant_state(parts["weight.quant_state"], name)
    shape = [int(v) for v in state["shape"]]
    block = int(state["blocksize"])
    # a code book per code value: 16 for the 4-bit codes, 256 for the 8-bit nested absmax
    books = {"weight.quant_map": 16, "weight.nested_quant_map": 256}
    for part, size in books.items():
        if part in parts and parts[part].numel() != size:
            raise ValueError(
                f"{name}.{part}: {parts[part].numel()} entries, not one per code ({size})"
            )
    n = 1
    for v in shape:
        n *= v
    packed = parts["weight"].reshape(-1)
    if packed.numel() * 2 < n:
        raise ValueError(f"{name}: {packed.numel()} bytes cannot hold {shape} 4-bit values")
    codes = torch.stack([packed >> 4, packed & 15], dim=-1).reshape(-1)[:n].long()
    absmax = parts["weight.absmax"]
    if "nested_blocksize" in state:
        if "weight.nested_absmax" not in parts:
            raise ValueError(
                f"{name}: double-quantized scales without nested_absmax (the config does not "
                "say bnb_4bit_use_double_quant)"
            )
        nested = _finite(parts["weight.nested_absmax"].float(), f"{name}.weight.nested_absmax")
        book = parts["weight.nested_quant_map"].float()
        j = torch.arange(absmax.numel(), device=absmax.device) // int(state["nested_blocksize"])
        if absmax.dtype != torch.uint8 or nested.numel() != (int(j[-1]) + 1 if j.numel() else 0):
            raise ValueError(
                f"{name}: double-quantized absmax ({absmax.dtype}, {absmax.numel()}) does not "
                f"match nested_absmax ({nested.numel()}) in blocks of {state['nested_blocksize']}"
            )
        absmax = book[absmax.reshape(-1).long()] * nested[j] + float(state["nested_offset"])
    absmax = _finite(absmax.float().reshape(-1), f"{name}.weight.absmax")
    if absmax.numel() != -(-n // block):
        raise ValueError(f"{name}: {absmax.numel()} scales for {n} values in blocks of {block}")
    values = parts["weight.quant_map"].float()[codes]
    scale = absmax[torch.arange(n, device=values.device) // block]
    return (values * scale).reshape(shape)


def unpack_bnb_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
    scheme: BnbScheme | None,
    dtype: torch.dtype,
    device: torch.device | str,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weight stream with each bitsandbytes layer's tensors joined and yielded as
    `X.weight` in `dtype`, dequantized on `device`; everything else passed on. A layer missing
    one of its tensors is an error naming it."""
    if scheme is None:
        yield from weights
        return
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        if scheme.bits == 8 and name.endswith(".weight_format"):
            continue  # row-major is the only format written today
        found = _part(scheme, name, t)
        if found is None:
            yield name, t
            continue
        prefix, part = found
        parts = waiting.setdefault(prefix, {})
        parts[part] = t
        if not all(p in parts for p in scheme.required):
            continue
        del waiting[prefix]
        on_device = {p: v.to(device) for p, v in parts.items()}
        if scheme.bits == 8:
            q, scb = on_device["weight"], _finite(on_device["SCB"].float(), f"{prefix}.SCB")
            if q.dim() != 2 or scb.numel() != q.shape[0]:
                raise ValueError(
                    f"{prefix}.SCB: {tuple(scb.shape)} row scales for an int8 weight of "
                    f"{tuple(q.shape)}"
                )
            w = q.float() * scb.reshape(-1, 1) * _INV_127
        else:
            w = dequantize_4bit(on_device, prefix)
        yield prefix + ".weight", w.to(dtype)
    if waiting:
        lost = [
            f"{p} (has {', '.join(sorted(parts))}; needs {', '.join(scheme.required)})"
            for p, parts in sorted(waiting.items())
        ]
        raise ValueError(f"bitsandbytes checkpoint: incomplete layers: {'; '.join(lost)}")
