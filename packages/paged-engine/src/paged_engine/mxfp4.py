"""MXFP4 checkpoint tensors (OCP microscaling FP4, as OpenAI's gpt-oss release stores its experts),
dequantized as they load.

A weight W [..., N, K] is stored as two tensors:

    NAME_blocks  uint8 [..., N, K/32, 16]  two FP4 (E2M1) codes a byte, the low nibble first
    NAME_scales  uint8 [..., N, K/32]      one power of two per 32 values, biased by 127 (E8M0)

    W[..., n, 32 g + j] = E2M1[code j of block g] * 2^(scales[..., n, g] - 127)

E2M1 codes 0-7 are +0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8-15 the same values negated. Every
value is exact in bfloat16 and float16 while the scale stays in their range.
"""

from __future__ import annotations

import torch

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_SUFFIXES = ("_blocks", "_scales")


def dequantize_mxfp4(
    blocks: torch.Tensor,  # uint8 [..., N, G, 16]
    scales: torch.Tensor,  # uint8 [..., N, G]
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., N, G * 32] in dtype, on blocks' device
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks / scales must be uint8, got {blocks.dtype} / {scales.dtype}"
        )
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} must be scales' shape {tuple(scales.shape)} "
            "plus a last dimension of 16 bytes"
        )
    table = torch.tensor(_E2M1, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., N, G, 32]
    values = table[codes.long()]
    exponents = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exponents.unsqueeze(-1).to(torch.float32))
    return values.flatten(-2).to(dtype)


class Mxfp4Pairs:
    """Joins each NAME_blocks with its NAME_scales as the checkpoint streams them (in any
    order) and hands back NAME with the dequantized weight."""

    def __init__(self) -> None:
        self._pending: dict[str, torch.Tensor] = {}

    @staticmethod
    def takes(name: str) -> bool:
        return name.endswith(_SUFFIXES)

    def add(
        self, name: str, w: torch.Tensor, like: torch.Tensor
    ) -> tuple[str, torch.Tensor] | None:
        """(NAME, weight in like's dtype on like's device) once both halves arrived, else None."""
        base, suffix = name[: -len("_blocks")], name[-len("_blocks") :]
        other = base + (_SUFFIXES[1] if suffix == _SUFFIXES[0] else _SUFFIXES[0])
        if other not in self._pending:
            self._pending[name] = w
            return None
        mate = self._pending.pop(other)
        blocks, scales = (w, mate) if suffix == "_blocks" else (mate, w)
        device = like.device
        return base, dequantize_mxfp4(blocks.to(device), scales.to(device), like.dtype)

    def check_done(self) -> None:
        if self._pending:
            names = ", ".join(sorted(self._pending))
            self._pending.clear()
            raise ValueError(f"MXFP4 checkpoint: tensors without their blocks / scales: {names}")


def check_quantization(config, supported: tuple[str, ...] = ("mxfp4",)) -> None:
    """Refuse a checkpoint quantized in a way this model cannot load, naming the method."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    method = method or getattr(quant, "quant_method", None)
    if method not in supported:
        raise ValueError(
            f"checkpoint quantization {method!r} is not supported for "
            f"{(getattr(config, 'architectures', None) or ['this model'])[0]}: supported "
            f"{list(supported)}"
        )
