"""The Triton kernels a built model's layers switch to where the Triton backend runs (CUDA's
default; on a CPU, Triton's interpreter): the worker calls each `use_triton_*` once, after
loading and before CUDA graphs are captured. Each layer keeps its torch ops as the fallback and
takes the kernel through an attribute (`kernel`, `add_kernel`), so the same module runs either
way; every kernel rounds where the torch ops round (docs/kernels.md, "Layer epilogues").

    use_triton_norms        RMSNorm (Gemma's, OLMo 2's too) -> paged_kernels.rms_norm; a plain
                            one's add_forward (a residual add and the norm) -> add_rms_norm
    use_triton_rope         RotaryEmbedding.rotate_qkv_ -> rope_qk_ (q and k heads in place,
                            Qwen3's q/k norms included)
    use_triton_activations  SiluAndMul -> silu_and_mul
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from paged_engine.layers.activation import SiluAndMul
from paged_engine.layers.norm import RMSNorm, rms_norm_kernel
from paged_engine.layers.rotary import RotaryEmbedding


def _switch(modules: list[nn.Module], attr: str, kernel: Callable) -> int:
    """Set `attr` to `kernel` where it is unset (a batch-invariant kernel stays); returns how
    many modules it set."""
    switched = 0
    for module in modules:
        if getattr(module, attr) is None:
            setattr(module, attr, kernel)
            switched += 1
    return switched


def use_triton_norms(model: nn.Module) -> int:
    """Every RMSNorm as paged_kernels.rms_norm: one kernel a norm instead of four (upcast,
    norm, downcast, weight), with the norm's roundings (fp32 statistics; a 16-bit row rounded
    before the weight, or Gemma's and OLMo 2's fp32 product rounded once: rms_norm_kernel).
    Plain ones without an offset also run `add_forward` as one paged_kernels.add_rms_norm.
    Returns how many norms it switched."""
    from paged_kernels import add_rms_norm

    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    switched = 0
    for norm in norms:
        if norm.kernel is None:  # (a batch-invariant kernel stays)
            norm.kernel = rms_norm_kernel(norm)
            switched += 1
    plain = [m for m in norms if type(m) is RMSNorm and not m.weight_offset]
    _switch(plain, "add_kernel", add_rms_norm)
    return switched


def use_triton_rope(model: nn.Module) -> int:
    """Every rope's `rotate_qkv_` (Llama-family attention asks for it) as paged_kernels.rope_qk_:
    one kernel for a layer's q and k heads, their per-head norms included. Returns how many
    ropes it switched."""
    from paged_kernels import rope_qk_

    ropes = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    return _switch(ropes, "kernel", rope_qk_)


def use_triton_activations(model: nn.Module) -> int:
    """Every SiluAndMul as paged_kernels.silu_and_mul: one kernel instead of two, silu(gate)
    never written out. Returns how many it switched."""
    from paged_kernels import silu_and_mul

    return _switch(
        [m for m in model.modules() if isinstance(m, SiluAndMul)], "kernel", silu_and_mul
    )
