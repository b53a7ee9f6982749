"""The compile key a GPU's Triton launcher gives each kernel launch, recorded under the
interpreter (which compiles nothing, so it cannot show a recompile itself).

A key is the kernel, its constexprs and launch options, and the run-time specialisation of its
other arguments: each tensor's dtype and whether its address is 16-byte aligned, each int's
width and whether it equals 1 or is divisible by 16 (bools and floats by type alone), except
the parameters a kernel lists in `do_not_specialize`. These are the rules
tests/kernels/gpu_compile.py compiles by. On a GPU each new key is one compile (or a load from
Triton's on-disk cache) on the step that first launches it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import defaultdict
from collections.abc import Iterator

import torch
from triton.runtime.interpreter import InterpretedFunction

LAUNCH_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")

# (kernel name, constexprs and launch options) -> run-time specialisations seen
Keys = dict[tuple[str, tuple], set[tuple]]


def _arg_key(value, specialize: bool) -> tuple:
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), specialize and value.data_ptr() % 16 == 0)
    if isinstance(value, bool) or not isinstance(value, int):
        return (type(value).__name__,)
    width = "i32" if -(2**31) <= value < 2**31 else "i64"
    return (width, "1" if specialize and value == 1 else specialize and value % 16 == 0)


def compile_key(fn: InterpretedFunction, args: tuple, kwargs: dict) -> tuple[tuple, tuple]:
    """(constexprs and launch options, run-time specialisation) of one launch of `fn`."""
    params = inspect.signature(fn.fn).parameters
    skip = set(fn.kwargs.get("do_not_specialize") or ())
    skip |= set(fn.kwargs.get("do_not_specialize_on_alignment") or ())
    values = dict(zip(params, args)) | kwargs
    fixed, runtime = [], []
    for i, (name, p) in enumerate(params.items()):
        value = values.get(name, p.default)
        if "constexpr" in str(p.annotation):
            fixed.append((name, value))
        else:
            runtime.append((name, *_arg_key(value, name not in skip and i not in skip)))
    options = tuple((k, kwargs[k]) for k in LAUNCH_OPTIONS if k in kwargs)
    return tuple(fixed) + options, tuple(runtime)


@contextlib.contextmanager
def record_compile_keys() -> Iterator[Keys]:
    """Every Triton launch while the block runs, as compile keys grouped by kernel and
    constexprs (the launches still run)."""
    keys: Keys = defaultdict(set)
    run = InterpretedFunction.run

    def recording(self, *args, **kwargs):
        launch_kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
        fixed, runtime = compile_key(self, args, launch_kwargs)
        keys[(self.fn.__name__, fixed)].add(runtime)
        return run(self, *args, **kwargs)

    InterpretedFunction.run = recording
    try:
        yield keys
    finally:
        InterpretedFunction.run = run


def recompiled(keys: Keys) -> dict[str, list[str]]:
    """Kernels launched with one constexpr set under more than one run-time specialisation
    (each a second compile on a GPU), with the arguments that differ."""
    out = {}
    for (name, _), variants in keys.items():
        if len(variants) > 1:
            rows = list(variants)
            differ = {a[0] for row in rows for a in row if a not in rows[0]}
            out[name] = sorted(differ)
    return out
