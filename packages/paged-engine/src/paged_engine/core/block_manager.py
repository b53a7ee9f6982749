"""Per-sequence block tables over the `BlockPool`: on-demand allocation, fork (sharing),
copy-on-write, prefix-cache admission and registration, free, stats.

One sequence's table, `block_size = 4`:

    positions:  | 0 1 2 3 | 4 5 6 7 | 8 9 . . |
    block_ids:  [   b3    ,   b7    ,   b2    ]
                | full, registered  | partial: the only block a write can land in that was
                                      ever shared (after a fork), hence copy-on-write

Invariants:
- `block_ids` covers positions [0, num_computed_tokens) (and the slots of a step once
  `allocate_slots` returned True); every listed block holds one reference per table.
- A block registered in the prefix cache is full of computed tokens and is never written:
  writes start at `num_computed_tokens`, past every registered block.
- A write never lands in a block another table (or a pending copy) still reads: such a block
  is first copied (`take_blocks_to_copy` hands the (src, dst) pairs to the runner). Until the
  copies are taken, each source keeps a hold (one reference) so it cannot be reallocated and
  overwritten before the copy runs; a sequence freed before that drops its pending copies.
- Prefix-cache stats count tokens (like vLLM): queries = tokens of admitted sequences,
  hits = tokens found in the cache (either tier).
- With a CPU pool (`cpu_pool.py`) a preempted request's tables can be swapped out: its device
  references go, its `num_computed_tokens` stays, and its CPU table waits in `cpu.tables` until
  `swap_in` gives it device blocks again. With the CPU tier on, cached device blocks are copied
  to the CPU pool when evicted, and admission looks there after a device miss.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from paged_engine.core.block_pool import BlockPool
from paged_engine.core.cpu_pool import CpuPool
from paged_engine.multimodal.inputs import block_mm_keys

if TYPE_CHECKING:
    from collections.abc import Iterable

    from paged_engine.core.request import Sequence

# Parent hash of a sequence's first block (a fixed int keeps hashes identical across runs).
ROOT_HASH = 0x5EED_CAFE_F00D


def root_hash(lora_id: int, lora_path: str | None = None, cache_salt: str | None = None) -> int:
    """The chain's root: the base model's, or one per LoRA adapter (same tokens, other KV)
    and per cache salt (same KV, but kept apart); the path is part of it, so an id
    re-registered for other weights shares nothing."""
    if not lora_id and cache_salt is None:
        return ROOT_HASH
    text = f"{lora_id}\0{lora_path}"
    if cache_salt is not None:
        text += f"\0{cache_salt}"
    key = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return hash((ROOT_HASH, int.from_bytes(key, "little")))  # no str hash: stable across runs


@dataclass(slots=True)
class BlockManagerStats:
    block_size: int
    num_total_blocks: int  # allocatable blocks (the null block excluded)
    num_free_blocks: int  # includes free blocks that still hold a cached hash
    num_used_blocks: int
    num_cached_blocks: int  # blocks with a registered hash, used or free
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_table_blocks: int  # sum of len(block_ids) over every sequence holding blocks
    num_slots_allocated: int = 0  # over the seqs passed to stats(): table slots
    num_tokens_stored: int = 0  # over the seqs passed to stats(): computed tokens
    num_cpu_blocks: int = 0  # the CPU pool (swap_space + cpu_offload_gib); 0 = none
    num_free_cpu_blocks: int = 0  # includes free blocks that hold a tier hash
    prefix_cache_cpu_hits: int = 0  # tokens of the hits served from the CPU tier

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_total_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    @property
    def blocks_saved_by_sharing(self) -> int:
        """Logical blocks minus physical blocks: what fork / prefix sharing saved."""
        return self.num_table_blocks - self.num_used_blocks

    @property
    def kv_waste(self) -> float:
        """Fraction of allocated KV slots (of the given seqs) holding no token."""
        if not self.num_slots_allocated:
            return 0.0
        return 1.0 - self.num_tokens_stored / self.num_slots_allocated


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        *,
        num_cpu_blocks: int = 0,  # the CPU pool, block 0 unused; < 2 = no pool
        cpu_offload: bool = False,  # the prefix cache's CPU tier (needs caching and the pool)
        prompt_only: bool = False,  # cache blocks of prompt tokens only (see cache_full_blocks)
    ) -> None:
        assert block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prompt_only = prompt_only
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.cpu: CpuPool | None = None
        if num_cpu_blocks >= 2:
            offload = cpu_offload and enable_prefix_caching
            self.cpu = CpuPool(num_cpu_blocks, self.pool, offload)
        self._blocks = self.pool.blocks
        self._pending_copies: dict[int, int] = {}  # dst block id -> src block id
        self._copy_holds: dict[int, int] = {}  # src block id -> references held for copies
        self._num_table_blocks = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prefix_cache_cpu_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks - 1

    # ---- prefix cache ------------------------------------------------------------------------
    def _block_key(self, seq: Sequence, i: int) -> tuple[int, int, tuple[int, ...]]:
        """(hash, parent_hash, tokens) of full block i; extends seq.block_hashes by one at most."""
        bs = self.block_size
        tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
        if seq.request.mm_inputs:  # placeholders stand for their image: its hash is in the key
            tokens += block_mm_keys(seq.request.mm_inputs, i * bs, (i + 1) * bs)
        hashes = seq.block_hashes
        if i:
            parent = hashes[i - 1]
        else:
            req = seq.request
            parent = root_hash(req.lora_id, req.lora_path, req.cache_salt)
        if i < len(hashes):
            return hashes[i], parent, tokens
        assert i == len(hashes)
        h = hash((parent, tokens))
        hashes.append(h)
        return h, parent, tokens

    def get_computed_blocks(self, seq: Sequence) -> int:
        """At admission (no blocks yet): take the longest cached prefix of full blocks.

            | cached full blocks (taken) | rest: computed by the scheduler |
            0                  num_cached_tokens <= num_tokens - 1

        At least the last token is left to compute so that its logits exist.
        Returns num_cached_tokens (also set as seq.num_computed_tokens).
        """
        assert not seq.block_ids and seq.num_computed_tokens == 0, "admission needs no blocks"
        seq.num_cached_tokens = 0
        if not self.enable_prefix_caching:
            return 0
        pool, cpu = self.pool, self.cpu
        hits = []
        num_tier = 0
        for i in range((seq.num_tokens - 1) // self.block_size):
            key = self._block_key(seq, i)
            block = pool.lookup(*key)
            if block is not None:
                pool.touch(block)  # now: a tier hit below allocates, which could evict it
            elif cpu is not None and (block := cpu.load(*key)) is not None:
                num_tier += 1
            else:
                break
            hits.append(block)
        self.prefix_cache_cpu_hits += num_tier * self.block_size
        seq.block_ids = [b.block_id for b in hits]
        seq.num_registered_blocks = len(hits)
        self._num_table_blocks += len(hits)
        num_cached = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens = num_cached
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += num_cached
        return num_cached

    def block_key(self, seq: Sequence, i: int) -> tuple[int, int | None, tuple[int, ...]]:
        """(hash, parent hash, tokens) of full block i of the sequence's tokens."""
        while len(seq.block_hashes) < i:
            self._block_key(seq, len(seq.block_hashes))
        return self._block_key(seq, i)

    def drop_computed_blocks(self, seq: Sequence, num_blocks: int) -> None:
        """Keep only the first `num_blocks` blocks of an admission's prefix-cache hit (a hybrid
        model resumes only where a state snapshot exists); the rest is computed again."""
        table = seq.block_ids
        assert num_blocks <= len(table) and seq.num_computed_tokens == len(table) * self.block_size
        dropped = (len(table) - num_blocks) * self.block_size
        blocks, pool = self._blocks, self.pool
        for block_id in reversed(table[num_blocks:]):
            pool.free_block(blocks[block_id])
        self._num_table_blocks -= len(table) - num_blocks
        del table[num_blocks:]
        seq.num_registered_blocks = num_blocks
        seq.num_computed_tokens -= dropped
        seq.num_cached_tokens -= dropped
        self.prefix_cache_hits -= dropped

    def undo_computed_blocks(self, seq: Sequence) -> None:
        """Roll back an admission that failed after `get_computed_blocks` (and maybe
        `allocate_slots`): frees the blocks and un-counts the prefix-cache query."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries -= seq.num_tokens
            self.prefix_cache_hits -= seq.num_cached_tokens
        self.free(seq)
        seq.num_cached_tokens = 0

    # ---- swapping to the CPU pool ------------------------------------------------------------
    def is_swapped(self, seq: Sequence) -> bool:
        return self.cpu is not None and seq.seq_id in self.cpu.tables

    def swap_out(self, seqs: list[Sequence]) -> bool:
        """Move one request's tables to the CPU pool: copies recorded, device references
        dropped, `num_computed_tokens` kept. False (nothing changes) without a pool, without
        room in it, or while a copy-on-write copy into one of the blocks is pending."""
        cpu = self.cpu
        if cpu is None or any(b in self._pending_copies for s in seqs for b in s.block_ids):
            return False
        cpu_tables = cpu.swap_out([s.block_ids for s in seqs])
        if cpu_tables is None:
            return False
        for seq, cpu_table in zip(seqs, cpu_tables):
            computed = seq.num_computed_tokens
            self.free(seq)
            cpu.tables[seq.seq_id] = cpu_table
            seq.num_computed_tokens = computed
        return True

    def swap_in(self, seqs: list[Sequence], plan: list[tuple[Sequence, int]]) -> bool:
        """Give swapped-out sequences device blocks again and the slots `plan` schedules for
        them. False (nothing changes) unless the device pool surely has room: their distinct
        blocks, the new blocks of the plan, and one copy-on-write per planned sequence."""
        cpu = self.cpu
        assert cpu is not None
        tables = [cpu.tables[s.seq_id] for s in seqs]
        bs = self.block_size
        lengths = {s.seq_id: len(t) for s, t in zip(seqs, tables)}
        need = len(set().union(*tables)) + sum(
            max(-(-(s.num_computed_tokens + n) // bs) - lengths[s.seq_id], 0) + 1 for s, n in plan
        )
        if need > self.pool.num_free_blocks:
            return False
        for seq, table in zip(seqs, cpu.swap_in(tables)):
            del cpu.tables[seq.seq_id]
            seq.block_ids = table
            seq.num_registered_blocks = 0  # new blocks: registered again once full
            self._num_table_blocks += len(table)
        for seq, n in plan:
            assert self.allocate_slots(seq, n), "swap_in: room was checked"
        return True

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's (swap-outs, swap-ins); the runner runs them before copies and forward."""
        return self.cpu.take() if self.cpu is not None else ([], [])

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register blocks that became full of computed tokens the host knows (a pending
        token's id is not known yet). O(new full blocks). With `prompt_only` (a model whose
        layers update their state differently for prompt tokens: the KV of a generated token
        then differs from that of the same token in a prompt) only blocks of prompt tokens."""
        num_known = min(seq.num_computed_tokens, len(seq.token_ids))
        if self.prompt_only:
            num_known = min(num_known, seq.num_prompt_tokens)
        num_full = num_known // self.block_size
        if num_full <= seq.num_registered_blocks or not self.enable_prefix_caching:
            return
        table, blocks, pool = seq.block_ids, self._blocks, self.pool
        for i in range(seq.num_registered_blocks, num_full):
            pool.cache_block(blocks[table[i]], *self._block_key(seq, i))
        seq.num_registered_blocks = num_full

    # ---- allocation --------------------------------------------------------------------------
    def _shared(self, block_id: int) -> bool:
        """Does anyone but the writer still read this block (another table or a pending copy)?"""
        ref = self._blocks[block_id].ref_cnt
        return ref > 1 and ref - self._copy_holds.get(block_id, 0) > 1

    def _plan(self, seq: Sequence, num_new_tokens: int) -> tuple[int, list[int]]:
        """(new blocks to append, table indices to copy-on-write) for writing
        | computed | new (num_new_tokens) | at positions [num_computed, num_computed + new)."""
        bs = self.block_size
        table = seq.block_ids
        start = seq.num_computed_tokens
        num_blocks = (start + num_new_tokens + bs - 1) // bs
        cow = [i for i in range(start // bs, min(num_blocks, len(table))) if self._shared(table[i])]
        return max(num_blocks - len(table), 0), cow

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        num_new_blocks, cow = self._plan(seq, num_new_tokens)
        return num_new_blocks + len(cow) <= self.pool.num_free_blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make blocks exist (and be private) for positions [0, num_computed + num_new).
        Returns False, changing nothing, when the pool lacks free blocks."""
        if num_new_tokens <= 0:
            return True
        table = seq.block_ids
        start = seq.num_computed_tokens
        bs, last = self.block_size, len(table) - 1
        # Fast path (a decode): the writes land in the existing last block, which is private.
        if (
            start // bs == last
            and start + num_new_tokens <= (last + 1) * bs
            and self._blocks[table[last]].ref_cnt == 1
        ):
            return True
        num_new_blocks, cow = self._plan(seq, num_new_tokens)
        pool = self.pool
        if num_new_blocks + len(cow) > pool.num_free_blocks:
            return False
        for i in cow:
            src = table[i]
            dst = pool.get_new_blocks(1)[0].block_id
            # The table's reference to src moves to a hold released by take_blocks_to_copy.
            self._copy_holds[src] = self._copy_holds.get(src, 0) + 1
            self._pending_copies[dst] = src
            table[i] = dst
            seq.num_synced_blocks = min(seq.num_synced_blocks, i)  # the worker's entry is stale
        if num_new_blocks:
            table.extend([b.block_id for b in pool.get_new_blocks(num_new_blocks)])
            self._num_table_blocks += num_new_blocks
        return True

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        """Pending (src, dst) copies, cleared; the runner runs them all before the forward."""
        if not self._pending_copies:
            return []
        pairs = [(src, dst) for dst, src in self._pending_copies.items()]
        self._pending_copies.clear()
        for src, n in self._copy_holds.items():
            for _ in range(n):
                self.pool.free_block(self._blocks[src])
        self._copy_holds.clear()
        return pairs

    def _drop_pending_copy(self, dst: int) -> None:
        src = self._pending_copies.pop(dst)
        self._copy_holds[src] -= 1
        if not self._copy_holds[src]:
            del self._copy_holds[src]
        self.pool.free_block(self._blocks[src])

    # ---- sharing and freeing -----------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (ref +1 each) and its hash chain."""
        assert not child.block_ids
        assert not self._pending_copies, "fork between schedule() and take_blocks_to_copy()"
        blocks, pool = self._blocks, self.pool
        for block_id in parent.block_ids:
            pool.touch(blocks[block_id])
        child.block_ids = parent.block_ids.copy()
        child.block_hashes = parent.block_hashes.copy()
        child.num_registered_blocks = parent.num_registered_blocks
        child.num_computed_tokens = parent.num_computed_tokens
        self._num_table_blocks += len(child.block_ids)
        if self.cpu is not None and parent.seq_id in self.cpu.tables:
            # swapped out (a fan-out's pending sample landed after the swap): the child shares
            # the parent's CPU table, and they swap in together
            self.cpu.fork(parent.seq_id, child.seq_id)

    def share_prefix(self, src: Sequence, dst: Sequence, num_blocks: int) -> None:
        """A forked request recomputed after preemption: `dst` takes `src`'s computed blocks up
        to `num_blocks` (full blocks of tokens both hold) as the fork once did, and counts them
        as computed. `src` writes only past them, so they are never written again."""
        start = len(dst.block_ids)
        assert dst.block_ids == src.block_ids[:start]
        assert num_blocks * self.block_size <= src.num_computed_tokens
        blocks, pool = self._blocks, self.pool
        for block_id in src.block_ids[start:num_blocks]:
            pool.touch(blocks[block_id])
        dst.block_ids.extend(src.block_ids[start:num_blocks])
        self._num_table_blocks += num_blocks - start
        dst.num_computed_tokens = num_blocks * self.block_size

    def free(self, seq: Sequence) -> None:
        """Drop the table's references, tail first (so tail blocks are evicted first), and
        reset num_computed_tokens (no blocks -> nothing computed)."""
        if self.cpu is not None and seq.seq_id in self.cpu.tables:  # swapped out
            self.cpu.release(self.cpu.tables.pop(seq.seq_id))
        table = seq.block_ids
        if self._pending_copies:
            for block_id in table:
                if block_id in self._pending_copies:
                    self._drop_pending_copy(block_id)
        blocks, pool = self._blocks, self.pool
        for block_id in reversed(table):
            pool.free_block(blocks[block_id])
        self._num_table_blocks -= len(table)
        seq.block_ids = []
        seq.num_registered_blocks = 0
        seq.num_computed_tokens = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the table's blocks past the ones `num_tokens` positions need (speculative
        positions given back), tail first. Those blocks were taken for this step's drafts
        (`num_tokens` covers every position the table held before), so no other table (a fork's
        sibling) shares them and none is registered in the prefix cache."""
        keep = -(-num_tokens // self.block_size)
        table = seq.block_ids
        if len(table) <= keep:
            return
        blocks, pool = self._blocks, self.pool
        for block_id in reversed(table[keep:]):
            block = blocks[block_id]
            assert block.ref_cnt == 1 and block.block_hash is None, "trim: a shared block"
            if block_id in self._pending_copies:
                self._drop_pending_copy(block_id)
            pool.free_block(block)
        self._num_table_blocks -= len(table) - keep
        del table[keep:]

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        if self.cpu is not None:
            self.cpu.reset_prefix_cache()

    # ---- stats -------------------------------------------------------------------------------
    def stats(self, seqs: Iterable[Sequence] = ()) -> BlockManagerStats:
        """O(1) plus O(len(seqs)) for the slot-waste figures (pass the running sequences)."""
        total = self.num_total_blocks
        free = self.pool.num_free_blocks
        st = BlockManagerStats(
            block_size=self.block_size,
            num_total_blocks=total,
            num_free_blocks=free,
            num_used_blocks=total - free,
            num_cached_blocks=self.pool.num_cached_blocks,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_table_blocks=self._num_table_blocks,
        )
        if self.cpu is not None:
            st.num_cpu_blocks = self.cpu.num_total_blocks
            st.num_free_cpu_blocks = self.cpu.num_free_blocks
            st.prefix_cache_cpu_hits = self.prefix_cache_cpu_hits
        for seq in seqs:
            st.num_slots_allocated += len(seq.block_ids) * self.block_size
            st.num_tokens_stored += seq.num_computed_tokens
        return st
