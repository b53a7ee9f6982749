"""Linear layers that know their tensor-parallel shard.

Every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that takes the
full HF tensor (often a view of the memory-mapped file) and copies this rank's slice into it, so
weights load the same way at any `tp_size`. `tp_rank` / `tp_size` default to this process's
place in the parallel state (1 outside a tensor-parallel world). Column-parallel outputs stay
sharded (the next row-parallel layer consumes them); a row-parallel layer all-reduces its
partial sums, so its output is whole and identical on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.distributed.communication import tp_all_reduce
from paged_engine.distributed.parallel_state import get_tp_rank, get_tp_size

_deferred = False  # inside deferred_weights()


@contextmanager
def deferred_weights(on: bool = True) -> Iterator[None]:
    """Linear layers and MoE experts built inside keep their dense weights on "meta" (no
    memory): a 4-bit checkpoint's codes replace them as they load (packed_codes.CodesLoad)."""
    global _deferred
    outer, _deferred = _deferred, on
    try:
        yield
    finally:
        _deferred = outer


def weight_device() -> str | None:
    """Where a dense weight is built: "meta" inside deferred_weights(), else the default."""
    return "meta" if _deferred else None


def _divide(n: int, d: int, what: str) -> int:
    if n % d != 0:
        raise ValueError(
            f"tensor_parallel_size={d} must divide this layer's {what}={n} (the model cannot be "
            "split over that many ranks)"
        )
    return n // d


def _tp(tp_rank: int | None, tp_size: int | None) -> tuple[int, int]:
    """Explicit values win; otherwise this process's place in the tensor-parallel group."""
    return (get_tp_rank() if tp_rank is None else tp_rank), (
        get_tp_size() if tp_size is None else tp_size
    )


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"shape mismatch loading {name}: expected {tuple(dst.shape)}, got {tuple(src.shape)}"
        )
    dst.copy_(src)


def narrow_full(
    w: torch.Tensor, dim: int, start: int, n: int, full: int, name: str
) -> torch.Tensor:
    """`w.narrow(dim, start, n)` where `w` has the `full` size along `dim` the layer was built
    for: a checkpoint tensor larger than the config describes (a smaller intermediate_size in
    config.json) would otherwise load its leading rows silently."""
    if w.dim() <= dim or w.shape[dim] != full:
        raise ValueError(
            f"shape mismatch loading {name}: expected {full} along dim {dim}, got {tuple(w.shape)}"
        )
    return w.narrow(dim, start, n)


def shard_segments(w: torch.Tensor, sizes: list[int], rank: int, tp: int) -> torch.Tensor:
    """Rows of several segments stacked along dim 0 (full sizes `sizes`) -> this rank's rows
    of each, stacked in the same order (a fused projection whose parts split separately)."""
    parts = []
    for seg in w.split(sizes, dim=0):
        n = seg.shape[0] // tp
        parts.append(seg.narrow(0, rank * n, n))
    return torch.cat(parts, dim=0)


class LinearBase(nn.Module):
    """y = x @ W^T (+ b) with W: [out_local, in_local]."""

    def __init__(self, in_local: int, out_local: int, bias: bool, tp_rank: int, tp_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.in_local, self.out_local = in_local, out_local  # the weight may be dropped later
        self.weight = nn.Parameter(torch.empty(out_local, in_local, device=weight_device()))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        raise NotImplementedError

    # Set after loading to run the matmul another way (layers/quantization.py,
    # layers/batch_invariant.py): an object with apply(layer, x, bias).
    linear_method = None
    # Set by lora/model.py with enable_lora: adds each token's adapter delta to the output.
    lora = None

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.linear_method is None:
            return F.linear(x, self.weight, bias)
        return self.linear_method.apply(self, x, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in_local] -> [T, out_local]
        out = self._linear(x, self.bias)
        return out if self.lora is None else self.lora.apply(x, out)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: W rows [rank*out/tp, (rank+1)*out/tp)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        tp_rank, tp_size = _tp(tp_rank, tp_size)
        super().__init__(
            input_size, _divide(output_size, tp_size, "output_size"), bias, tp_rank, tp_size
        )

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        n = param.shape[0]
        src = narrow_full(loaded_weight, 0, self.tp_rank * n, n, n * self.tp_size, "column shard")
        copy_checked(param.data, src, "column shard")


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the bias is added by rank 0 only (before all-reduce)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        tp_rank, tp_size = _tp(tp_rank, tp_size)
        super().__init__(
            _divide(input_size, tp_size, "input_size"), output_size, bias, tp_rank, tp_size
        )

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if param.dim() == 1:  # bias: replicated
            copy_checked(param.data, loaded_weight, "row bias")
            return
        n = param.shape[1]
        src = narrow_full(loaded_weight, 1, self.tp_rank * n, n, n * self.tp_size, "row shard")
        copy_checked(param.data, src, "row shard")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._linear(x, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            out = tp_all_reduce(out)
        # After the reduce: the adapter's delta is whole on every rank (lora/layers.py).
        return out if self.lora is None else self.lora.apply(x, out)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stacked in one matmul (e.g. gate | up); shard_id = index."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = True,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id is None:  # an already merged tensor
            super().weight_loader(param, loaded_weight)
            return
        idx = int(shard_id)
        size = self.output_sizes[idx] // self.tp_size
        offset = sum(self.output_sizes[:idx]) // self.tp_size
        name = f"merged shard {idx}"
        src = narrow_full(loaded_weight, 0, self.tp_rank * size, size, size * self.tp_size, name)
        copy_checked(param.data.narrow(0, offset, size), src, name)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q | k | v projection; shard_id in {"q", "k", "v"}.

    Output layout per rank: [q (H/tp*D) | k (Hkv/tp*D) | v (Hkv/tp*D)]. KV heads are replicated
    when tp_size > num_kv_heads.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        bias: bool = True,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        tp_rank, tp_size = _tp(tp_rank, tp_size)
        num_kv_heads = num_kv_heads or num_heads
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp_size, "num_heads")
        if tp_size >= num_kv_heads:  # each KV head held by tp_size / num_kv_heads ranks
            if tp_size % num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size={tp_size} must be a multiple of the model's "
                    f"num_key_value_heads={num_kv_heads} when it exceeds it (KV heads replicate)"
                )
            self.num_kv_heads, self.kv_replicas = 1, tp_size // num_kv_heads
        else:
            self.num_kv_heads = _divide(num_kv_heads, tp_size, "num_key_value_heads")
            self.kv_replicas = 1
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, out, bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id is None:
            raise ValueError("QKVParallelLinear needs shard_id 'q', 'k' or 'v'")
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, rank = 0, q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = q_size + (kv_size if shard_id == "v" else 0)
            size, rank = kv_size, self.tp_rank // self.kv_replicas
        else:
            raise ValueError(f"bad QKV shard_id {shard_id!r}")
        # (a KV head replicated on kv_replicas ranks: tp_size / kv_replicas of them in all)
        ranks = self.tp_size if shard_id == "q" else self.tp_size // self.kv_replicas
        name = f"qkv shard {shard_id}"
        src = narrow_full(loaded_weight, 0, rank * size, size, size * ranks, name)
        copy_checked(param.data.narrow(0, offset, size), src, name)
