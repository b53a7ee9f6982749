"""BlockPool: null block, O(1) free list order, ref counts, prefix-cache map and eviction."""

from __future__ import annotations

import pytest

from paged_engine.core.block_pool import NULL_BLOCK_ID, BlockPool


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(5)
    assert pool.num_free_blocks == 4
    blocks = pool.get_new_blocks(4)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 0
    with pytest.raises(AssertionError):
        pool.get_new_blocks(1)
    with pytest.raises(AssertionError):
        pool.free_block(pool.null_block)
    assert pool.null_block.block_id == NULL_BLOCK_ID


def test_double_free_asserts() -> None:
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.free_block(b)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free_block(b)


def test_free_order_uncached_to_head_cached_to_tail() -> None:
    pool = BlockPool(6)
    b1, b2, b3, b4, _ = pool.get_new_blocks(5)
    assert pool.cache_block(b1, 11, None, (1,))
    assert pool.cache_block(b2, 22, 11, (2,))
    for b in (b1, b2, b3, b4):
        pool.free_block(b)
    # uncached blocks (worthless) are reused first, cached ones in LRU order
    assert pool.free_block_ids() == [4, 3, 1, 2]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [4, 3]
    assert pool.num_cached_blocks == 2
    # reusing a cached block evicts its hash lazily
    (b,) = pool.get_new_blocks(1)
    assert b.block_id == 1 and b.block_hash is None
    assert pool.num_cached_blocks == 1 and pool.lookup(11, None, (1,)) is None
    assert pool.lookup(22, 11, (2,)) is b2


def test_touch_revives_free_cached_block_from_the_middle() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    for i, b in enumerate(blocks):
        pool.cache_block(b, 100 + i, None, (i,))
    for b in blocks:
        pool.free_block(b)
    assert pool.free_block_ids() == [1, 2, 3, 4]
    hit = pool.lookup(102, None, (2,))
    assert hit is blocks[2]
    pool.touch(hit)
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 3
    assert pool.free_block_ids() == [1, 2, 4]
    pool.touch(hit)  # shared: no free-list change
    assert hit.ref_cnt == 2 and pool.num_free_blocks == 3
    pool.free_block(hit)
    pool.free_block(hit)
    assert pool.free_block_ids() == [1, 2, 4, 3]  # most recently used at the tail


def test_collision_guard_compares_parent_and_tokens() -> None:
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    assert pool.cache_block(b, 7, 1, (1, 2))
    assert pool.lookup(7, 1, (1, 2)) is b
    assert pool.lookup(7, 1, (1, 3)) is None  # same hash, other tokens
    assert pool.lookup(7, 2, (1, 2)) is None  # same hash, other parent
    # a second block with the same content stays uncached (the first one wins)
    (c,) = pool.get_new_blocks(1)
    assert not pool.cache_block(c, 7, 1, (1, 2))
    assert c.block_hash is None and pool.num_cached_blocks == 1


def test_caching_disabled_and_reset() -> None:
    off = BlockPool(3, enable_caching=False)
    (b,) = off.get_new_blocks(1)
    assert not off.cache_block(b, 1, None, (1,))
    assert off.num_cached_blocks == 0

    pool = BlockPool(4)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_block(b1, 1, None, (1,))
    pool.cache_block(b2, 2, 1, (2,))
    pool.free_block(b1)
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and b1.block_hash is None and b2.block_hash is None
    assert pool.lookup(1, None, (1,)) is None
    assert pool.num_free_blocks == 2


def test_blocks_are_created_on_first_allocation() -> None:
    """A tiny model on a large GPU gets ~10^8 blocks: the pool costs what is allocated, never
    allocated ids come after freed uncached blocks and before freed cached ones."""
    pool = BlockPool(10**9)
    assert pool.num_free_blocks == 10**9 - 1 and len(pool.blocks) == 1
    a, b, c = pool.get_new_blocks(3)
    assert [a.block_id, b.block_id, c.block_id] == [1, 2, 3] and len(pool.blocks) == 4
    assert pool.cache_block(a, 1, None, (1,))
    pool.free_block(a)  # cached: behind every never-used id
    pool.free_block(b)  # uncached: before them
    assert [x.block_id for x in pool.get_new_blocks(2)] == [2, 4]
    small = BlockPool(4)
    x, y, _ = small.get_new_blocks(3)
    assert small.free_block_ids() == [] and small.num_free_blocks == 0
    small.cache_block(x, 9, None, (9,))
    for blk in (x, y):
        small.free_block(blk)
    assert small.free_block_ids() == [2, 1]
