"""A 4-bit checkpoint's codes kept as they are (GPTQ, AWQ, W4A16): its linear layers and MoE
experts run from the checkpoint's own integers at half a byte a weight, as vLLM runs them.

With `keep_codes`, the checkpoint stream (packed_checkpoint.unpack_weights) yields each
eligible layer (4-bit, contiguous groups of a multiple of 32 inputs) as a `CodesWeight`
instead of a dense tensor. It stands in for the dense weight in every model's loaders:
slices of rows or of whole groups of columns (`narrow`, `split`, `chunk`, `[a:b]`, `torch.cat`
of such slices: fused projections, tensor-parallel shards) stay codes; any other use sees the
dense weight (`__torch_function__`, attribute access), so a loader that transposes or
reshapes simply gets dense values.

The model is built with its linear layers' and experts' dense weights deferred (on "meta": no
memory, layers/linear.py `deferred_weights`). While it loads, `CodesLoad` watches every copy of
codes into one of them (`param.copy_(codes)`, by storage and offset) and, the moment a layer's
whole weight has arrived, gives it an Int4Linear built from them exactly (w = code * scale +
low, one scale and low per 32 inputs; layers/quantization.py), or an MoE layer an Int4Weight
pair for the MoE kernel. So the memory peak is the codes plus a few layers in flight, never the
dense model. Layers whose weight did not arrive wholly as codes (dense pieces from a transposing
loader, act-order, a shard cutting a group) get real weights afterwards and a second, dense
pass over the checkpoint fills them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

KEEP_CODES = "checkpoint-int4"  # the worker's quantization kind for this (loader.load_model)


@dataclass(frozen=True)
class _Piece:
    offset: int  # storage offset (elements) of the destination view
    shape: tuple[int, int]
    stride: tuple[int, ...]
    codes: CodesWeight


_active: CodesLoad | None = None  # the load whose copies are being watched


def _key(t: torch.Tensor) -> int:
    """One tensor storage's identity (its StorageImpl; meta storages have no data pointer)."""
    return t.untyped_storage()._cdata


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
            if _active is not None and dst.dim() == 2 and _active.add(dst, src):
                return dst  # a deferred (meta) weight: its codes were taken instead
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
    device = pieces[0].codes.device  # the weight itself may be a deferred (meta) one
    codes = torch.empty(rows_all, k, dtype=torch.uint8, device=device)
    zero = torch.empty(rows_all, k // group, dtype=torch.int32, device=device)
    scale = torch.empty(rows_all, k // group, dtype=torch.float32, device=device)
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


def _scale_low(codes: CodesWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, low) float32 [R, K/32] of Int4Linear's layout: w = code * scale + low."""
    from paged_engine.layers.quantization import INT4_GROUP

    repeat = codes.group // INT4_GROUP
    scale = codes.scale.repeat_interleave(repeat, dim=1)
    return scale, -(codes.zero.repeat_interleave(repeat, dim=1) * scale)


class CodesLoad:
    """Watches one checkpoint load into `model`, built with its linear layers' and experts'
    dense weights deferred (layers/linear.py `deferred_weights`: on "meta", no memory): a
    layer becomes its Int4Linear (an MoE layer its Int4Weight pair) the moment all of its
    weight has arrived as codes, so the codes of a few layers at most are held at once.
    `leftovers()` are the layers that did not (dense pieces, act-order, ...): `materialize`
    gives them real weights for a second, dense pass over the checkpoint, placeholders
    standing in for the converted ones meanwhile (`drop_placeholders` after)."""

    def __init__(self, model: nn.Module) -> None:
        from paged_engine.layers.fused_moe import FusedMoE
        from paged_engine.layers.linear import LinearBase

        # storage -> (module, attribute) of every deferred weight
        self.targets: dict[int, tuple[nn.Module, str]] = {}
        for module in model.modules():
            names = ()
            if isinstance(module, LinearBase):
                names = ("weight",)
            elif isinstance(module, FusedMoE) and not module.mxfp4:
                names = ("gate_up_proj", "down_proj")
            for name in names:
                weight = getattr(module, name, None)
                if weight is not None and weight.is_meta:
                    self.targets[_key(weight)] = (module, name)
        self.pieces: dict[int, list[_Piece]] = {}
        self.covered: dict[int, int] = {}
        self.ready: dict[nn.Module, dict[str, CodesWeight]] = {}  # MoE: waiting for its pair
        self.converted: list[nn.Module] = []
        self._placeholders: list[tuple[nn.Module, str]] = []

    @contextmanager
    def watching(self) -> Iterator[CodesLoad]:
        global _active
        outer, _active = _active, self
        try:
            yield self
        finally:
            _active = outer

    def add(self, dst: torch.Tensor, src: CodesWeight) -> bool:
        """A copy of codes into `dst`: True when dst belongs to a deferred weight (taken)."""
        key = _key(dst)
        target = self.targets.get(key)
        if target is None:
            return False
        module, name = target
        weight = getattr(module, name)
        piece = _Piece(dst.storage_offset(), tuple(dst.shape), dst.stride(), src)
        self.pieces.setdefault(key, []).append(piece)
        self.covered[key] = self.covered.get(key, 0) + piece.shape[0] * piece.shape[1]
        if self.covered[key] >= weight.numel():
            codes = _assemble(weight, self.pieces.pop(key))
            if codes is not None:
                self._convert(module, name, codes)
        return True

    def _convert(self, module: nn.Module, name: str, codes: CodesWeight) -> None:
        from paged_engine.layers.linear import LinearBase
        from paged_engine.layers.quantization import (
            Int4Linear,
            QuantizedLinearMethod,
            pack_nibbles,
        )
        from paged_kernels import Int4Weight

        weight = getattr(module, name)
        if isinstance(module, LinearBase):
            scale, low = _scale_low(codes)
            method = Int4Linear.from_codes(codes.codes, scale, low, weight.dtype)
            module.linear_method = QuantizedLinearMethod(method)
            self._detach(module, "weight")
            self.converted.append(module)
            return
        ready = self.ready.setdefault(module, {})
        ready[name] = codes
        if len(ready) < 2:
            return
        pair = []
        for attr in ("gate_up_proj", "down_proj"):
            scale, low = _scale_low(ready[attr])
            packed = pack_nibbles(ready[attr].codes)
            e, n, k = getattr(module, attr).shape
            dtype = getattr(module, attr).dtype
            pair.append(
                Int4Weight(
                    packed.view(e, n, k // 2),
                    scale.to(dtype).view(e, n, -1),
                    low.to(dtype).view(e, n, -1),
                )
            )
        module.int4 = (pair[0], pair[1])
        for attr in ("gate_up_proj", "down_proj"):
            self._detach(module, attr)
        del self.ready[module]
        self.converted.append(module)

    def _detach(self, module: nn.Module, name: str) -> None:
        weight = getattr(module, name)
        self.targets.pop(_key(weight), None)
        delattr(module, name)
        setattr(module, name, None)

    def leftovers(self) -> list[tuple[nn.Module, str]]:
        """The deferred weights that did not become codes (still on meta)."""
        return list(self.targets.values())

    def materialize(self, device: torch.device | str) -> None:
        """Real storage for every leftover (its loader kept), and for the converted layers'
        weights a meta placeholder whose loader takes nothing: a second pass over the
        checkpoint loads the leftovers dense and routes the rest as before."""
        for module, name in self.leftovers():
            meta = getattr(module, name)
            real = nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype, device=device))
            real.weight_loader = meta.weight_loader
            setattr(module, name, real)
        for module in self.converted:
            for name, shape in _shapes(module):
                holder = nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)
                holder.weight_loader = _ignore
                setattr(module, name, holder)
                self._placeholders.append((module, name))
        self.targets.clear()

    def drop_placeholders(self) -> None:
        for module, name in self._placeholders:
            delattr(module, name)
            setattr(module, name, None)
        self._placeholders.clear()


def _shapes(module: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """A converted layer's dense weight shapes, by attribute."""
    from paged_engine.layers.linear import LinearBase

    if isinstance(module, LinearBase):
        return [("weight", tuple(module.linear_method.method.shape))]
    gate_up, down = module.int4
    return [
        ("gate_up_proj", (*gate_up.packed.shape[:-1], gate_up.packed.shape[-1] * 2)),
        ("down_proj", (*down.packed.shape[:-1], down.packed.shape[-1] * 2)),
    ]


def _ignore(param: torch.Tensor, loaded, shard_id=None) -> None:
    """The loader of a converted layer's placeholder: its weight is the codes already."""
