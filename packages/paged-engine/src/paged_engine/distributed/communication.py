"""The collectives the sharded layers and the executor use; each is a no-op in a world of 1.

tp_all_reduce(x)        sum of x over the TP group (row-parallel outputs, embedding lookups)
tp_all_reduce_max(x)    elementwise max of x over the TP group (fp8 KV-cache scales)
tp_all_gather(x, dim)   the TP group's shards of x side by side (vocab-parallel logits)
broadcast_object(obj)   rank 0's plain-data message to every rank (cpu group, pickled)
gather_object(obj)      every rank's object, in rank order, on rank 0 (None elsewhere)
send_tensor / recv_tensor   hidden states from one pipeline stage to the next
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from paged_engine.distributed.parallel_state import get_parallel_state


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """In place: every TP rank ends with the same sum (the same bits on every rank)."""
    state = get_parallel_state()
    if state.tp_size > 1:
        dist.all_reduce(x, group=state.tp_group)
    return x


def tp_all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """In place: every TP rank ends with the elementwise max over the group (fp8 KV scales)."""
    state = get_parallel_state()
    if state.tp_size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=state.tp_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate the TP ranks' shards of x along `dim`, in rank order."""
    state = get_parallel_state()
    if state.tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(state.tp_size)]
    dist.all_gather(parts, x, group=state.tp_group)
    return torch.cat(parts, dim=dim)


def broadcast_object(obj: Any = None) -> Any:
    """Rank 0 passes `obj`; every rank returns rank 0's object."""
    state = get_parallel_state()
    if state.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=state.cpu_group)
    return box[0]


def gather_object(obj: Any) -> list[Any] | None:
    """Rank 0 gets [obj of rank 0, obj of rank 1, ...]; the other ranks get None."""
    state = get_parallel_state()
    if state.world_size == 1:
        return [obj]
    box: list[Any] | None = [None] * state.world_size if state.rank == 0 else None
    dist.gather_object(obj, box, dst=0, group=state.cpu_group)
    return box


def all_reduce_min(value: int) -> int:
    """The minimum of an int over the whole world (e.g. KV blocks that fit on every rank)."""
    state = get_parallel_state()
    if state.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=state.cpu_group)
    return int(t.item())


def send_tensor(x: torch.Tensor, dst: int) -> None:
    dist.send(x.contiguous(), dst)


def recv_tensor(shape: tuple[int, ...], dtype: torch.dtype, device, src: int) -> torch.Tensor:
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, src)
    return x


def send_object(obj: Any, dst: int) -> None:
    """A plain-data message to one rank over the cpu group."""
    dist.send_object_list([obj], dst=dst, group=get_parallel_state().cpu_group)


def recv_object(src: int) -> Any:
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=get_parallel_state().cpu_group)
    return box[0]
