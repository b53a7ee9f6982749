"""The collectives the sharded layers and the executor use; each is a no-op in a world of 1.

tp_all_reduce(x)        sum of x over the TP group (row-parallel outputs, embedding lookups)
tp_all_reduce_max(x)    elementwise max of x over the TP group (fp8 KV-cache scales)
tp_all_gather(x, dim)   the TP group's shards of x side by side (vocab-parallel logits)
broadcast_object(obj)   rank 0's plain-data message to every rank (cpu group, pickled)
gather_object(obj)      every rank's object, in rank order, on rank 0 (None elsewhere)
every_rank_failed(t)    after a step raised: whether every rank failed it (fail group)
send_tensor / recv_tensor   hidden states from one pipeline stage to the next
send_object / recv_object   plain data from one rank to another (the last stage's outputs)

Gloo's point-to-point sends (and a broadcast's root) wait until the peer posts the matching
receive. Pipeline stages must not wait for one another that way (the first stage runs step N+1
while the last runs step N: micro-batching), so the `*_async` variants return at once and keep
their buffers here until the peer took them (`release_sends` drops those a later step proved
taken, `wait_sends` waits for all). Both sides of every message go through this module, in the
same order per pair of ranks: a length, then the bytes.
"""

from __future__ import annotations

import datetime
import pickle
from collections import deque
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
    group = state.cpu_group
    if state.rank == 0:
        for t in _packed(obj):
            dist.broadcast(t, src=0, group=group)
        return obj
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group)
    return pickle.loads(data.numpy().tobytes())


def broadcast_object_async(obj: Any) -> None:
    """Rank 0's `broadcast_object` without waiting for the other ranks to receive it (they
    call `broadcast_object()` as usual): the first stage goes on while later ones still run."""
    state = get_parallel_state()
    if state.world_size == 1:
        return
    assert state.rank == 0, "only rank 0 broadcasts"
    for t in _packed(obj):
        _keep(dist.broadcast(t, src=0, group=state.cpu_group, async_op=True), t)


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


def every_rank_failed(timeout_s: float) -> bool:
    """Called by each rank whose step raised: True once every rank has called it (each failed
    the step and none waits in a collective: the ranks are in step again), False if one has
    not within `timeout_s` (it succeeded, or waits in a collective for the failed ones)."""
    state = get_parallel_state()
    if state.fail_group is None:
        return False
    try:
        dist.monitored_barrier(
            group=state.fail_group, timeout=datetime.timedelta(seconds=timeout_s)
        )
    except RuntimeError:
        return False
    return True


def send_tensor(x: torch.Tensor, dst: int) -> None:
    dist.send(x.contiguous(), dst)


def send_tensor_async(x: torch.Tensor, dst: int) -> None:
    """`send_tensor` that returns before `dst` received it (its buffer is kept until then)."""
    x = x.contiguous()
    _keep(dist.isend(x, dst), x)


def recv_tensor(shape: tuple[int, ...], dtype: torch.dtype, device, src: int) -> torch.Tensor:
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, src)
    return x


def send_object(obj: Any, dst: int) -> None:
    """A plain-data message to one rank over the cpu group."""
    group = get_parallel_state().cpu_group
    for t in _packed(obj):
        dist.send(t, dst=dst, group=group)


def send_object_async(obj: Any, dst: int) -> None:
    """`send_object` that returns before `dst` received it."""
    group = get_parallel_state().cpu_group
    for t in _packed(obj):
        _keep(dist.isend(t, dst=dst, group=group), t)


def recv_object(src: int) -> Any:
    group = get_parallel_state().cpu_group
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=src, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src=src, group=group)
    return pickle.loads(data.numpy().tobytes())


# Async sends not yet known to be received, oldest first: (number, work, the buffer it reads).
# A gloo send's work reports completion only from wait() (an async broadcast's completes on its
# own), and a wait with a timeout that expires closes the pair: a send leaves this queue when
# the caller, who knows from the protocol that its peer took it, releases it (`release_sends`).
_sends: deque[tuple[int, dist.Work, torch.Tensor]] = deque()
_num_kept = 0  # async sends so far: the number of the next one


def _keep(work: dist.Work, buf: torch.Tensor) -> None:
    global _num_kept
    while _sends and _sends[0][1].is_completed():
        _sends.popleft()
    _sends.append((_num_kept, work, buf))
    _num_kept += 1


def sends_mark() -> int:
    """The number the next async send gets: `release_sends(mark)` drops those before it."""
    return _num_kept


def release_sends(mark: int) -> None:
    """Drop the async sends numbered below `mark`, each of which its peer has received (the
    caller's invariant): their waits return at once; one still in flight would block here."""
    while _sends and _sends[0][0] < mark:
        _sends.popleft()[1].wait()


def pending_sends() -> int:
    """How many async sends this process still holds (their buffers included)."""
    return len(_sends)


def wait_sends() -> None:
    """Wait until every async send of this process was received (before leaving the world)."""
    while _sends:
        _sends.popleft()[1].wait()


def _packed(obj: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The wire form of a plain-data message: its length (int64 [1]), then its pickled bytes."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    return torch.tensor([data.numel()], dtype=torch.int64), data
