"""Weight-only linear layers: fp16 / int8 / int4 on CPU through torch's own CPU kernels, fp8 and
int4 on CUDA through Triton kernels (int4 also holds a 4-bit checkpoint's own codes,
`Int4Linear.from_codes`, packed_codes.py).

`quantize_model(model, "fp16" | "int8" | "int4" | "fp8")` replaces, after loading, the weight of
every linear layer (and, but for fp8, of a tied LM head) with:

    fp16  the weight rounded to float16, packed for fbgemm's fp16 GEMM (x86 CPUs): float32
          activations and accumulation, half the bytes of float32 read per token  (2 bytes)
    int8  per output channel, symmetric: w = q * scale, q in [-127, 127]     (1 byte / weight)
    int4  per group of 32 inputs, asymmetric (GGUF Q4_1's blocks): w = q * scale + min,
          q in [0, 15], nibble-packed; paged_kernels.int4_linear on CUDA   (0.5 byte / weight)
    fp8   float8_e4m3fn per output channel, w = q * scale (the row's largest |w| -> 448):
          paged_kernels.fp8_linear decodes it in the GEMM on CUDA (vLLM's `quantization="fp8"`
          with weight-only FP8); MoE experts too (`FusedMoE.to_fp8`, the MoE kernel); on the
          CPU each call dequantizes (checks, not speed)
                                                                             (1 byte / weight)

fp16 is for float32 models (`dtype="auto"` keeps float32 with it): a matmul reads half the bytes
of float32 with the same float32 arithmetic, the closest mode to float32 (each weight off by at
most 2**-11 relative) and, on CPUs without native bf16, the fastest for batches.

A forward with few rows (decode) runs the fused kernels (`aten._weight_int8pack_mm`,
`aten._weight_int4pack_mm_for_cpu`, as gpt-fast uses them), which read the small weights once
and are 2-3x faster than a dense bf16 matmul there; with many rows (prefill, large decode
batches) those kernels cost time per row, so the weight is dequantized for one dense matmul.
Activations stay in the model dtype; the fused kernels are fast in bf16 (int4 runs correctly in
fp32, slower; int8 in fp32 always dequantizes: `dtype="auto"` with quantization picks bf16 where
the CPU has it). Under a compiled forward, a single-row int8 product is traced into inductor's
C++ instead (`Int8Linear._gemv`), the fastest one-stream decode on CPU.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers import compiled_ops

QUANTIZATIONS = ("fp16", "int8", "int4", "fp8")
# Tests set this to run fp8 weights through the Triton kernel on CPU tensors (interpreter only).
TRITON_ON_CPU = False
_NO_SUBCLASS_DISPATCH = torch._C.DisableTorchFunctionSubclass
INT4_GROUP = 32
# Rows up to which the fused kernels beat dequantize + dense matmul (measured on one core of
# the project's 2-core Xeon with AMX, SmolLM2-135M shapes, bf16: equal near 12 rows).
FUSED_MAX_ROWS = 8


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] in [0, 16) -> [..., K/2], two a byte: even k in the low nibble
    (Int4Linear's and paged_kernels.Int4Weight's layout)."""
    return q[..., 0::2] | (q[..., 1::2] << 4)


def fp16_gemm_available() -> bool:
    """Whether this torch build has fbgemm's fp16-weight GEMM (x86 CPUs with AVX2)."""
    engines = torch.backends.quantized.supported_engines
    return "fbgemm" in engines or "x86" in engines


def require_fp16_gemm() -> None:
    """Raise unless `fp16_gemm_available()`."""
    if not fp16_gemm_available():
        engines = torch.backends.quantized.supported_engines
        raise ValueError(
            "quantization='fp16' needs fbgemm's fp16 GEMM, which this torch build or CPU "
            f"lacks (quantized engines: {engines}; it needs x86 with AVX2): use 'int8' or 'int4'"
        )


def _static_single_row(x: torch.Tensor) -> bool:
    """While tracing: x has exactly one row in every call of the graph (a static shape)."""
    rows = x.shape[0]
    return isinstance(rows, int) and rows == 1


