"""Sleep mode's memory (vLLM's `sleep` / `wake_up`): hand the device memory of the weights and of
the KV cache back, and take it again, without rebuilding anything.

Every tensor keeps its Python identity, shape and strides; only its storage is emptied
(`UntypedStorage.resize_(0)`) and later grown back to its old size. Whatever holds a tensor
(layers, the cache engine, quantized weights' kernels, compiled CPU graphs) keeps working after
a wake-up; CUDA graphs, which baked in the old addresses, are captured again by the runner.

    tag "weights":   the model's parameters and quantized weights ("weights" below), its buffers
                     and other tensor attributes (rope tables, LoRA slots: "buffers"), and the
                     tensors of a draft model and of the vision tower (as buffers)
    tag "kv_cache":  every layer's KV cache (a draft model's too) and the recurrent-state pools

`offload=True` (level 1) copies weights and buffers to host memory (pinned on CUDA) and back on
wake-up. Otherwise (level 2, or sleeping the "weights" tag by name) only the buffers are kept:
the weights come back holding garbage until `reload_weights` / `update_weights` fills them.
The KV cache is never kept: it comes back zeroed (a CPU cache, lazily zeroed host memory
(worker/host_memory.py), gives its pages back by madvise instead of a resize). A storage
several tensors share (a tied LM head, views of one fused weight) is handled once; storages
torch cannot resize (memory-mapped files) and opaque objects (fbgemm's packed fp16 weights)
stay where they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import torch
from torch import nn

from paged_engine.layers.quantization import Method
from paged_engine.worker import host_memory
from paged_kernels import Fp8Weight, Int4Weight

TAGS = ("weights", "kv_cache")
_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules"})


def module_tensors(model: nn.Module) -> Iterator[tuple[torch.Tensor, bool]]:
    """(tensor, is_weight) for every tensor the model's modules hold: parameters and quantized
    weights are weights; buffers, plain tensor attributes and tensors of other attribute
    objects (a LoRA layer's slots) are not. Deterministic: two models built alike yield their
    tensors in the same order."""
    yield from ((p, True) for p in model.parameters())
    yield from ((b, False) for b in model.buffers())
    for module in model.modules():
        for name, value in vars(module).items():
            if name not in _MODULE_INTERNALS and not isinstance(value, dict):
                yield from _tensors_in(value, weight=False, depth=2)


def _tensors_in(value: object, *, weight: bool, depth: int) -> Iterator[tuple[torch.Tensor, bool]]:
    if isinstance(value, torch.Tensor):
        yield value, weight
    elif isinstance(value, (Fp8Weight, Int4Weight)):  # a MoE layer's FP8 or int4 experts
        yield from ((t, True) for t in value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item, weight=weight, depth=depth)
    elif depth and hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type)):
        inner = weight or isinstance(value, Method)  # a linear layer's quantized weight
        for item in vars(value).values():
            yield from _tensors_in(item, weight=inner, depth=depth - 1)


@dataclass(slots=True)
class _Slept:
    storage: torch.UntypedStorage
    nbytes: int
    backup: torch.Tensor | None  # uint8 host copy; None: comes back zeroed or as garbage
    zero: bool  # the KV cache: zeroed on wake-up


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class SleepingMemory:
    """The storages put to sleep, per tag, on one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.asleep: dict[str, list[_Slept]] = {}

    def _storages(
        self, tensors: Iterable[tuple[torch.Tensor, bool]], exclude: AbstractSet[int]
    ) -> list[tuple[torch.UntypedStorage, bool]]:
        """(storage, is_weight) of each storage this device can free, once each: a storage
        that also backs a non-weight tensor counts as a buffer (kept)."""
        found: dict[int, tuple[torch.UntypedStorage, bool]] = {}
        for t, weight in tensors:
            if t.device != self.device or t.layout != torch.strided:
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            resizable = storage.resizable() or host_memory.is_lazy(storage)
            if not storage.nbytes() or ptr in exclude or not resizable:
                continue
            known = found.get(ptr)
            found[ptr] = (storage, weight and (known is None or known[1]))
        return list(found.values())

    def sleep(
        self,
        tag: str,
        tensors: Iterable[tuple[torch.Tensor, bool]],
        *,
        offload: bool,
        exclude: AbstractSet[int] = frozenset(),
    ) -> int:
        """Free the storages of `tensors` but those in `exclude` (data pointers of another
        tag's); returns the bytes freed. The caller has synchronized the device."""
        assert tag not in self.asleep, f"{tag} is asleep already"
        slept: list[_Slept] = []
        pin = self.device.type == "cuda"
        for storage, weight in self._storages(tensors, exclude):
            n = storage.nbytes()
            backup = None
            if tag != "kv_cache" and (offload or not weight):
                backup = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
                backup.copy_(_bytes(storage))
            slept.append(_Slept(storage, n, backup, zero=tag == "kv_cache"))
        for s in slept:
            if not host_memory.release(s.storage):  # (a lazily zeroed host cache: madvise)
                s.storage.resize_(0)
        self.asleep[tag] = slept
        return sum(s.nbytes for s in slept)

    def wake_up(self, tag: str) -> None:
        """Grow the tag's storages back: copied from their host backups, zeroed (the KV cache)
        or left uninitialized (discarded weights)."""
        for s in self.asleep.pop(tag, []):
            if host_memory.is_lazy(s.storage):  # its pages read as zeros since `release`
                continue
            s.storage.resize_(s.nbytes)
            if s.backup is not None:
                _bytes(s.storage).copy_(s.backup, non_blocking=True)
            elif s.zero:
                _bytes(s.storage).zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the pinned backups are freed after this


def copy_weights(dst: nn.Module, src: nn.Module) -> int:
    """Copy every weight storage of `src` into the matching one of `dst` (two models built
    alike: the same storages in the same order); returns the storages copied. An int8 weight
    `dst` reordered for its compiled forward (`Int8Linear.use_words`) is reordered in `src`
    first, so the bytes match."""
    for d, s in zip(_quantized(dst), _quantized(src), strict=True):
        if getattr(d, "words", None) is not None:
            s.use_words()
    pairs = list(_weight_storages(dst)), list(_weight_storages(src))
    if len(pairs[0]) != len(pairs[1]):
        raise RuntimeError(
            f"the reloaded model has {len(pairs[1])} weight tensors, the running one "
            f"{len(pairs[0])}"
        )
    for d, s in zip(*pairs):
        if d.nbytes() != s.nbytes():
            raise RuntimeError("the reloaded model's weights differ in size from the running one's")
        _bytes(d).copy_(_bytes(s))
    return len(pairs[0])


def _weight_storages(model: nn.Module) -> Iterator[torch.UntypedStorage]:
    seen: set[int] = set()
    for t, weight in module_tensors(model):
        if not weight or t.layout != torch.strided:
            continue
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() and ptr not in seen:
            seen.add(ptr)
            yield storage


def _quantized(model: nn.Module) -> Iterator[Method]:
    """The quantized weights of the model's linear layers (and a tied head), in module order."""
    for module in model.modules():
        method = getattr(getattr(module, "linear_method", None), "method", None)
        if isinstance(method, Method):
            yield method
