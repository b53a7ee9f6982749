"""Weight-only int8 / int4 linear layers on CPU, through torch's own CPU kernels.

`quantize_model(model, "int8" | "int4")` replaces, after loading, the weight of every linear
layer (and of a tied LM head) with:

    int8  per output channel, symmetric: w = q * scale, q in [-127, 127]     (1 byte / weight)
    int4  per group of 32 inputs, asymmetric (GGUF Q4_1's blocks): w = q * scale + min,
          q in [0, 15], nibble-packed                                        (0.5 byte / weight)

A forward with few rows (decode) runs the fused kernels (`aten._weight_int8pack_mm`,
`aten._weight_int4pack_mm_for_cpu`, as gpt-fast uses them), which read the small weights once
and are 2-3x faster than a dense bf16 matmul there; with many rows (prefill, large decode
batches) those kernels cost time per row, so the weight is dequantized for one dense matmul.
Activations stay in the model dtype; the fused kernels are fast in bf16 (fp32 runs correctly,
slower: `dtype="auto"` with quantization picks bf16 where the CPU has it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATIONS = ("int8", "int4")
INT4_GROUP = 32
# Rows up to which the fused kernels beat dequantize + dense matmul (measured on one core of
# the project's 2-core Xeon with AMX, SmolLM2-135M shapes, bf16: equal near 12 rows).
FUSED_MAX_ROWS = 8


class Int8Linear:
    """Per-channel symmetric int8 weights; `apply(x, bias)` = x @ W^T + bias."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        w = weight.detach().float()  # [N, K]
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.qweight = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.scales = scale.to(dtype)  # [N]

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] <= FUSED_MAX_ROWS:
            out = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.qweight, self.scales)
        else:
            out = F.linear(x, self.qweight.to(x.dtype)) * self.scales
        return out if bias is None else out + bias

    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()


class Int4Linear:
    """Groupwise asymmetric int4 weights (groups of INT4_GROUP inputs)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        w = weight.detach().float()
        n, k = w.shape
        if k % INT4_GROUP:
            raise ValueError(f"int4 needs in_features divisible by {INT4_GROUP}, got {k}")
        groups = w.view(n, k // INT4_GROUP, INT4_GROUP)
        lo, hi = groups.amin(-1), groups.amax(-1)
        scale = ((hi - lo) / 15.0).clamp(min=1e-12)  # [N, K/G]
        q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
        q = q.view(n, k)
        self.packed = q[:, 0::2] | (q[:, 1::2] << 4)  # [N, K/2]: two weights per byte
        self.scale = scale.to(dtype)
        self.low = lo.to(dtype)
        # The fused kernel's layout (it needs N % 16 == 0; other layers always dequantize);
        # its zero point is the value of q = 8: w = (q - 8) * scale + zero.
        self.kernel_weight = None
        if n % 16 == 0:
            self.kernel_weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                q.to(torch.int32), 2
            )
        zero = lo + 8 * scale
        self.scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
        self.scales_and_zeros = self.scales_and_zeros.to(dtype)  # [K/G, N, 2]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:  # [N, K]
        n = self.packed.shape[0]
        q = torch.stack([self.packed & 0xF, self.packed >> 4], dim=-1).view(n, -1, INT4_GROUP)
        w = q.to(dtype) * self.scale[..., None].to(dtype) + self.low[..., None].to(dtype)
        return w.view(n, -1)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] <= FUSED_MAX_ROWS and self.kernel_weight is not None:
            sz = self.scales_and_zeros
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.contiguous(), self.kernel_weight, INT4_GROUP, sz.to(x.dtype)
            )
        else:
            out = F.linear(x, self.dequantize(x.dtype))
        return out if bias is None else out + bias

    def nbytes(self) -> int:
        scales = 2 * self.scale.numel() * self.scale.element_size()
        kernel = 0 if self.kernel_weight is None else self.kernel_weight.numel()
        return self.packed.numel() + kernel + scales


class QuantizedTiedHead:
    """A quantized copy of a tied LM head's weight: few rows run the fused kernel, many rows
    the dense weight the head shares with the token embedding (kept for lookups anyway)."""

    def __init__(self, method: Int8Linear | Int4Linear) -> None:
        self.method = method

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] <= FUSED_MAX_ROWS:
            return self.method.apply(x, bias)
        return F.linear(x, layer.weight, bias)


class QuantizedLinearMethod:
    """The `linear_method` of a linear layer whose dense weight was dropped."""

    def __init__(self, method: Int8Linear | Int4Linear) -> None:
        self.method = method

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.method.apply(x, bias)


def _method(kind: str, weight: torch.Tensor, dtype: torch.dtype) -> Int8Linear | Int4Linear:
    return Int8Linear(weight, dtype) if kind == "int8" else Int4Linear(weight, dtype)


@torch.no_grad()
def quantize_model(model: nn.Module, kind: str) -> int:
    """Quantize every linear layer's weight (and a tied LM head) in place; returns the bytes
    of weights the model keeps per quantized layer in total."""
    from paged_engine.layers.embedding import ParallelLMHead
    from paged_engine.layers.linear import LinearBase

    if kind not in QUANTIZATIONS:
        raise ValueError(f"quantization={kind!r} is invalid: expected one of {QUANTIZATIONS}")
    total = 0
    for module in model.modules():
        if isinstance(module, LinearBase):
            weight = module.weight
            method = _method(kind, weight, weight.dtype)
            del module.weight  # the dense weight is freed; the method holds the quantized one
            module.weight = None
            module.linear_method = QuantizedLinearMethod(method)
            total += method.nbytes()
        elif isinstance(module, ParallelLMHead) and getattr(model, "tie_word_embeddings", False):
            method = _method(kind, module.weight, module.weight.dtype)
            module.linear_method = QuantizedTiedHead(method)
            total += method.nbytes()
    return total
