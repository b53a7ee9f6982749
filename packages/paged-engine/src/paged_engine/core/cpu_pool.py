"""The CPU block pool: blocks of swapped-out sequences and the prefix cache's CPU tier.

    device pool --swap out: preemption by swap; a cached block evicted (offload)--> CPU pool
    device pool <--swap in: a swapped sequence resumes; a prefix-cache hit in the tier-- CPU pool

The pool is a `BlockPool` of CPU block ids (0 is unused, as on the device). A CPU block is in
use (ref > 0) while a swapped-out sequence's CPU table lists it; a free one may hold a
prefix-cache hash (the tier) and is evicted least recently used, like a free device block.

Copies are recorded here and leave with the step (`take`); the worker runs all swap-outs of a
step, then all swap-ins, then copy-on-write copies, then the forward. Hence:
- a device block freed by a swap-out (or evicted after its offload) may be reused in the same
  step: it is read before anything writes it;
- a CPU block a swap-in reads keeps a hold (one reference) until the step leaves, so no swap-out
  of the same step overwrites it;
- a device block filled by a tier hit keeps a hold too, so it is not reallocated (or evicted
  and offloaded) before its swap-in ran.
"""

from __future__ import annotations

from paged_engine.core.block_pool import Block, BlockPool


class CpuPool:
    def __init__(self, num_blocks: int, device_pool: BlockPool, offload: bool) -> None:
        self.pool = BlockPool(num_blocks, enable_caching=offload)
        self.device_pool = device_pool
        self.offload = offload
        self.tables: dict[int, list[int]] = {}  # seq id -> CPU block ids, while swapped out
        self._out: list[tuple[int, int]] = []  # (device block, CPU block)
        self._in: list[tuple[int, int]] = []  # (CPU block, device block)
        self._holds: list[tuple[BlockPool, Block]] = []
        # Lifetime counters (blocks).
        self.num_swapped_out = 0
        self.num_swapped_in = 0
        self.num_offloaded = 0
        self.num_tier_hits = 0
        if offload:
            device_pool.on_evict = self._offload

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def _hold(self, pool: BlockPool, block: Block) -> None:
        pool.touch(block)
        self._holds.append((pool, block))

    def take(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's (swap-outs, swap-ins), cleared; releases the holds they needed."""
        out, into = self._out, self._in
        self._out, self._in = [], []
        for pool, block in self._holds:
            pool.free_block(block)
        self._holds.clear()
        return out, into

    # ---- swapping whole sequences ---------------------------------------------------------------
    def swap_out(self, tables: list[list[int]]) -> list[list[int]] | None:
        """Copy the distinct device blocks of `tables` (one request's sequences) to new CPU
        blocks; returns the CPU tables (a block shared by k tables has k references), or None
        when the pool lacks room (nothing changes). The caller frees the device references."""
        distinct = list(dict.fromkeys(b for t in tables for b in t))
        if len(distinct) > self.pool.num_free_blocks:
            return None
        mapping = dict(zip(distinct, self.pool.get_new_blocks(len(distinct))))
        self._out.extend((b, mapping[b].block_id) for b in distinct)
        self.num_swapped_out += len(distinct)
        seen: set[int] = set()
        out = []
        for table in tables:
            for b in table:
                if b in seen:
                    self.pool.touch(mapping[b])
                seen.add(b)
            out.append([mapping[b].block_id for b in table])
        return out

    def swap_in(self, cpu_tables: list[list[int]]) -> list[list[int]]:
        """Device tables for CPU tables (the device pool must have room for their distinct
        blocks): each distinct CPU block gets a new device block and a copy; each table
        reference to a CPU block becomes a hold released with the step."""
        distinct = list(dict.fromkeys(c for t in cpu_tables for c in t))
        dev = self.device_pool
        mapping = dict(zip(distinct, dev.get_new_blocks(len(distinct))))
        self._in.extend((c, mapping[c].block_id) for c in distinct)
        self.num_swapped_in += len(distinct)
        blocks = self.pool.blocks
        seen: set[int] = set()
        out = []
        for table in cpu_tables:
            for c in table:
                if c in seen:
                    dev.touch(mapping[c])
                seen.add(c)
                self._holds.append((self.pool, blocks[c]))  # the table's reference, held
            out.append([mapping[c].block_id for c in table])
        return out

    def fork(self, parent_id: int, child_id: int) -> None:
        """A swapped-out sequence forked: the child's table shares every CPU block (ref +1)."""
        table = self.tables[parent_id]
        blocks = self.pool.blocks
        for c in table:
            self.pool.touch(blocks[c])
        self.tables[child_id] = table.copy()

    def release(self, cpu_table: list[int]) -> None:
        """Drop a swapped-out table's references (its sequence finished or was aborted)."""
        blocks = self.pool.blocks
        for c in reversed(cpu_table):
            self.pool.free_block(blocks[c])

    # ---- the prefix cache's CPU tier ----------------------------------------------------------
    def _offload(self, block: Block) -> None:
        """A cached device block is about to be reused: keep its content in the tier (a new
        MRU entry, evicting the LRU one) unless the tier has it or every CPU block is in use."""
        pool = self.pool
        key = (block.block_hash, block.parent_hash, block.token_ids)
        if pool.lookup(*key) is not None or not pool.num_free_blocks:
            return
        cpu_block = pool.get_new_blocks(1)[0]
        if pool.cache_block(cpu_block, *key):
            self._out.append((block.block_id, cpu_block.block_id))
            self.num_offloaded += 1
        pool.free_block(cpu_block)  # free but cached (tail: most recently used)

    def load(self, block_hash: int, parent_hash: int | None, tokens: tuple[int, ...]):
        """A device block holding the tier's copy of this content (registered in the device
        prefix cache, one reference for the caller), or None: not in the tier, or no free
        device block."""
        cpu_block = self.pool.lookup(block_hash, parent_hash, tokens) if self.offload else None
        dev = self.device_pool
        if cpu_block is None or not dev.num_free_blocks:
            return None
        self._hold(self.pool, cpu_block)  # before allocating: an offload could evict it
        block = dev.get_new_blocks(1)[0]
        dev.cache_block(block, block_hash, parent_hash, tokens)
        self._hold(dev, block)
        self._in.append((cpu_block.block_id, block.block_id))
        self.num_tier_hits += 1
        return block

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
