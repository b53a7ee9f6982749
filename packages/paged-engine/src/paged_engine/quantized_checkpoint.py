"""Weight-quantized checkpoints (FP8 and INT8 with scales), dequantized to the model dtype as
they load, so any architecture runs them with its unquantized layers.

`quantization_config.quant_method` names the scheme:

    fp8                 Qwen3-*-FP8, DeepSeek-V3: float8_e4m3fn `weight` [N, K] and float32
                        `weight_scale_inv` [ceil(N / bn), ceil(K / bk)], one scale per block
                        (`weight_block_size` [bn, bk], usually [128, 128]); W = w * scale
    fbgemm_fp8          fp8 `weight`, one scale per output channel (`weight_scale` [N, 1])
    compressed-tensors  llm-compressor's "float-quantized" / "int-quantized" formats: fp8 or
                        int8 `weight`, `weight_scale` per tensor, per channel or per block
                        (`block_structure`); asymmetric 8-bit weights are refused, packed
                        ones ("pack-quantized": W4A16, W8A16) load through
                        packed_checkpoint.py
    modelopt            NVIDIA ModelOpt's FP8 (`quant_algo` "FP8"): fp8 `weight`, one
                        `weight_scale`; its NVFP4 / INT4 algorithms are refused
    bitnet              BitNet b1.58's packed ternary weights (`ternary=True`; the model class
                        names it): uint8 `weight` [N / 4, K], row block i of the weight in
                        bits 2i..2i+1 of each byte as value + 1, and one `weight_scale`;
                        W = codes / scale (models/bitnet.py)

Activation scales (`input_scale`) and all-zero weight zero points (symmetric schemes written by
older compressed-tensors) are dropped: activations stay in the model dtype. An fp8 KV
cache's scales (`k_scale`, ...) go on to worker/kv_scales.py. On CUDA an FP8 checkpoint then runs
with quantization="fp8" (`fp8_checkpoint`; not in batch-invariant mode): its weights return to
FP8 with a scale per output row (the checkpoint's own codes where it had per-row scales with
each row's largest code at 448; a block-scaled checkpoint is rounded again per row). A
model class names what it loads (`checkpoint_quantizations`: these by default; gpt-oss: its own
mxfp4 only). GPTQ, AWQ and packed integer weights: packed_checkpoint.py; bitsandbytes:
bnb_checkpoint.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from paged_engine.bnb_checkpoint import bnb_scheme
from paged_engine.packed_checkpoint import packed_scheme

DEQUANTIZED = ("fp8", "fbgemm_fp8", "compressed-tensors", "modelopt", "gptq", "awq", "bitsandbytes")
_QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
_SCALES = (".weight_scale_inv", ".weight_scale")
_DROPPED = (".input_scale", ".input_scale_ub")


def _get(obj, key: str, default=None):
    return obj.get(key, default) if isinstance(obj, dict) else getattr(obj, key, default)


def quant_method(config) -> str | None:
    """The checkpoint's `quantization_config.quant_method`, or None."""
    quant = getattr(config, "quantization_config", None)
    return None if quant is None else _get(quant, "quant_method")


def checkpoint_block_size(config) -> tuple[int, int] | None:
    """The [rows, cols] of a block-wise weight scale, when the config names one."""
    quant = getattr(config, "quantization_config", None)
    size = _get(quant, "weight_block_size") if quant is not None else None
    field = "weight_block_size"
    for group in (_get(quant, "config_groups") or {}).values() if quant is not None else ():
        if not size:
            size = _get(_get(group, "weights") or {}, "block_structure")
            field = "block_structure"
    if not size:
        return None
    # two positive integers (a JSON float such as 128.0 counts): the tiles every scale covers
    if (
        not isinstance(size, (list, tuple))
        or len(size) != 2
        or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v == int(v) and v > 0
            for v in size
        )
    ):
        raise ValueError(
            f"quantization_config {field} {size!r} is not two positive integers [rows, cols]"
        )
    return (int(size[0]), int(size[1]))


