"""Physical KV blocks: reference counts, an O(1) free list, and the prefix-cache hash map.

    blocks:  | 0 = null block | 1 ... num_blocks-1 : allocatable |

- Block 0 is the null block: never allocated, never freed; block tables are padded with it.
- A block is free iff `ref_cnt == 0` iff it is linked into the free list.
- The free list is an intrusive doubly linked list (sentinel `_head`, circular), so popping the
  head, appending, prepending and unlinking a block from the middle are all O(1).
- Blocks are created on first allocation, in id order: `blocks[i]` exists iff
  `i < len(blocks)`. The never-allocated ids `len(blocks) .. num_blocks-1` sit in the free list
  as one marker node (`_fresh`, unlinked once they run out), so a pool costs what its sequences
  use: a tiny model on a large GPU gets ~10^8 blocks, which as objects took minutes to build and
  stalled every full collection of the cyclic GC.
- Eviction order: allocation pops from the head. A freed block that holds a cached hash goes to
  the tail (least recently used first); a freed block without one goes to the head, since its
  content is worthless. The hash of a cached block is dropped lazily, when the block is reused.
- Prefix cache: `block_hash -> Block` for full, computed blocks. A block's hash chains its
  parent's hash with its own tokens; the block keeps `(parent_hash, token_ids)` and a lookup
  compares them, so a hash collision never hands out wrong KV.
- `on_evict(block)`, when set, sees a cached block just before its hash is dropped for reuse
  (the prefix cache's CPU tier copies it out then).

The same class serves as the CPU block pool (swapped-out blocks in use, offloaded prefix-cache
blocks free but cached, evicted LRU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

NULL_BLOCK_ID = 0


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set iff registered in the prefix cache
    parent_hash: int | None = field(default=None, repr=False)
    token_ids: tuple[int, ...] | None = field(default=None, repr=False)
    prev_free: Block | None = field(default=None, repr=False)
    next_free: Block | None = field(default=None, repr=False)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert num_blocks >= 2, "need the null block and at least one allocatable block"
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._head = Block(-1)  # sentinel: _head.next_free = LRU end, _head.prev_free = MRU end
        self._head.prev_free = self._head.next_free = self._head
        self.null_block = Block(NULL_BLOCK_ID)
        self.blocks = [self.null_block]
        self._fresh = Block(-2)  # ids never allocated yet, in order, where the list holds it
        self._link_tail(self._fresh)
        self.null_block.ref_cnt = 1  # pinned: never free, never allocated
        self.num_free_blocks = num_blocks - 1
        self._cached: dict[int, Block] = {}
        self.on_evict: Callable[[Block], None] | None = None

    # ---- free list ---------------------------------------------------------------------------
    def _link_tail(self, block: Block) -> None:
        last = self._head.prev_free
        block.prev_free, block.next_free = last, self._head
        last.next_free = block
        self._head.prev_free = block

    def _link_head(self, block: Block) -> None:
        first = self._head.next_free
        block.prev_free, block.next_free = self._head, first
        first.prev_free = block
        self._head.next_free = block

    def _unlink(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None

    def free_block_ids(self) -> list[int]:
        """Free list from head (next to be allocated) to tail; O(num_free), for tests/debug."""
        out, b = [], self._head.next_free
        while b is not self._head:
            if b is self._fresh:
                out.extend(range(len(self.blocks), self.num_blocks))
            else:
                out.append(b.block_id)
            b = b.next_free
        return out

    # ---- allocation --------------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[Block]:
        """Pop n blocks from the head of the free list (ref_cnt 0 -> 1), evicting cached hashes."""
        assert n <= self.num_free_blocks, f"want {n} blocks, {self.num_free_blocks} free"
        out = []
        for _ in range(n):
            block = self._head.next_free
            if block is self._fresh:
                block = Block(len(self.blocks))
                self.blocks.append(block)
                if len(self.blocks) == self.num_blocks:
                    self._unlink(self._fresh)
            else:
                self._unlink(block)
                if block.block_hash is not None:
                    self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        self.num_free_blocks -= n
        return out

    def touch(self, block: Block) -> None:
        """Take one more reference (a prefix-cache hit or a fork); revives a free cached block."""
        if block.ref_cnt == 0:
            self._unlink(block)
            self.num_free_blocks -= 1
        block.ref_cnt += 1

    def free_block(self, block: Block) -> None:
        """Drop one reference; at zero the block joins the free list (see eviction order)."""
        assert block.ref_cnt > 0, f"block {block.block_id} freed twice"
        assert block.block_id != NULL_BLOCK_ID, "the null block is never freed"
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            if block.block_hash is None:
                self._link_head(block)
            else:
                self._link_tail(block)
            self.num_free_blocks += 1

    # ---- prefix cache ------------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a registered hash, in use or free."""
        return len(self._cached)

    def lookup(
        self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]
    ) -> Block | None:
        block = self._cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != token_ids:
            return None
        return block

    def cache_block(
        self, block: Block, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]
    ) -> bool:
        """Register a full, computed, in-use block. Returns False when it is left uncached
        (caching off, or another block already holds this content: the first one wins)."""
        assert block.ref_cnt > 0 and block.block_id != NULL_BLOCK_ID
        if not self.enable_caching:
            return False
        if block.block_hash is not None:  # shared through a hit or a fork: same content
            assert block.block_hash == block_hash, "a block's content changed after caching"
            return True
        if block_hash in self._cached:
            return False
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self._cached[block_hash] = block
        return True

    def _evict(self, block: Block) -> None:
        if self.on_evict is not None:
            self.on_evict(block)
        del self._cached[block.block_hash]
        block.block_hash = block.parent_hash = block.token_ids = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their data, they just stop matching)."""
        for block in self._cached.values():
            block.block_hash = block.parent_hash = block.token_ids = None
        self._cached.clear()
