"""The two operators a `torch.compile`d forward keeps opaque (worker/cpu_compile.py).

    paged_engine::linear(x, handle)           a quantized linear layer's eager kernels: fbgemm's
                                              fp16 GEMM (its packed weight is a TorchScript
                                              object, which dynamo cannot trace), and the int8 /
                                              int4 kernels, which pick their path by row count
    paged_engine::attention(q, k, v, handle)  KV write + paged attention: per-step index
                                              tensors and a KV cache the graph must not copy

Inductor fuses everything between them (norms, RoPE, residual adds, SiLU * up; an int8 layer's
single-row GEMV too, traced from `Int8Linear._gemv`) and calls them from its generated code. An
operator's integer `handle` names the layer object it runs; the attention operator reads the
step's caches and metadata from `forward_context`, which the compiled forward sets around each
call. Both are defined with `torch.library.Library` (~3 us a call less than
`torch.library.custom_op`, which matters for 120 GEMVs a token).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

_NAMESPACE = "paged_engine"
_LIB = torch.library.Library(_NAMESPACE, "DEF")
_LIB.define("linear(Tensor x, int handle) -> Tensor")
_LIB.define("attention(Tensor q, Tensor k, Tensor v, int handle) -> Tensor")

# handle -> layer object. Weak: a dropped engine frees its layers; handles are never reused.
_LAYERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_NEXT_HANDLE = itertools.count(1)

# `.step`: (kv_caches, attention metadata) of the forward running on this thread (engines on
# other threads run their own), None outside one.
_CONTEXT = threading.local()


def register(layer: Any) -> int:
    """A new handle for `layer` (a quantized linear method or an `Attention`)."""
    handle = next(_NEXT_HANDLE)
    _LAYERS[handle] = layer
    return handle


@contextmanager
def forward_context(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], md: Any) -> Iterator[None]:
    _CONTEXT.step = (kv_caches, md)
    try:
        yield
    finally:
        _CONTEXT.step = None


def _linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    return _LAYERS[handle].run(x)


def _linear_fake(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], _LAYERS[handle].shape[0])


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: int) -> torch.Tensor:
    step = getattr(_CONTEXT, "step", None)
    if step is None:
        raise RuntimeError("paged_engine::attention called outside a compiled forward")
    layer = _LAYERS[handle]
    kv_caches, md = step
    return layer.run(q, k, v, kv_caches[layer.kv_index], md)


def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: int):
    return torch.empty_like(q)


_LIB.impl("linear", _linear, "CPU")
_LIB.impl("attention", _attention, "CPU")
torch.library.register_fake(f"{_NAMESPACE}::linear", _linear_fake, lib=_LIB)
torch.library.register_fake(f"{_NAMESPACE}::attention", _attention_fake, lib=_LIB)

linear = torch.ops.paged_engine.linear.default
attention = torch.ops.paged_engine.attention.default
