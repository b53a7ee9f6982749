"""BlockManager: on-demand allocation, fork + copy-on-write, prefix cache, free, stats; plus a
hypothesis property test driving random operations against a simulated KV content model."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from paged_engine.core.block_manager import BlockManager
from paged_engine.core.request import Request, Sequence, next_seq_id


def make_seq(tokens: list[int]) -> Sequence:
    return Request(f"r{next_seq_id()}", list(tokens), None).seqs[0]


class SimRunner:
    """Stands in for the model runner: a block's slot holds the 'KV' of its position, modelled
    as the hash of the token prefix ending there (KV depends on every earlier token)."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.content: dict[int, list[int | None]] = {}

    def slot(self, block_id: int) -> list[int | None]:
        return self.content.setdefault(block_id, [None] * self.bm.block_size)

    def step(self, seq: Sequence, n: int) -> bool:
        if not self.bm.allocate_slots(seq, n):
            return False
        for src, dst in self.bm.take_blocks_to_copy():
            self.content[dst] = list(self.slot(src))
        bs, blocks = self.bm.block_size, self.bm.pool.blocks
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            block = blocks[seq.block_ids[pos // bs]]
            assert block.ref_cnt == 1, "write into a shared block"
            assert block.block_hash is None, "write into a prefix-cached block"
            self.slot(block.block_id)[pos % bs] = hash(tuple(seq.token_ids[: pos + 1]))
        seq.num_computed_tokens += n
        self.bm.cache_full_blocks(seq)
        return True

    def check_content(self, seq: Sequence) -> None:
        bs = self.bm.block_size
        for pos in range(seq.num_computed_tokens):
            got = self.slot(seq.block_ids[pos // bs])[pos % bs]
            assert got == hash(tuple(seq.token_ids[: pos + 1])), f"bad KV at {pos}"


def check_invariants(bm: BlockManager, seqs: list[Sequence]) -> None:
    pool = bm.pool
    refs = Counter(b for s in seqs for b in s.block_ids)
    assert 0 not in refs, "null block handed out"
    for block in pool.blocks[1:]:
        assert block.ref_cnt == refs[block.block_id], f"block {block.block_id} ref count"
        if block.block_hash is not None:
            assert pool.lookup(block.block_hash, block.parent_hash, block.token_ids) is block
    free = pool.free_block_ids()
    assert len(free) == len(set(free)) == pool.num_free_blocks
    never_used = set(range(len(pool.blocks), pool.num_blocks))  # created on first allocation
    assert set(free) == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0} | never_used
    assert bm.stats().num_table_blocks == sum(len(s.block_ids) for s in seqs)
    for s in seqs:
        assert len(s.block_ids) * bm.block_size >= s.num_computed_tokens


def test_allocate_on_demand() -> None:
    bm = BlockManager(10, block_size=4)
    sim = SimRunner(bm)
    seq = make_seq(list(range(10)))
    assert sim.step(seq, 6) and len(seq.block_ids) == 2
    assert sim.step(seq, 4) and len(seq.block_ids) == 3
    seq.token_ids.append(10)
    seq.token_ids.append(11)
    assert sim.step(seq, 1) and len(seq.block_ids) == 3  # position 10 lives in block 2
    assert sim.step(seq, 1) and len(seq.block_ids) == 3
    seq.token_ids.append(12)
    assert sim.step(seq, 1) and len(seq.block_ids) == 4
    assert bm.num_free_blocks == 9 - 4
    sim.check_content(seq)
    bm.free(seq)
    assert bm.num_free_blocks == 9 and seq.block_ids == [] and seq.num_computed_tokens == 0


def test_allocate_failure_changes_nothing() -> None:
    bm = BlockManager(4, block_size=4)  # 3 usable blocks
    seq = make_seq(list(range(20)))
    assert not bm.can_allocate(seq, 13)
    assert not bm.allocate_slots(seq, 13)
    assert seq.block_ids == [] and bm.num_free_blocks == 3
    assert bm.can_allocate(seq, 12) and bm.allocate_slots(seq, 12)
    assert bm.num_free_blocks == 0


def test_fork_then_cow_copies_once_and_keeps_parent_data() -> None:
    bm = BlockManager(10, block_size=4)
    sim = SimRunner(bm)
    parent = make_seq(list(range(6)))
    assert sim.step(parent, 6)
    child = parent.fork(next_seq_id(), 1)
    bm.fork(parent, child)
    assert child.block_ids == parent.block_ids and child.num_computed_tokens == 6
    assert all(bm.pool.blocks[b].ref_cnt == 2 for b in parent.block_ids)
    assert bm.stats().blocks_saved_by_sharing == 2
    shared_last = parent.block_ids[1]
    parent.token_ids.append(100)
    child.token_ids.append(200)
    # the first writer copies the shared partial block; the second then owns the original
    assert bm.allocate_slots(parent, 1)
    assert parent.block_ids[0] == child.block_ids[0] and parent.block_ids[1] != shared_last
    assert bm.allocate_slots(child, 1) and child.block_ids[1] == shared_last
    assert bm.take_blocks_to_copy() == [(shared_last, parent.block_ids[1])]
    assert bm.take_blocks_to_copy() == []
    check_invariants(bm, [parent, child])


def test_fork_on_block_boundary_needs_no_copy() -> None:
    bm = BlockManager(10, block_size=4)
    sim = SimRunner(bm)
    parent = make_seq(list(range(8)))
    assert sim.step(parent, 8)
    child = parent.fork(next_seq_id(), 1)
    bm.fork(parent, child)
    parent.token_ids.append(1)
    child.token_ids.append(2)
    assert sim.step(parent, 1) and sim.step(child, 1)
    assert parent.block_ids[:2] == child.block_ids[:2] and parent.block_ids[2] != child.block_ids[2]
    sim.check_content(parent)
    sim.check_content(child)
    check_invariants(bm, [parent, child])


def test_free_before_take_drops_pending_copy() -> None:
    bm = BlockManager(10, block_size=4)
    sim = SimRunner(bm)
    parent = make_seq(list(range(6)))
    assert sim.step(parent, 6)
    child = parent.fork(next_seq_id(), 1)
    bm.fork(parent, child)
    parent.token_ids.append(1)
    assert bm.allocate_slots(parent, 1)  # CoW pending; the source block is held
    src = child.block_ids[1]
    assert bm.pool.blocks[src].ref_cnt == 2  # child + hold
    bm.free(parent)  # e.g. preempted in the same schedule()
    assert bm.take_blocks_to_copy() == []
    assert bm.pool.blocks[src].ref_cnt == 1
    check_invariants(bm, [child])


def test_prefix_cache_hits_count_tokens_and_leave_the_last_token() -> None:
    bm = BlockManager(20, block_size=4)
    sim = SimRunner(bm)
    a = make_seq(list(range(10)))
    assert bm.get_computed_blocks(a) == 0
    assert sim.step(a, 5)
    assert a.num_registered_blocks == 1  # only blocks full of computed tokens
    assert sim.step(a, 5)
    assert a.num_registered_blocks == 2 and bm.pool.num_cached_blocks == 2
    b = make_seq([*range(10), 99])
    assert bm.get_computed_blocks(b) == 8
    assert b.block_ids == a.block_ids[:2] and b.num_computed_tokens == b.num_cached_tokens == 8
    c = make_seq(list(range(8)))  # all tokens cached, but the last one must be computed
    assert bm.get_computed_blocks(c) == 4
    d = make_seq([0, 1, 2, 7, 4, 5, 6, 7])  # diverges in block 0
    assert bm.get_computed_blocks(d) == 0
    st_ = bm.stats()
    assert st_.prefix_cache_queries == 10 + 11 + 8 + 8 and st_.prefix_cache_hits == 8 + 4
    assert sim.step(b, 3)
    sim.check_content(b)
    check_invariants(bm, [a, b, c, d])
    for s in (a, b, c, d):
        bm.free(s)
    assert bm.num_free_blocks == 19


def test_prefix_cache_revives_freed_blocks_and_undo() -> None:
    bm = BlockManager(6, block_size=2)
    sim = SimRunner(bm)
    a = make_seq([1, 2, 3, 4, 5])
    assert sim.step(a, 5)
    bm.free(a)
    assert bm.num_free_blocks == 5 and bm.pool.num_cached_blocks == 2
    b = make_seq([1, 2, 3, 4, 6])
    assert bm.get_computed_blocks(b) == 4
    assert bm.num_free_blocks == 3
    bm.undo_computed_blocks(b)
    assert bm.num_free_blocks == 5 and b.num_computed_tokens == 0 and b.num_cached_tokens == 0
    assert bm.stats().prefix_cache_queries == 0 and bm.stats().prefix_cache_hits == 0


def test_prompt_only_caches_no_block_of_generated_tokens() -> None:
    """A model whose prompt tokens update its state their own way (Mamba2 with a dt limit): a
    generated token's KV is not that of the same token in a prompt."""
    bm = BlockManager(10, block_size=4, prompt_only=True)
    sim = SimRunner(bm)
    a = make_seq(list(range(6)))  # a prompt of 6: one full block of prompt tokens
    assert sim.step(a, 6)
    a.token_ids += [6, 7, 8]  # generated
    assert sim.step(a, 3)
    assert a.num_registered_blocks == 1 and bm.pool.num_cached_blocks == 1
    b = make_seq(list(range(10)))  # the same tokens, all of them a prompt
    assert bm.get_computed_blocks(b) == 4
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 9


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(10, block_size=2, enable_prefix_caching=False)
    sim = SimRunner(bm)
    a = make_seq([1, 2, 3, 4, 5])
    assert sim.step(a, 5)
    b = make_seq([1, 2, 3, 4, 5])
    assert bm.get_computed_blocks(b) == 0
    assert bm.pool.num_cached_blocks == 0 and a.block_hashes == []


def test_hash_chain_is_incremental() -> None:
    bm = BlockManager(40, block_size=4)
    sim = SimRunner(bm)
    seq = make_seq(list(range(17)))
    assert sim.step(seq, 17)
    assert len(seq.block_hashes) == 4
    before = list(seq.block_hashes)
    for t in range(8):
        seq.token_ids.append(t)
        assert sim.step(seq, 1)
    assert seq.block_hashes[:4] == before and len(seq.block_hashes) == 6


def test_stats_and_sharing() -> None:
    bm = BlockManager(11, block_size=4)
    sim = SimRunner(bm)
    seq = make_seq(list(range(9)))
    assert sim.step(seq, 9)
    child = seq.fork(next_seq_id(), 1)
    bm.fork(seq, child)
    s = bm.stats([seq, child])
    assert (s.num_total_blocks, s.num_used_blocks, s.num_free_blocks) == (10, 3, 7)
    assert s.num_table_blocks == 6 and s.blocks_saved_by_sharing == 3
    assert s.num_slots_allocated == 24 and s.num_tokens_stored == 18
    assert abs(s.kv_waste - 0.25) < 1e-9 and abs(s.usage - 0.3) < 1e-9


PROMPTS = [[i % 5 for i in range(48)], [(i * 3) % 7 for i in range(48)], [1] * 48]


@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(3, 24),
    block_size=st.sampled_from([1, 2, 4]),
    caching=st.booleans(),
    ops=st.lists(
        st.tuples(
            st.sampled_from([0, 1, 1, 1, 1, 2, 2, 3, 4, 5]),  # weighted toward steps and forks
            st.integers(0, 10_000),
            st.integers(1, 48),
        ),
        min_size=10,
        max_size=80,
    ),
)
def test_random_operations_keep_invariants(
    num_blocks: int, block_size: int, caching: bool, ops: list[tuple[int, int, int]]
) -> None:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    sim = SimRunner(bm)
    seqs: list[Sequence] = []
    for op, a, b in ops:
        if op == 0 or not seqs:  # admit a new sequence (prefix-cache lookup)
            seq = make_seq(PROMPTS[a % 3][:b] + [a % 3] * (a % 4))
            cached = bm.get_computed_blocks(seq)
            assert cached % block_size == 0 and cached < seq.num_tokens
            seqs.append(seq)
            continue
        seq = seqs[a % len(seqs)]
        if op == 1:  # run a chunk, or append a sampled token when caught up
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining == 0:
                seq.token_ids.append(b % 3)
                continue
            table, free = list(seq.block_ids), bm.num_free_blocks
            if not sim.step(seq, 1 + b % remaining):
                assert seq.block_ids == table and bm.num_free_blocks == free
        elif op == 2:  # fork
            child = seq.fork(next_seq_id(), len(seqs))
            bm.fork(seq, child)
            seqs.append(child)
        elif op == 3:  # append a token (sampled) when caught up
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(b % 3)
        elif op == 4:  # free (finished)
            bm.free(seq)
            seqs.remove(seq)
        else:  # preempt and re-admit (recompute)
            bm.free(seq)
            bm.get_computed_blocks(seq)
        check_invariants(bm, seqs)
        for s in seqs:
            sim.check_content(s)
    for s in seqs:
        bm.free(s)
    check_invariants(bm, [])
    assert bm.num_free_blocks == num_blocks - 1 and bm.stats().num_used_blocks == 0
