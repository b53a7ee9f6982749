"""Pipeline micro-batching (2 gloo stages on the CPU): the engine keeps two steps in flight over
disjoint requests, and every request's tokens are the single-process engine's: greedy tokens
identical, logprobs within 1e-4 (steps group requests differently), with preemption (a small KV
pool), n > 1, a stop string and an abort of a request whose step is in flight."""

from __future__ import annotations

import random

import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers")

LP_TOL = 1e-4
# 12 blocks of 16 tokens for ~300 tokens of work: requests are preempted and recomputed; a
# 48-token budget spreads the prompts over several steps, so two micro-batches form.
ENGINE = {
    "dtype": "float32",
    "max_model_len": 128,
    "block_size": 16,
    "num_gpu_blocks_override": 12,
    "max_num_batched_tokens": 48,
    "max_num_seqs": 8,
}
ABORTED = "r3"


def _requests(stop: str | None) -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(0)
    greedy = SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True)
    reqs = [
        (f"r{i}", [rng.randrange(3, 200) for _ in range(rng.randint(4, 30))], greedy)
        for i in range(10)
    ]
    fan = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=8, logprobs=1, ignore_eos=True)
    reqs.append(("fan", [5, 9, 11, 40, 41], fan))
    if stop is not None:
        sp = SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True)
        reqs.append(("stop", [7, 8, 9, 10, 11, 12], sp))
    return reqs


def _summary(out) -> list[tuple[list[int], list[float], str | None]]:
    return [
        (
            list(c.token_ids),
            [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])],
            c.finish_reason,
        )
        for c in out.outputs
    ]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model dir, requests, one process's outputs by request id); the stop string is a piece
    of the text the stop request generates without it, so it does stop early."""
    path = write_tiny_model(tmp_path_factory.mktemp("pp_mb"), "llama", seed=3)
    llm = LLM(model=str(path), **ENGINE)
    try:
        probe = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        (free,) = llm.generate([{"prompt_token_ids": [7, 8, 9, 10, 11, 12]}], probe, use_tqdm=False)
        text = free.outputs[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        assert stop.strip(), text
        reqs = _requests(stop)
        outs = llm.generate(
            [{"prompt_token_ids": p} for _, p, _ in reqs], [sp for *_, sp in reqs], use_tqdm=False
        )
        assert llm.llm_engine.get_stats().num_preemptions > 0
    finally:
        llm.llm_engine.shutdown()
    want = {rid: _summary(o) for (rid, *_), o in zip(reqs, outs)}
    assert want["stop"][0][2] == "stop"
    return path, reqs, want


def test_two_stages_keep_two_disjoint_steps_in_flight(setup):
    path, reqs, want = setup
    llm = LLM(model=str(path), pipeline_parallel_size=2, **ENGINE)
    engine = llm.llm_engine
    core = engine.engine_core
    live = engine.scheduler.seqs
    runs: dict[int, set[str]] = {}  # step id -> its request ids
    depths: list[int] = []
    submit = core.executor.execute_model

    def checked(sched):
        """Every step in flight runs requests no other step in flight runs."""
        runs[sched.step_id] = mine = {live[i].request.request_id for i in sched.seq_ids}
        for other, _ in core._in_flight:  # (the new step joins it after this returns)
            assert mine.isdisjoint(runs[other.step_id]), (mine, runs[other.step_id])
        depths.append(len(core._in_flight) + 1)
        return submit(sched)

    core.executor.execute_model = checked
    try:
        assert core.max_concurrent_batches == 2
        for rid, prompt, sp in reqs:
            engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
        got: dict[str, object] = {}
        aborted_after: list[int] | None = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[out.request_id] = out
            req = engine.scheduler.get_request(ABORTED)
            # mid-generation (two tokens applied), with a step in flight
            done = [] if req is None else list(req.seqs[0].output_token_ids)
            if aborted_after is None and len(done) >= 2 and req in engine.scheduler.busy:
                aborted_after = done
                engine.abort_request(ABORTED)
        stats = engine.get_stats()
    finally:
        engine.shutdown()
    # Stage 0 ran steps while the result of another was owed (the driver runs stage 0 inline).
    assert max(depths) == 2 and depths.count(2) >= len(depths) // 3, depths
    assert stats.num_preemptions > 0 and stats.num_used_blocks == 0
    assert aborted_after is not None
    want_aborted = want.pop(ABORTED)[0][0]
    assert want_aborted[: len(aborted_after)] == aborted_after
    if ABORTED in got:  # tokens that reached the output before the abort: a prefix
        toks = list(got.pop(ABORTED).outputs[0].token_ids)
        assert toks == want_aborted[: len(toks)]
    assert set(got) == set(want)
    for rid, w in want.items():
        g = _summary(got[rid])
        assert [(t, r) for t, _, r in g] == [(t, r) for t, _, r in w], rid
        for (_, g_lp, _), (_, w_lp, _) in zip(g, w):
            assert g_lp == pytest.approx(w_lp, abs=LP_TOL), rid