def check_checkpoint_quantization(config, supported: tuple[str, ...] = DEQUANTIZED) -> None:
    """Refuse, naming it, a quantization the model cannot load (NVFP4, 5-bit GPTQ, asymmetric
    8-bit schemes, ...), before any weight is read."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return
    method = _get(quant, "quant_method")
    if method not in supported:
        raise ValueError(
            f"checkpoint quantization {method!r} is not supported; supported: "
            f"{', '.join(supported)} (or an unquantized checkpoint)"
        )
    if packed_scheme(config) is not None or bnb_scheme(config) is not None:
        return  # GPTQ, AWQ, pack-quantized, bitsandbytes: checked there
    if method == "modelopt":
        algo = _get(quant, "quant_algo")
        if algo not in (None, "FP8"):
            raise ValueError(f"modelopt quant_algo {algo!r} is not supported: only FP8")
    if method == "compressed-tensors":
        fmt = _get(quant, "format")
        # "dense": no weight quantized (an fp8 KV cache's scales alone)
        if fmt not in (None, "dense", "float-quantized", "int-quantized", "naive-quantized"):
            raise ValueError(
                f"compressed-tensors format {fmt!r} is not supported: only 8-bit weights "
                "(float-quantized, int-quantized) and packed integers (pack-quantized)"
            )
        for name, group in (_get(quant, "config_groups") or {}).items():
            weights = _get(group, "weights") or {}
            bits, symmetric = _get(weights, "num_bits", 8), _get(weights, "symmetric", True)
            if bits != 8 or symmetric is False:
                raise ValueError(
                    f"compressed-tensors group {name!r}: {bits}-bit "
                    f"{'symmetric' if symmetric is not False else 'asymmetric'} weights are not "
                    "supported, only 8-bit symmetric ones"
                )


def fp8_checkpoint(config) -> bool:
    """Whether the checkpoint's weights are FP8 (`fp8`, `fbgemm_fp8`, `modelopt`, or
    compressed-tensors with 8-bit float weights): on CUDA the engine then keeps them in FP8
    (quantization="fp8")."""
    method = quant_method(config)
    if method in ("fp8", "fbgemm_fp8", "modelopt"):
        return True
    if method != "compressed-tensors":
        return False
    groups = (_get(getattr(config, "quantization_config", None), "config_groups") or {}).values()
    kinds = [_get(_get(g, "weights") or {}, "type") for g in groups]
    return bool(kinds) and all(k == "float" for k in kinds)


def dequantize(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """w [N, K] (fp8 / int8) times its scale: one value, one per row ([N] or [N, 1]), one per
    equal group of each row's inputs ([N, G], G dividing K), or, when `block` (the config's
    [bn, bk]) is given, exactly one per block ([ceil(N / bn), ceil(K / bk)]) -> float32 [N, K].
    Any other shape, or a NaN / infinite scale, is a ValueError."""
    n, k = w.shape[-2:]
    out = w.to(torch.float32)
    scale = scale.to(device=w.device, dtype=torch.float32)
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(f"a weight scale of {tuple(scale.shape)} holds NaN or infinite values")
    if block is not None:
        # the config names the tiles: every scale is their grid (never broadcast)
        bn, bk = block
        if scale.shape != (-(-n // bn), -(-k // bk)):
            raise ValueError(
                f"a block weight scale of {tuple(scale.shape)} does not tile [{n}, {k}] in "
                f"[{bn}, {bk}] blocks (quantization_config weight_block_size)"
            )
    elif scale.numel() == 1:
        return out.mul_(scale.reshape(()))
    elif scale.dim() == 1 or (scale.dim() == 2 and scale.shape[-1] == 1):
        if scale.shape[0] != n:
            raise ValueError(f"a per-channel weight scale of {tuple(scale.shape)} for [{n}, {k}]")
        return out.mul_(scale.reshape(n, 1))
    elif scale.dim() == 2 and scale.shape[0] == n and k % scale.shape[1] == 0:
        bn, bk = 1, k // scale.shape[1]  # groups along each row (compressed-tensors "group")
    else:  # block scales whose block size no config names: their tiling would be a guess
        raise ValueError(
            f"a weight scale of {tuple(scale.shape)} for [{n}, {k}] is not per tensor, per channel "
            "or per group of a row, and quantization_config names no weight_block_size"
        )
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return out.mul_(full)


def unpack_ternary(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A packed BitNet weight, uint8 [N / 4, K] (rows [i N / 4, (i + 1) N / 4) in bits 2i..2i+1,
    each code the value + 1), divided by its per-tensor scale -> float32 [N, K]."""
    blocks = [(packed >> (2 * i)) & 3 for i in range(4)]
    codes = torch.cat(blocks, dim=0).to(torch.float32) - 1
    return codes.div_(scale.to(device=packed.device, dtype=torch.float32).reshape(()))


