"""Scheduler and engine core: token budget, chunked prefill, FCFS, max_num_seqs, recompute
preemption, abort, lockstep for multi-sequence requests, prefix-cache admission; plus a
hypothesis test driving the real `EngineCore` (sync and async scheduling) over a fake worker
that keeps its own state from the plain-data `SchedulerOutput`s only, under a tiny KV pool."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_engine.core.block_manager import BlockManager
from paged_engine.core.engine_core import EngineCore
from paged_engine.core.request import Request, RequestStatus, SequenceStatus
from paged_engine.core.sched_output import SchedulerOutput
from paged_engine.core.scheduler import Scheduler
from paged_engine.executor.base import Executor
from paged_engine.worker.runner_output import ModelRunnerOutput


def token_for(index: int, pos: int) -> int:
    """The 'sampled' token of output `index` at position `pos`: independent of scheduling."""
    return (index * 7 + pos * 13) % 50


class FakeWorker(Executor):
    """A worker that sees only SchedulerOutputs: per sequence it keeps the tokens it was sent
    plus the one it sampled last, and a block table applied from deltas. Writing a position's KV
    stores the hash of the token prefix ending there; before each write it checks that every
    earlier position of the sequence reads back the right content through its table (so block
    deltas, copy-on-write, prefix-cache hits and forks are all checked). With `lazy`, results
    are handed out later, as a device would (async scheduling)."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.content: dict[int, list[int | None]] = {}
        self.seqs: dict[int, SimpleNamespace] = {}
        self.steps: list[SchedulerOutput] = []

    def determine_num_blocks(self) -> int:
        raise NotImplementedError

    def initialize_cache(self, num_blocks: int) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass

    def slot(self, block_id: int) -> list[int | None]:
        return self.content.setdefault(block_id, [None] * self.bs)

    def execute_model(self, out: SchedulerOutput) -> SimpleNamespace:
        out = pickle.loads(pickle.dumps(out))  # plain data: it could cross to another process
        self.steps.append(out)
        for sid in out.finished_seq_ids:
            del self.seqs[sid]
        for d in out.new_seqs:
            assert d.seq_id not in self.seqs
            self.seqs[d.seq_id] = SimpleNamespace(
                index=d.index, tokens=list(d.token_ids), table=list(d.block_ids)
            )
        for sid, first, ids in out.block_updates:
            table = self.seqs[sid].table
            del table[first:]
            table.extend(ids)
        for src, dst in out.blocks_to_copy:  # copies first, then the forward
            self.content[dst] = list(self.slot(src))
        assert out.num_batched_tokens == sum(out.num_new_tokens)
        assert len(set(out.seq_ids)) == len(out.seq_ids)
        bs = self.bs
        for sid, start, n in zip(out.seq_ids, out.start_positions, out.num_new_tokens):
            s = self.seqs[sid]
            assert n > 0 and start + n <= len(s.tokens)
            for pos in range(start):
                got = self.slot(s.table[pos // bs])[pos % bs]
                assert got == hash(tuple(s.tokens[: pos + 1])), f"bad KV of {sid} at {pos}"
            for pos in range(start, start + n):
                self.slot(s.table[pos // bs])[pos % bs] = hash(tuple(s.tokens[: pos + 1]))
        result = ModelRunnerOutput(out.step_id)
        for row in out.sample_rows:
            sid = out.seq_ids[row]
            s = self.seqs[sid]
            pos = out.start_positions[row] + out.num_new_tokens[row]
            for j in range(out.num_samples.get(sid, 1)):
                result.sampled_seq_ids.append(sid)
                result.sampled_token_ids.append(token_for(j or s.index, pos))
            s.tokens.append(token_for(s.index, pos))  # the worker's own copy of its sample
        result = pickle.loads(pickle.dumps(result))
        return SimpleNamespace(get=lambda: result)


class Driver:
    """The real engine core over a FakeWorker; checks lockstep and max_num_seqs every step."""

    latest: Driver

    def __init__(self, sched: Scheduler, async_scheduling: bool = False) -> None:
        self.sched = sched
        self.bm = sched.block_manager
        self.worker = FakeWorker(self.bm.block_size)
        self.core = EngineCore(
            sched, self.worker, max_model_len=sched.max_model_len, async_scheduling=async_scheduling
        )
        self.spec: dict[str, tuple[int, int]] = {}  # request id -> (n, max_tokens)
        self.reqs: dict[str, Request] = {}
        Driver.latest = self

    @property
    def content(self) -> dict[int, list[int | None]]:
        return self.worker.content

    def add(
        self,
        rid: str,
        prompt: list[int],
        n: int = 1,
        max_tokens: int = 4,
        params: object = None,
        priority: int = 0,
    ) -> Request:
        params = SimpleNamespace(n=n) if params is None else params
        req = Request(rid, prompt, params, max_tokens=max_tokens, priority=priority)
        self.spec[rid] = (n, max_tokens)
        self.reqs[rid] = req
        self.core.add_request(req)
        return req

    def step(self) -> SchedulerOutput:
        before = len(self.worker.steps)
        self.core.step()
        assert len(self.worker.steps) == before + 1, "one step scheduled per call"
        out = self.worker.steps[-1]
        for req in self.sched.running:
            live = req.live_seqs()
            assert len({s.num_tokens for s in live}) <= 1 or req in self.sched._reshare
        assert self.sched.num_running_seqs <= self.sched.max_num_seqs
        return out

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return
            self.core.step()
        raise AssertionError("did not finish")

    def check_done(self) -> None:
        for rid, req in self.reqs.items():
            assert req.is_finished
            if req.status == RequestStatus.FINISHED_ABORTED:
                continue
            n, max_tokens = self.spec[rid]
            assert sorted(s.index for s in req.seqs) == list(range(n))
            for seq in req.seqs:
                p = len(req.prompt_token_ids)
                want = [token_for(seq.index, pos) for pos in range(p, p + max_tokens)]
                assert seq.token_ids == req.prompt_token_ids + want
                assert seq.finish_reason == "length"
        assert self.bm.num_free_blocks == self.bm.num_total_blocks
        assert self.bm.stats().num_table_blocks == 0
        while self.core._in_flight:  # an async step may still be in flight: its result is moot
            assert self.core.step() == []
        assert not self.sched.seqs and not self.sched.step_seqs


def make(
    num_blocks: int = 200, block_size: int = 4, caching: bool = True, async_: bool = False, **kw
) -> Driver:
    kw.setdefault("max_num_seqs", 64)
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("max_model_len", 256)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Driver(Scheduler(bm, **kw), async_scheduling=async_)


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    """(request id, tokens) per batch row of a step of the latest Driver."""
    owners = {s.seq_id: r.request_id for r in Driver.latest.reqs.values() for s in r.seqs}
    return [(owners[sid], n) for sid, n in zip(out.seq_ids, out.num_new_tokens)]


def requests_of(out: SchedulerOutput) -> list[str]:
    return list(dict.fromkeys(rid for rid, _ in plan(out)))


def test_chunked_prefill_splits_long_prompts_while_decodes_run() -> None:
    d = make(max_num_batched_tokens=16, caching=False)
    d.add("a", list(range(40)), max_tokens=10)
    d.add("b", list(range(5)), max_tokens=10)
    assert plan(d.step()) == [("a", 16)]  # FCFS: a takes the whole budget
    assert plan(d.step()) == [("a", 16)]
    assert plan(d.step()) == [("a", 8), ("b", 5)]
    d.add("c", list(range(100)), max_tokens=2)
    assert plan(d.step()) == [("a", 1), ("b", 1), ("c", 14)]  # decodes keep running
    assert plan(d.step()) == [("a", 1), ("b", 1), ("c", 14)]
    d.run()
    d.check_done()
    assert d.reqs["a"].first_scheduled_time is not None


def test_without_chunking_a_prompt_runs_whole() -> None:
    d = make(max_num_batched_tokens=16, enable_chunked_prefill=False, caching=False)
    d.add("a", list(range(10)))
    d.add("b", list(range(10)))
    assert plan(d.step()) == [("a", 10)]
    assert plan(d.step()) == [("a", 1), ("b", 10)]
    d.run()
    d.check_done()


def test_fcfs_and_max_num_seqs() -> None:
    d = make(max_num_seqs=2)
    for rid, max_tokens in (("a", 2), ("b", 6), ("c", 2)):
        d.add(rid, [1, 2, 3], max_tokens=max_tokens)
    assert plan(d.step()) == [("a", 3), ("b", 3)]
    assert d.sched.num_running == 2 and d.sched.num_waiting == 1
    assert plan(d.step()) == [("a", 1), ("b", 1)]  # a finishes here
    assert plan(d.step()) == [("b", 1), ("c", 3)]
    d.run()
    d.check_done()


def test_preemption_recomputes_and_loses_nothing() -> None:
    # 6 usable blocks of 2 tokens; two requests of 4 prompt tokens growing to 10 tokens.
    d = make(num_blocks=7, block_size=2, caching=False)
    a = d.add("a", [1, 2, 3, 4], max_tokens=6)
    b = d.add("b", [5, 6, 7, 8], max_tokens=6)
    d.step()
    d.step()
    d.step()  # 6 tokens each in 3 blocks: the pool is full
    out = d.step()  # a needs a 4th block: b (admitted last) is preempted
    assert plan(out) == [("a", 1)]
    assert b.status == RequestStatus.WAITING and b.num_preemptions == 1
    assert list(d.sched.waiting) == [b] and d.sched.num_preemptions == 1
    seq_b = b.seqs[0]
    assert seq_b.block_ids == [] and seq_b.num_computed_tokens == 0 and seq_b.num_tokens == 7
    d.run()
    d.check_done()
    assert a.num_preemptions == 0


def test_priority_policy_admits_by_priority_then_arrival() -> None:
    d = make(max_num_seqs=1, policy="priority")
    for rid, priority in (("low", 5), ("a", 0), ("b", 0), ("urgent", -1)):
        d.add(rid, [1, 2, 3], max_tokens=1, priority=priority)
    assert [r.request_id for r in d.sched.waiting] == ["urgent", "a", "b", "low"]
    admitted = []
    while d.sched.has_unfinished_requests():
        admitted += [rid for rid in requests_of(d.step()) if rid not in admitted]
    assert admitted == ["urgent", "a", "b", "low"]
    d.check_done()


def test_priority_policy_preempts_the_lowest_priority_not_the_newest() -> None:
    # As test_preemption_recomputes_and_loses_nothing, but "b" (admitted last) outranks "a":
    # when the pool runs out, "a" is the victim and "b" runs on.
    d = make(num_blocks=7, block_size=2, caching=False, policy="priority")
    a = d.add("a", [1, 2, 3, 4], max_tokens=6, priority=1)
    d.step()  # a alone: admitted first
    b = d.add("b", [5, 6, 7, 8], max_tokens=6, priority=0)
    d.add("c", [9, 9], max_tokens=6, priority=2)  # waits: after a, by priority
    while a.status == RequestStatus.RUNNING:
        d.step()
    assert a.num_preemptions == 1 and b.num_preemptions == 0
    assert b.status == RequestStatus.RUNNING
    assert [r.request_id for r in d.sched.waiting] == ["a", "c"]  # back in its place
    d.run()
    d.check_done()


def test_the_request_needing_blocks_preempts_itself_when_last() -> None:
    d = make(num_blocks=6, block_size=2, caching=False)  # 5 usable blocks
    a = d.add("a", [1, 2, 3, 4], max_tokens=4)
    b = d.add("b", [5, 6, 7, 8], max_tokens=4)
    d.step()  # 4 blocks used
    out = d.step()  # a needs a 5th block: fine; b needs a 6th: b is last, preempts itself
    assert plan(out) == [("a", 1)] and b.status == RequestStatus.WAITING
    d.run()
    d.check_done()
    assert a.num_preemptions == 0 and b.num_preemptions >= 1


def test_abort_in_every_state_frees_everything() -> None:
    d = make(num_blocks=7, block_size=2, caching=False)
    d.add("a", [1, 2, 3, 4], max_tokens=6)
    d.add("b", [5, 6, 7, 8], max_tokens=6)
    d.add("w", [9, 9], max_tokens=6)  # never admitted: pool full
    for _ in range(3):
        d.step()
    out = d.step()
    assert plan(out) == [("a", 1)] and d.reqs["b"].status == RequestStatus.WAITING
    for rid in ("w", "b", "a"):  # waiting, preempted, running
        assert d.sched.abort_request(rid)
        req = d.reqs[rid]
        assert req.status == RequestStatus.FINISHED_ABORTED and req.finished_time is not None
        assert all(s.status == SequenceStatus.FINISHED_ABORTED for s in req.seqs)
        assert all(s.finish_reason == "abort" and not s.block_ids for s in req.seqs)
    assert not d.sched.abort_request("a") and not d.sched.abort_request("nope")
    assert not d.sched.has_unfinished_requests()
    assert not d.sched.running and not d.sched.waiting
    d.check_done()


def test_lockstep_for_multi_sequence_requests() -> None:
    # block_size 16: the prompt fills no block, so the recompute has no prefix to share
    d = make(max_num_batched_tokens=16, block_size=16, caching=False)
    req = d.add("a", list(range(10)), n=3, max_tokens=5)
    d.step()  # the prompt, then 3 samples forked from it
    assert len(req.live_seqs()) == 3
    assert plan(d.step()) == [("a", 1)] * 3
    d.sched._preempt(req, [])  # recompute: each live seq now has 12 tokens to compute
    out = d.step()  # 36 > 16: nobody may finish, each gets at most remaining - 1
    assert out.num_new_tokens == [11, 5]
    out = d.step()
    assert out.num_new_tokens == [6, 10]  # seq 2 stops one short of the end
    assert d.step().num_new_tokens == [1, 1, 2]  # all three end in the same step
    d.run()
    d.check_done()


@pytest.mark.parametrize("caching", [False, True])
def test_recomputed_fork_shares_its_prefix_again(caching: bool) -> None:
    d = make(max_num_batched_tokens=64, block_size=4, caching=caching)
    req = d.add("a", list(range(10)), n=3, max_tokens=5)
    d.step()
    d.step()
    d.sched._preempt(req, [])  # each live seq: 12 tokens, the 10-token prompt in common
    d.bm.reset_prefix_cache()
    assert plan(d.step()) == [("a", 8)]  # the first seq computes the 2 full common blocks
    assert plan(d.step()) == [("a", 4)] * 3  # the others share them, as after the fork
    first, *others = req.live_seqs()
    assert all(s.block_ids[:2] == first.block_ids[:2] for s in others)
    d.run()
    d.check_done()


def test_multi_sequence_request_readmitted_whole_or_not_at_all() -> None:
    d = make(num_blocks=12, block_size=2, caching=False, max_num_seqs=3)
    req = d.add("a", [1, 2, 3], n=3, max_tokens=3)
    d.step()
    d.sched._preempt(req, [])
    d.add("b", [4], max_tokens=2)
    out = d.step()  # a needs 3 seq slots: readmitted whole; b waits (max_num_seqs)
    assert requests_of(out) == ["a"]
    assert all(s.status == SequenceStatus.RUNNING for s in req.live_seqs())
    d.run()
    d.check_done()


def test_max_num_seqs_reserves_seats_for_forks() -> None:
    d = make(max_num_seqs=4)
    d.add("a", [1, 2, 3], n=3, max_tokens=3)
    d.add("b", [4, 5], n=2, max_tokens=3)
    d.add("c", [6], n=1, max_tokens=3)
    # a reserves 3 seats before it forks; b (2 more) must wait, and FCFS keeps c behind b
    assert requests_of(d.step()) == ["a"]
    assert d.sched.num_running_seqs == 3 and d.sched.num_waiting == 2
    with pytest.raises(ValueError, match="max_num_seqs"):
        d.sched.add_request(Request("big", [1], SimpleNamespace(n=5)))
    d.run()
    d.check_done()


def test_prefix_cache_hit_skips_computed_tokens() -> None:
    d = make(block_size=4)
    d.add("a", list(range(20)), max_tokens=2)
    d.step()
    b = d.add("b", list(range(20)), max_tokens=2)
    out = d.step()
    assert plan(out) == [("a", 1), ("b", 4)]  # 16 tokens (4 full blocks) cached
    assert b.seqs[0].num_cached_tokens == 16
    st_ = d.bm.stats()
    assert st_.prefix_cache_queries == 40 and st_.prefix_cache_hits == 16
    # prompt logprobs need logits at every prompt position: no lookup for such a request
    c = d.add("c", list(range(20)), max_tokens=2, params=SimpleNamespace(prompt_logprobs=1))
    assert not c.use_prefix_cache
    assert plan(d.step())[-1] == ("c", 20) and c.seqs[0].num_cached_tokens == 0
    assert d.bm.stats().prefix_cache_queries == 40
    d.run()
    d.check_done()


def test_a_request_larger_than_the_pool_raises_instead_of_looping() -> None:
    d = make(num_blocks=4, block_size=2, caching=False)  # 6 tokens of KV in all
    d.add("a", [1, 2, 3, 4, 5], max_tokens=8)
    with pytest.raises(RuntimeError, match="cannot make progress"):
        d.run()


@settings(max_examples=40, deadline=None)
@given(
    num_blocks=st.integers(38, 44),  # one request alone needs <= 36 blocks
    budget=st.integers(4, 40),
    chunked=st.booleans(),
    caching=st.booleans(),
    reqs=st.lists(
        st.tuples(st.integers(1, 16), st.integers(1, 3), st.integers(1, 8), st.integers(0, 3)),
        min_size=4,
        max_size=10,
    ),
    abort_at=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 7)), max_size=3),
    async_=st.booleans(),
    priorities=st.none() | st.lists(st.integers(-2, 2), min_size=10, max_size=10),
)
def test_random_workloads_finish_correctly(
    num_blocks: int,
    budget: int,
    chunked: bool,
    caching: bool,
    reqs: list[tuple[int, int, int, int]],
    abort_at: list[tuple[int, int]],
    async_: bool,
    priorities: list[int] | None,
) -> None:
    """Sync or async scheduling, FCFS or priority policy: the same tokens, every block free,
    KV always right."""
    if not chunked:
        budget = max(budget, 16)
    d = make(
        num_blocks,
        block_size=2,
        caching=caching,
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=48,
        enable_chunked_prefill=chunked,
        async_=async_,
        policy="fcfs" if priorities is None else "priority",
    )
    for i, (plen, n, max_tokens, family) in enumerate(reqs):
        prompt = [(family * 5 + j) % 9 for j in range(plen)]
        d.add(str(i), prompt, n=n, max_tokens=max_tokens, priority=(priorities or [0] * 10)[i])
    aborts = dict(abort_at)
    for step in range(10_000):
        if not d.sched.has_unfinished_requests():
            break
        if step in aborts:
            d.core.abort_requests([str(aborts[step])])
        if d.sched.has_unfinished_requests():
            d.core.step()
    d.check_done()


@pytest.mark.parametrize("n", [1, 3])
def test_async_scheduling_plans_ahead_and_drops_nothing(n: int) -> None:
    """Step N+1 is scheduled before step N's tokens are known: a decode row runs the pending
    position; a request that fans out (n > 1) sits out until its samples exist; a sequence
    whose pending token reaches max_tokens is not scheduled again."""
    d = make(num_blocks=16, block_size=2, caching=False, async_=True)
    d.add("a", [1, 2, 3, 4], n=n, max_tokens=5)
    d.add("b", [5, 6, 7], max_tokens=3)
    assert d.core.step() == []  # the first step is in flight, nothing applied yet
    first = d.worker.steps[-1]
    assert plan(first) == [("a", 4), ("b", 3)]
    assert len(d.core.step()) == 2  # schedules step 2 with the pending tokens, applies step 1
    second = d.worker.steps[-1]
    assert plan(second) == [("a", 1)] * (n == 1) + [("b", 1)]
    d.core.step()
    assert plan(d.worker.steps[-1]) == [("a", 1)] * n + [("b", 1)]
    d.core.step()  # b's pending token is its 3rd, its last: b is not scheduled again
    assert plan(d.worker.steps[-1]) == [("a", 1)] * n
    d.run()
    d.check_done()


@pytest.mark.parametrize("caching", [False, True])
def test_async_preemption_recomputes_and_loses_nothing(caching: bool) -> None:
    """A request preempted while its step is in flight gets that token when it lands and is
    readmitted only then."""
    d = make(num_blocks=7, block_size=2, caching=caching, async_=True)
    d.add("a", [1, 2, 3, 4], max_tokens=6)
    d.add("b", [5, 6, 7, 8], max_tokens=6)
    d.add("c", [5, 6, 7, 8, 9], n=2, max_tokens=3)
    d.run()
    d.check_done()
    assert d.sched.num_preemptions > 0
