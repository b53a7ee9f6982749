"""The worker's side of KV transfer: copies whole blocks between the KV cache and the block
files (storage.py), each rank its own shard (its KV heads; the rank is in the file name).

Loads run before the step's forward (the scheduler counted those blocks as computed), saves
after it (the blocks' KV was just written). A block file that fails its check at load time (gone
or changed since the scheduler's lookup checked it, on any tensor-parallel rank) is reported
back (`ModelRunnerOutput.invalid_block_ids`, vLLM's name): the step's results for its sequence
are dropped and the engine core recomputes it (core/step_apply.py, `_drop_failed_loads`),
so a vanished file costs time, never a request or a wrong token. A save that fails (disk full,
no permission, the directory gone) is logged and skipped: the block is simply not stored.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch

from paged_engine.distributed.communication import tp_all_reduce_max
from paged_engine.kv_transfer.config import KVTransferConfig
from paged_engine.kv_transfer.storage import Spec, block_path, dtype_name, read_block, write_block

if TYPE_CHECKING:
    from paged_engine.core.sched_output import SchedulerOutput
    from paged_engine.worker.cache_engine import CacheEngine

logger = logging.getLogger(__name__)

# distinct sizes: where the backend's layout puts each axis
_N, _BS, _H, _D = 11, 13, 17, 19


class KVBlockIO:
    def __init__(self, cfg: KVTransferConfig, cache: CacheEngine) -> None:
        from paged_engine.distributed.parallel_state import get_parallel_state

        state = get_parallel_state()
        self.rank, self.world = state.tp_rank, state.tp_size
        self.root = cfg.shared_storage_path
        self.cache = cache
        shape = cache.backend.kv_cache_shape(_N, _BS, _H, _D)
        self._block_dim = shape.index(_N)
        rest = [d for d in shape if d != _N]
        # a block's slice (layout order) -> [block_size, heads, head_dim], and back
        self._to_canon = [rest.index(d) for d in (_BS, _H, _D)]
        self._from_canon = [self._to_canon.index(i) for i in range(3)]
        self._tensors: list[tuple[str, torch.Tensor]] = []  # (name, [num_blocks, ...] view)
        for i, (k, v) in enumerate(cache.kv_caches):
            for name, t in (("k", k),) if cache.shared_kv else (("k", k), ("v", v)):
                self._tensors.append((f"{name}{i}", t.movedim(self._block_dim, 0)))
        self.spec: Spec = [
            (name, dtype_name(t.dtype), tuple(t.shape[1 + j] for j in self._to_canon))
            for name, t in self._tensors
        ]
        # saves failed since the last step whose saves all worked: one warning per spell (a
        # nearly full disk fails some writes of every step, and logging is on that disk too)
        self._save_failing = False
        if cfg.saves:
            try:
                os.makedirs(self.root, exist_ok=True)
            except OSError as e:
                raise ValueError(
                    "kv_transfer_config.kv_connector_extra_config.shared_storage_path="
                    f"{self.root!r} cannot be created: {e}"
                ) from e

    def path(self, key: str) -> str:
        return block_path(self.root, key, self.rank, self.world)

    def load(self, sched: SchedulerOutput) -> list[int]:
        """Fill `sched.kv_loads`' blocks from their files, before the forward. Returns the
        blocks some rank could not fill (its file gone or changed since the scheduler's lookup):
        the same list on every rank."""
        if not sched.kv_loads:
            return []
        ids, blocks, failed = [], [], []
        for i, (block_id, key) in enumerate(sched.kv_loads):
            tensors = read_block(self.path(key), key, self.spec)
            if tensors is None:
                failed.append(i)
                continue
            ids.append(block_id)
            blocks.append(tensors)
        device = self.cache.device
        if self.world > 1:  # one rank's miss spoils the block on all of them
            mask = torch.zeros(len(sched.kv_loads), dtype=torch.int32, device=device)
            mask[failed] = 1
            failed = tp_all_reduce_max(mask).nonzero().flatten().tolist()
        if failed:
            logger.warning(
                "kv_transfer_config: %d stored block(s) could not be loaded (files gone or "
                "changed since the lookup, e.g. under %s); their requests are recomputed",
                len(failed),
                self.root,
            )
        if ids:
            index = torch.tensor(ids, dtype=torch.int64, device=device)
            perm = [0, *(1 + j for j in self._from_canon)]
            for j, (_, t) in enumerate(self._tensors):
                src = torch.stack([b[j] for b in blocks]).to(device)  # [n, bs, heads, dim]
                t[index] = src.permute(perm)
        return [sched.kv_loads[i][0] for i in failed]

    def save(self, sched: SchedulerOutput, stale: Collection[int] = ()) -> None:
        """Write `sched.kv_saves`' blocks that storage lacks, after the forward, except the
        `stale` ones (blocks of sequences that read a block `load` could not fill)."""
        # one entry a key (requests with one prompt name its blocks in one step)
        todo = [
            (b, k)
            for k, b in dict((k, b) for b, k in sched.kv_saves).items()
            if b not in stale and not os.path.exists(self.path(k))
        ]
        if not todo:
            return
        index = torch.tensor([b for b, _ in todo], dtype=torch.int64, device=self.cache.device)
        perm = [0, *(1 + j for j in self._to_canon)]
        gathered = [t.index_select(0, index).permute(perm).cpu() for _, t in self._tensors]
        failed: list[OSError] = []
        for i, (_, key) in enumerate(todo):
            try:
                write_block(
                    self.path(key), key, [(n, g[i]) for (n, _), g in zip(self._tensors, gathered)]
                )
            except OSError as e:  # the storage's fault, never the step's: the block stays unsaved
                failed.append(e)
        if failed and not self._save_failing:
            logger.warning(
                "kv_transfer_config: %d block(s) could not be saved under %s (%s); serving on "
                "without storing them (logged again after a step's saves all work)",
                len(failed),
                self.root,
                failed[0],
            )
        self._save_failing = bool(failed)


def build_block_io(config: Any, cache: CacheEngine) -> KVBlockIO:
    return KVBlockIO(KVTransferConfig.parse(config.kv_transfer_config), cache)