class TensorPairs:
    """Joins the two tensors of one weight that a checkpoint streams separately (FP8 codes and
    their scale, MXFP4 blocks and scales), in either order, by the weight's base name."""

    def __init__(self) -> None:
        self._waiting: dict[tuple[str, bool], torch.Tensor] = {}  # (base, is first) -> tensor

    def add(
        self, base: str, t: torch.Tensor, first: bool
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(first, second) once both halves of `base` arrived, else None (t waits)."""
        mate = self._waiting.pop((base, not first), None)
        if mate is None:
            self._waiting[(base, first)] = t
            return None
        return (t, mate) if first else (mate, t)

    def take_waiting(self) -> list[tuple[str, bool]]:
        """(base, is first) of every half still without its mate; forgets them."""
        waiting = sorted(self._waiting)
        self._waiting.clear()
        return waiting


def dequantize_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device | str,
    block: tuple[int, int] | None = None,
    ternary: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weight stream with every quantized `X.weight` joined to its `X.weight_scale(_inv)`
    (either may come first) and yielded as `X.weight` in `dtype`, dequantized on `device`;
    activation scales dropped; everything else passed on. A quantized weight without its scale,
    or a scale without its weight, is an error naming it. `ternary`: uint8 weights are BitNet's
    packed ternary codes (`unpack_ternary`)."""
    pairs = TensorPairs()  # first: the quantized weight, second: its scale
    for name, t in weights:
        if name.endswith(_DROPPED):
            continue
        if name.endswith(".weight_zero_point"):
            # compressed-tensors before it dropped them kept a symmetric scheme's zero points:
            # all zero, W = w * scale still
            if t.to(torch.float32).count_nonzero():
                raise ValueError(f"{name}: asymmetric (zero-point) weights are not supported")
            continue
        scale_suffix = next((s for s in _SCALES if name.endswith(s)), None)
        if scale_suffix is not None:
            pair = pairs.add(name[: -len(scale_suffix)], t, first=False)
        elif name.endswith(".weight") and (
            t.dtype in _QUANTIZED_DTYPES or (ternary and t.dtype == torch.uint8)
        ):
            pair = pairs.add(name[: -len(".weight")], t, first=True)
        else:
            yield name, t
            continue
        if pair is not None:
            prefix = name[: -len(scale_suffix or ".weight")]
            w, scale = pair
            w = w.to(device)
            dense = (
                unpack_ternary(w, scale) if w.dtype == torch.uint8 else dequantize(w, scale, block)
            )
            yield prefix + ".weight", dense.to(dtype)
    lost = [
        f"{p}.weight (no scale)" if first else f"{p}.weight_scale (no weight)"
        for p, first in pairs.take_waiting()
    ]
    if lost:
        raise ValueError(f"quantized checkpoint: unpaired tensors: {', '.join(sorted(lost))}")
