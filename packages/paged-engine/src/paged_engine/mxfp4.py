"""MXFP4 checkpoint tensors (OCP microscaling FP4: OpenAI's gpt-oss release stores its experts so).

A weight W [..., N, K] comes as two tensors, joined here into a `paged_kernels.Mxfp4Weight`:

    NAME_blocks  uint8 [..., N, K/32, 16]  two FP4 (E2M1) codes a byte, the low nibble first
    NAME_scales  uint8 [..., N, K/32]      one power of two per 32 values, biased by 127 (E8M0)

Models either dequantize it as it loads (`paged_kernels.dequantize_mxfp4`) or keep the bytes for
the MoE kernel, which decodes them tile by tile (`FusedMoE(mxfp4=True)`).
"""

from __future__ import annotations

import torch

from paged_engine.quantized_checkpoint import TensorPairs
from paged_kernels import Mxfp4Weight

_SUFFIXES = ("_blocks", "_scales")


class Mxfp4Pairs:
    """Joins each NAME_blocks with its NAME_scales as the checkpoint streams them (in either
    order); `check_done` refuses a half left without its mate."""

    def __init__(self) -> None:
        self._pairs = TensorPairs()  # first: the blocks, second: the scales

    @staticmethod
    def takes(name: str) -> bool:
        return name.endswith(_SUFFIXES)

    def add(self, name: str, w: torch.Tensor) -> tuple[str, Mxfp4Weight] | None:
        """(NAME, the weight: blocks flattened to [..., N, K/2]) once both halves arrived."""
        base, suffix = name[: -len("_blocks")], name[-len("_blocks") :]
        pair = self._pairs.add(base, w, first=suffix == "_blocks")
        if pair is None:
            return None
        blocks, scales = pair
        if blocks.dim() == scales.dim() + 1:  # the checkpoint's [..., K/32, 16]
            blocks = blocks.flatten(-2)
        return base, Mxfp4Weight(blocks, scales)

    def check_done(self) -> None:
        waiting = self._pairs.take_waiting()
        if waiting:
            names = ", ".join(base + _SUFFIXES[not first] for base, first in waiting)
            raise ValueError(f"MXFP4 checkpoint: tensors without their blocks / scales: {names}")