class _QuantizedWeight:
    """`apply(x, bias)` = x @ W^T + bias: `run` (eager kernels) outside a compiled forward,
    `traced` inside one. `op_handle` is paged_engine::linear's handle for this weight, set by a
    compiled forward; `shape` is (N, K)."""

    shape: tuple[int, ...]
    op_handle: int | None = None

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.op_handle is not None and torch.compiler.is_compiling():
            out = self.traced(x)
        else:
            out = self.run(x)
        return out if bias is None else out + bias

    def traced(self, x: torch.Tensor) -> torch.Tensor:
        return compiled_ops.linear(x, self.op_handle)  # the graph calls `run` eagerly

    def run(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Fp16Linear(_QuantizedWeight):
    """Float16 weights in fbgemm's packed layout; `apply(x, bias)` = x @ W^T + bias computed in
    float32 (an activation of another dtype is cast to float32 and back)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        require_fp16_gemm()
        w = weight.detach().float().contiguous()  # [N, K]
        self.shape = tuple(w.shape)
        # fbgemm saturates out-of-range weights to the fp16 range (and warns; we clamp first).
        w = w.clamp(-65504.0, 65504.0)
        self.packed = torch.ops.quantized.linear_prepack_fp16(w, None)
        # The operator itself: calling the overload (or the packet) first walks the arguments
        # in Python looking for fake script objects (~3 us a call).
        overload = torch.ops.quantized.linear_dynamic_fp16.default
        self._gemm = getattr(overload, "_op", overload)

    def run(self, x: torch.Tensor) -> torch.Tensor:  # x @ W^T
        dtype = x.dtype
        x = x.contiguous() if dtype == torch.float32 else x.float().contiguous()
        # The binding asks each argument for `__torch_function__`; on the packed weights (a
        # script object) the failed lookup raises a C++ exception, ~12 of the ~17 us a small
        # GEMV costs from Python. With subclass dispatch off it checks nothing (plain tensors
        # and a script object here: nothing to dispatch).
        with _NO_SUBCLASS_DISPATCH():
            out = self._gemm(x, self.packed)
        return out if dtype == torch.float32 else out.to(dtype)

    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * 2


class Int8Linear(_QuantizedWeight):
    """Per-channel symmetric int8 weights; `apply(x, bias)` = x @ W^T + bias.

    A compiled forward (worker/cpu_compile.py) calls `use_words()`: the weight's columns are
    reordered so that int32 word j of a row holds the weights of columns j, j + K/4, j + 2K/4,
    j + 3K/4 in its bytes 0-3 (little-endian), which lets inductor's C++ decode four weights per
    32-bit lane in one fused GEMV loop (`_gemv`): ~22 GB/s of int8 weights on 2 AVX2 cores, 2.4x
    the weights per second of fbgemm's fp16 GEMV, where `_weight_int8pack_mm` reads 10-14 GB/s
    and inductor's own int8 loads (8 bytes through a stack copy per vector) 1.4 GB/s. Eager calls
    on the reordered weight permute the activation's columns the same way.
    """

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        w = weight.detach().float()  # [N, K]
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.qweight = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.scales = scale.to(dtype)  # [N]
        self.shape = tuple(w.shape)
        # After use_words(): the reordered weight as float32 [N, K/4] (each element a word of 4
        # weights: float32, not int32, because inductor's int32 vector load takes a slow path).
        self.words: torch.Tensor | None = None

    def use_words(self) -> None:
        """Reorder the weight for `_gemv` (in place: `qweight` views the same bytes)."""
        n, k = self.shape
        if self.words is not None or k % 4:
            return
        q = self.qweight.view(n, 4, k // 4).transpose(1, 2).contiguous()  # [N, K/4, 4]
        self.qweight = q.view(n, k)
        self.words = q.view(n, k).view(torch.float32)

    def traced(self, x: torch.Tensor) -> torch.Tensor:
        # A static single row (a one-sequence decode graph) is traced into inductor's fused
        # GEMV; any other row count calls the eager kernels from the graph.
        if self.words is not None and _static_single_row(x):
            return self._gemv(x)
        return super().traced(x)

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:  # [1, K] -> [1, N], traced
        w = self.words.view(torch.int32)  # type: ignore[union-attr]
        xs = x.float().view(4, -1)  # xs[i, j]: the input that byte i of word j multiplies
        acc = xs[0] * ((w << 24) >> 24).float()  # arithmetic shifts sign-extend each byte
        acc = acc + xs[1] * ((w << 16) >> 24).float()
        acc = acc + xs[2] * ((w << 8) >> 24).float()
        acc = acc + xs[3] * (w >> 24).float()
        out = acc.sum(-1) * self.scales.float()
        return out.view(1, -1).to(x.dtype)

    def run(self, x: torch.Tensor) -> torch.Tensor:  # x @ W^T, eager
        if self.words is not None:  # the reordered columns (use_words)
            t, k = x.shape
            x = x.view(t, 4, k // 4).transpose(1, 2).reshape(t, k)
        if x.shape[0] <= FUSED_MAX_ROWS and x.dtype == torch.bfloat16 and x.shape[1] % 8 == 0:
            return torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.qweight, self.scales)
        # `_weight_int8pack_mm` is scalar code for float32 / float16 activations (3.4 ms for 8
        # rows of a 1536x576 weight, against 0.4 ms for this dequantize + matmul), and on AVX2
        # returns garbage (or crashes) for several rows when K % 8 != 0 (torch 2.13).
        return F.linear(x, self.qweight.to(x.dtype)) * self.scales

    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()


class Int4Linear(_QuantizedWeight):
    """Groupwise asymmetric int4 weights (groups of INT4_GROUP inputs): w = q * scale + low.
    On CUDA (or with TRITON_ON_CPU) `paged_kernels.int4_linear` decodes them in the GEMM; on
    the CPU torch's fused kernel runs few rows and a dequantized matmul many."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        w = weight.detach().float()
        n, k = w.shape
        if k % INT4_GROUP:
            raise ValueError(f"int4 needs in_features divisible by {INT4_GROUP}, got {k}")
        groups = w.view(n, k // INT4_GROUP, INT4_GROUP)
        lo, hi = groups.amin(-1), groups.amax(-1)
        scale = ((hi - lo) / 15.0).clamp(min=1e-12)  # [N, K/G]
        q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
        self._pack(q.view(n, k), scale, lo, dtype)

    @classmethod
    def from_codes(
        cls, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, dtype: torch.dtype
    ) -> Int4Linear:
        """A checkpoint's own codes (uint8 [N, K] in [0, 16)) with scale and low [N, K/G]
        (packed_codes.py)."""
        n, k = codes.shape
        if k % INT4_GROUP or scale.shape != (n, k // INT4_GROUP) or low.shape != scale.shape:
            raise ValueError(
                f"int4 codes {tuple(codes.shape)} need scales and lows of [{n}, {k // 32}]"
            )
        self = cls.__new__(cls)
        self._pack(codes, scale.float(), low.float(), dtype)
        return self

    def _pack(self, q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, dtype) -> None:
        n, k = q.shape
        self.packed = pack_nibbles(q)
        self.scale = scale.to(dtype)
        self.low = lo.to(dtype)
        self.shape = (n, k)
        # torch's fused CPU kernel's layout (it needs N % 16 == 0; other layers always
        # dequantize); its zero point is the value of q = 8: w = (q - 8) * scale + zero.
        self.kernel_weight = self.scales_and_zeros = None
        if q.device.type == "cpu":
            if n % 16 == 0:
                self.kernel_weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                    q.to(torch.int32), 2
                )
            zero = lo + 8 * scale
            sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
            self.scales_and_zeros = sz.to(dtype)  # [K/G, N, 2]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:  # [N, K]
        n = self.packed.shape[0]
        q = torch.stack([self.packed & 0xF, self.packed >> 4], dim=-1).view(n, -1, INT4_GROUP)
        w = q.to(dtype) * self.scale[..., None].to(dtype) + self.low[..., None].to(dtype)
        return w.view(n, -1)

    def run(self, x: torch.Tensor) -> torch.Tensor:  # x @ W^T, eager
        import paged_kernels

        if (x.is_cuda or TRITON_ON_CPU) and paged_kernels.triton_available():
            return paged_kernels.int4_linear(x, self.packed, self.scale, self.low)
        if x.shape[0] <= FUSED_MAX_ROWS and self.kernel_weight is not None:
            sz = self.scales_and_zeros.to(x.dtype)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.contiguous(), self.kernel_weight, INT4_GROUP, sz
            )
        return F.linear(x, self.dequantize(x.dtype))

    def nbytes(self) -> int:
        scales = 2 * self.scale.numel() * self.scale.element_size()
        kernel = 0 if self.kernel_weight is None else self.kernel_weight.numel()
        return self.packed.numel() + kernel + scales


class Fp8Linear(_QuantizedWeight):
    """float8_e4m3fn weights with a float32 scale per output channel."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        from paged_kernels import quantize_fp8_per_channel

        self.qweight, self.scale = quantize_fp8_per_channel(weight)  # [N, K], [N]
        self.shape = tuple(weight.shape)

    def run(self, x: torch.Tensor) -> torch.Tensor:  # x @ W^T
        import paged_kernels

        if (x.is_cuda or TRITON_ON_CPU) and paged_kernels.triton_available():
            return paged_kernels.fp8_linear(x, self.qweight, self.scale)
        return F.linear(x, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)

    def nbytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * 4


Method = Fp16Linear | Int8Linear | Int4Linear | Fp8Linear


class QuantizedTiedHead:
    """A quantized copy of a tied LM head's weight: few rows run the fused kernel, many rows
    the dense weight the head shares with the token embedding (kept for lookups anyway); an
    fp16 head is as fast as the dense one at any row count, so it serves every row."""

    def __init__(self, method: Method, dense: torch.Tensor) -> None:
        self.method = method
        self.dense = dense  # the embedding's weight [V, D]
        self.shape = method.shape
        self.op_handle: int | None = None  # paged_engine::linear's, set by a compiled forward

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.op_handle is not None and torch.compiler.is_compiling():
            if _static_single_row(x):  # the method's own traced path
                return self.method.apply(x, bias)
            out = compiled_ops.linear(x, self.op_handle)  # runs `run` eagerly
        else:
            out = self.run(x)
        return out if bias is None else out + bias

    def run(self, x: torch.Tensor) -> torch.Tensor:  # x @ W^T, eager
        if x.shape[0] <= FUSED_MAX_ROWS or isinstance(self.method, Fp16Linear):
            return self.method.run(x)
        return F.linear(x, self.dense)


class QuantizedLinearMethod:
    """The `linear_method` of a linear layer whose dense weight was dropped."""

    def __init__(self, method: Method) -> None:
        self.method = method

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.method.apply(x, bias)


def _method(kind: str, weight: torch.Tensor, dtype: torch.dtype) -> Method:
    cls = {"fp16": Fp16Linear, "int8": Int8Linear, "int4": Int4Linear, "fp8": Fp8Linear}[kind]
    return cls(weight, dtype)


@torch.no_grad()
def quantize_model(model: nn.Module, kind: str) -> int:
    """Quantize every linear layer's weight (and a tied LM head) in place; returns the bytes
    of weights the model keeps per quantized layer in total."""
    from paged_engine.layers.embedding import ParallelLMHead
    from paged_engine.layers.fused_moe import FusedMoE
    from paged_engine.layers.linear import LinearBase

    if kind not in QUANTIZATIONS:
        raise ValueError(f"quantization={kind!r} is invalid: expected one of {QUANTIZATIONS}")
    total = 0
    layers: list[nn.Module] = []  # linear layers, and a tied LM head (but for fp8, as vLLM)
    for module in model.modules():
        if kind == "fp8" and isinstance(module, FusedMoE) and not module.mxfp4:
            total += module.to_fp8()  # the experts too: most of a MoE model's weights
        elif isinstance(module, LinearBase) and module.weight is None:
            continue  # quantized already (a 4-bit checkpoint's codes, packed_codes.py)
        elif isinstance(module, LinearBase) or (
            isinstance(module, ParallelLMHead)
            and getattr(model, "tie_word_embeddings", False)
            and kind != "fp8"
        ):
            layers.append(module)

    def build(module: nn.Module) -> Method:
        return _method(kind, module.weight, module.weight.dtype)

    def install(module: nn.Module, method: Method) -> int:
        if isinstance(module, LinearBase):
            del module.weight  # the dense weight is freed; the method holds the quantized one
            module.weight = None
            module.linear_method = QuantizedLinearMethod(method)
        else:  # the tied head keeps the embedding's weight
            module.linear_method = QuantizedTiedHead(method, module.weight)
        return method.nbytes()

    # fbgemm's fp16 packing runs on one thread with the GIL released: layers pack side by side
    # (the default model's 121 layers: 1.65 -> 1.14 s on 2 cores). The other kinds are torch
    # ops that use every intra-op thread already. Each layer is installed (its dense weight
    # freed) as soon as it is built, in order, so memory peaks at a few layers' copies.
    workers = min(torch.get_num_threads(), 8) if kind == "fp16" else 1
    if workers > 1 and len(layers) > 1:
        with ThreadPoolExecutor(workers) as pool:
            for module, method in zip(layers, pool.map(build, layers)):
                total += install(module, method)
    else:
        for module in layers:
            total += install(module, build(module))
    return total
