"""A 4-bit checkpoint's codes kept as they are (GPTQ, AWQ, W4A16): its linear layers run from
the checkpoint's own integers at half a byte a weight, as vLLM runs them.

With `keep_codes`, the checkpoint stream (packed_checkpoint.unpack_weights) yields each
eligible layer (4-bit, contiguous groups of a multiple of 32 inputs) as a `CodesWeight`
instead of a dense tensor. It stands in for the dense weight in every model's loaders:
slices of rows or of whole groups of columns (`narrow`, `split`, `chunk`, `[a:b]`, `torch.cat`
of such slices: fused projections, tensor-parallel shards) stay codes; any other use sees the
dense weight (`__torch_function__`, attribute access), so a loader that transposes or
reshapes, or a MoE layer's experts, simply get dense values. When a loader copies it into a
parameter (`param.copy_(codes)`) the dense values are written and, inside `recording()`,
where they landed is remembered. `keep_codes(model, record)` then gives each linear layer whose
whole weight arrived as codes an Int4Linear (layers/quantization.py) built from them,
exactly (w = code * scale + low, one scale and low per 32 inputs), and drops its dense weight;
a MoE layer (layers/fused_moe.py) whose experts all arrived as codes gets an Int4Weight pair,
run by the MoE kernel; every other layer keeps its dense weight. The dense weights exist while
loading (the peak is the dense model's), not after.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

GROUP = 32  # Int4Linear's group: a checkpoint's group must be a multiple of it
KEEP_CODES = "checkpoint-int4"  # the worker's quantization kind for this (loader.load_model)


@dataclass(frozen=True)
class _Piece:
    offset: int  # storage offset (elements) of the destination view
    shape: tuple[int, int]
    stride: tuple[int, ...]
    codes: CodesWeight


_record: dict[int, list[_Piece]] | None = None  # storage data_ptr -> pieces, while recording


@contextmanager
def recording() -> Iterator[dict[int, list[_Piece]]]:
    """Remember, while it lasts, every copy of a CodesWeight into a tensor."""
    global _record
    outer, _record = _record, {}
    try:
        yield _record
    finally:
        _record = outer


class CodesWeight:
    """W[n, k] = (codes[n, k] - zero[n, k // group]) * scale[n, k // group], standing in for
    the dense [N, K] weight of `dtype` (see the module docstring)."""

    __slots__ = ("codes", "dtype", "group", "scale", "zero")

    def __init__(
        self,
        codes: torch.Tensor,  # uint8 [N, K], in [0, 16)
        zero: torch.Tensor,  # int32 [N, K / group]
        scale: torch.Tensor,  # float32 [N, K / group]
        group: int,
        dtype: torch.dtype,
    ) -> None:
        self.codes, self.zero, self.scale, self.group, self.dtype = codes, zero, scale, group, dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def dim(self) -> int:
        return 2

    ndim = property(dim)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dense(self) -> torch.Tensor:
        """The dense weight, as the checkpoint stream would have yielded it."""
        zero = self.zero.repeat_interleave(self.group, dim=1)
        scale = self.scale.repeat_interleave(self.group, dim=1)
        return ((self.codes.to(torch.int32) - zero).to(torch.float32) * scale).to(self.dtype)

    def narrow(self, dim: int, start: int, length: int):
        dim = dim % 2
        if dim == 0:
            rows = slice(start, start + length)
            return CodesWeight(
                self.codes[rows], self.zero[rows], self.scale[rows], self.group, self.dtype
            )
        if start % self.group or length % self.group:  # not whole groups: dense
            return self.dense().narrow(1, start, length)
        g = slice(start // self.group, (start + length) // self.group)
        return CodesWeight(
            self.codes[:, start : start + length],
            self.zero[:, g],
            self.scale[:, g],
            self.group,
            self.dtype,
        )

    def split(self, sizes, dim: int = 0):
        n = self.shape[dim]
        if isinstance(sizes, int):
            sizes = [min(sizes, n - s) for s in range(0, n, sizes)]
        out, start = [], 0
        for size in sizes:
            out.append(self.narrow(dim, start, size))
            start += size
        return out

    def chunk(self, chunks: int, dim: int = 0):
        n = self.shape[dim]
        return self.split(-(-n // chunks), dim)

    def __getitem__(self, index):
        if isinstance(index, slice):
            index = (index,)
        if (
            isinstance(index, tuple)
            and len(index) <= 2
            and all(isinstance(i, slice) and i.step in (None, 1) for i in index)
        ):
            out = self
            for dim, i in enumerate(index):  # rows, then columns (whole groups stay codes)
                start, stop, _ = i.indices(self.shape[dim])
                if (start, stop) != (0, self.shape[dim]):
                    out = out.narrow(dim, start, max(stop - start, 0))
            return out
        return self.dense()[index]

    def __len__(self) -> int:
        return self.shape[0]

    def __getattr__(self, name: str):  # anything else (t, to, reshape, ...): the dense weight
        return getattr(self.dense(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and isinstance(args[1], CodesWeight):
            dst, src = args[0], args[1]
            if _record is not None and dst.dim() == 2:
                piece = _Piece(dst.storage_offset(), tuple(dst.shape), dst.stride(), src)
                _record.setdefault(dst.untyped_storage().data_ptr(), []).append(piece)
            return dst.copy_(src.dense(), *args[2:], **kwargs)
        if func is torch.cat and _rows_of_codes(args, kwargs):
            parts = args[0]
            return CodesWeight(
                torch.cat([p.codes for p in parts]),
                torch.cat([p.zero for p in parts]),
                torch.cat([p.scale for p in parts]),
                parts[0].group,
                parts[0].dtype,
            )
        return func(*_dense(args), **{k: _dense(v) for k, v in kwargs.items()})


def _dense_op(name: str):
    def op(self, *args):
        return getattr(self.dense(), name)(*_dense(args))

    op.__name__ = name
    return op


# Arithmetic (a loader scaling a weight) sees the dense weight too.
for _name in (
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__truediv__",
    "__neg__",
    "__matmul__",
    "__rmatmul__",
):
    setattr(CodesWeight, _name, _dense_op(_name))


def _rows_of_codes(args, kwargs) -> bool:
    """torch.cat of CodesWeights of one group along dim 0."""
    parts = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    return (
        isinstance(parts, (list, tuple))
        and len(parts) > 0
        and dim == 0
        and all(isinstance(p, CodesWeight) for p in parts)
        and len({(p.group, p.shape[1]) for p in parts}) == 1
    )


def _dense(value):
    if isinstance(value, CodesWeight):
        return value.dense()
    if isinstance(value, (list, tuple)):
        return type(value)(_dense(v) for v in value)
    return value


def _assemble(weight: torch.Tensor, pieces: list[_Piece]) -> CodesWeight | None:
    """The codes of the whole of `weight` ([N, K], or experts' [E, N, K]: each expert's pieces
    in its own [N, K]) when its pieces cover it in whole groups of one size, else None. The
    result is [E * N, K] for experts."""
    n, k = weight.shape[-2:]
    group = pieces[0].codes.group
    contiguous = weight.stride() == tuple(torch.empty(weight.shape, device="meta").stride())
    if not contiguous or any(p.codes.group != group for p in pieces):
        return None
    rows_all = weight.numel() // k
    codes = torch.empty(rows_all, k, dtype=torch.uint8, device=weight.device)
    zero = torch.empty(rows_all, k // group, dtype=torch.int32, device=weight.device)
    scale = torch.empty(rows_all, k // group, dtype=torch.float32, device=weight.device)
    covered = 0
    base = weight.storage_offset()
    for p in pieces:
        rows, cols = p.shape
        first, col = divmod(p.offset - base, k)  # first: the row in [E * N, K]
        if p.stride != (k, 1) or col % group or cols % group or first % n + rows > n:
            return None
        codes[first : first + rows, col : col + cols] = p.codes.codes
        g = slice(col // group, (col + cols) // group)
        zero[first : first + rows, g] = p.codes.zero
        scale[first : first + rows, g] = p.codes.scale
        covered += rows * cols
    if covered != weight.numel():  # a part came as dense values (or twice)
        return None
    return CodesWeight(codes, zero, scale, group, weight.dtype)


def _int4_parts(codes: CodesWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [R, K/2], scale, low [R, K/32] float32) of Int4Linear's layout."""
    repeat = codes.group // GROUP
    scale = codes.scale.repeat_interleave(repeat, dim=1)
    low = -(codes.zero.repeat_interleave(repeat, dim=1) * scale)
    q = codes.codes
    return q[:, 0::2] | (q[:, 1::2] << 4), scale, low


@torch.no_grad()
def keep_codes(model: nn.Module, record: dict[int, list[_Piece]]) -> tuple[int, int]:
    """Give every linear layer whose whole weight was copied from codes an Int4Linear of
    them, and every MoE layer whose experts all were an Int4Weight pair, their dense weights
    dropped; returns (layers converted, linear and MoE layers in all)."""
    from paged_engine.layers.fused_moe import FusedMoE
    from paged_engine.layers.linear import LinearBase
    from paged_engine.layers.quantization import Int4Linear, QuantizedLinearMethod
    from paged_kernels import Int4Weight

    def codes_of(weight: torch.Tensor) -> CodesWeight | None:
        pieces = record.get(weight.untyped_storage().data_ptr())
        return _assemble(weight, pieces) if pieces else None

    converted = total = 0
    for module in model.modules():
        if isinstance(module, LinearBase) and module.weight is not None:
            total += 1
            codes = codes_of(module.weight)
            if codes is None:
                continue
            _, scale, low = _int4_parts(codes)
            method = Int4Linear.from_codes(codes.codes, scale, low, module.weight.dtype)
            del module.weight  # the method holds the codes
            module.weight = None
            module.linear_method = QuantizedLinearMethod(method)
            converted += 1
        elif isinstance(module, FusedMoE) and getattr(module, "gate_up_proj", None) is not None:
            total += 1
            pair = [codes_of(module.gate_up_proj), codes_of(module.down_proj)]
            if None in pair:
                continue
            weights = []
            for codes, dense in zip(pair, (module.gate_up_proj, module.down_proj)):
                packed, scale, low = _int4_parts(codes)
                e, n, k = dense.shape
                weights.append(
                    Int4Weight(
                        packed.view(e, n, k // 2),
                        scale.to(dense.dtype).view(e, n, -1),
                        low.to(dense.dtype).view(e, n, -1),
                    )
                )
            module.int4 = (weights[0], weights[1])
            del module.gate_up_proj, module.down_proj  # the dense experts are freed
            module.gate_up_proj = module.down_proj = None
            converted += 1
    return converted, total
