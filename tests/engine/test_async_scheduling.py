"""Async scheduling against the synchronous engine on the same inputs: identical outputs."""

from __future__ import annotations

import pytest

from paged_engine import LLM, BeamSearchParams, SamplingParams

PROMPTS = [
    [5, 6, 7, 8, 9] * 9,  # shares a 45-token prefix with the next: prefix-cache hits
    [5, 6, 7, 8, 9] * 9 + [11, 12],
    [20, 21, 22],
    list(range(30, 90)),
    [40, 41] * 12,
    [50],
    list(range(100, 140)),
    [60, 61, 62, 63] * 5,
]


def _params() -> list[SamplingParams | BeamSearchParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=20),
        SamplingParams(temperature=0.9, seed=3, max_tokens=18, logprobs=2),
        SamplingParams(temperature=1.0, seed=4, n=3, max_tokens=12, stop=["a", "e"]),
        SamplingParams(temperature=0.8, seed=5, n=2, best_of=3, max_tokens=10, min_tokens=4),
        SamplingParams(temperature=0.7, seed=6, top_k=20, repetition_penalty=1.2, max_tokens=16),
        BeamSearchParams(beam_width=3, max_tokens=8),
        SamplingParams(temperature=0.0, prompt_logprobs=2, max_tokens=6, stop_token_ids=[7]),
        SamplingParams(temperature=1.1, seed=8, min_p=0.05, max_tokens=25, ignore_eos=True),
    ]


def _llm(model_dir, async_scheduling: bool, **engine) -> LLM:
    return LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=128,
        block_size=4,
        async_scheduling=async_scheduling,
        **engine,
    )


def _run(model_dir, async_scheduling: bool, **engine) -> tuple[list, object]:
    llm = _llm(model_dir, async_scheduling, **engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(), use_tqdm=False)
    got = [
        (
            [(o.index, o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in r.outputs],
            [o.logprobs for o in r.outputs],
            r.prompt_logprobs,
        )
        for r in outs
    ]
    stats = llm.get_stats()
    llm.llm_engine.shutdown()
    return got, stats


def _close(a: list, b: list) -> None:
    """Lists of per-position {token: Logprob} dicts (or None): same keys and ranks, close values."""
    assert len(a) == len(b)
    for seq_a, seq_b in zip(a, b):
        assert (seq_a is None) == (seq_b is None)
        for pos_a, pos_b in zip(seq_a or [], seq_b or []):
            assert (pos_a is None) == (pos_b is None)
            if pos_a is None:
                continue
            assert list(pos_a) == list(pos_b)
            for tok in pos_a:
                assert pos_a[tok].rank == pos_b[tok].rank
                assert pos_a[tok].decoded_token == pos_b[tok].decoded_token
                assert pos_a[tok].logprob == pytest.approx(pos_b[tok].logprob, abs=1e-5)


@pytest.mark.parametrize(
    "engine",
    [
        {},  # room for everything, prefix caching on
        {"num_gpu_blocks_override": 40, "max_num_batched_tokens": 48},  # preemption, chunking
        {"enable_prefix_caching": False, "max_num_seqs": 5},
    ],
)
def test_async_outputs_equal_sync(tiny_llama_dir, engine):
    sync, sync_stats = _run(tiny_llama_dir, False, **engine)
    async_, async_stats = _run(tiny_llama_dir, True, **engine)
    # Tokens, text, finish and stop reasons: identical. Logprobs: the same tokens and ranks,
    # values to float rounding (steps batch other rows together, which changes the matmuls'
    # blocking; bitwise equality across batch shapes is the batch-invariant mode's job).
    assert [a[0] for a in async_] == [s[0] for s in sync]
    for (_, lps_a, plp_a), (_, lps_s, plp_s) in zip(async_, sync):
        _close(lps_a, lps_s)
        _close([plp_a], [plp_s])
    if "num_gpu_blocks_override" in engine:
        assert sync_stats.num_preemptions > 0 and async_stats.num_preemptions > 0
    for st in (sync_stats, async_stats):
        assert st.num_used_blocks == 0 and st.num_running == 0 and st.num_waiting == 0


def test_async_abort_frees_everything_and_spares_the_rest(tiny_llama_dir):
    """Aborts land while a step is in flight: the aborted request's token is dropped, its
    blocks freed, and the others finish as in a run without it."""
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=15, ignore_eos=True)
    want, _ = _run(tiny_llama_dir, False)
    engine = _llm(tiny_llama_dir, True).llm_engine
    for i, (p, sp) in enumerate(zip(PROMPTS, _params())):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp, final_only=True)
    engine.add_request("gone", {"prompt_token_ids": PROMPTS[3]}, params)
    done = {}
    for step in range(10_000):
        if not engine.has_unfinished_requests():
            break
        if step == 4:
            engine.abort_request("gone")
        for out in engine.step():
            assert out.request_id != "gone" or step < 4
            if out.finished:
                done[out.request_id] = out
    got = [
        [
            (o.index, o.token_ids, o.text, o.finish_reason, o.stop_reason)
            for o in done[str(i)].outputs
        ]
        for i in range(len(PROMPTS))
    ]
    assert got == [w[0] for w in want]
    while engine.engine_core._in_flight:
        engine.step()
    assert engine.get_stats().num_used_blocks == 0
    engine.shutdown()


def test_step_contract_is_plain_data(tiny_llama_dir):
    """What crosses between scheduler, worker and output stage pickles (another process could
    take it) and holds no live engine object."""
    import pickle

    llm = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=128, block_size=4)
    engine = llm.llm_engine
    runner = engine.model_runner
    seen: list = []
    execute = runner.execute_model

    def record(sched):
        handle = execute(sched)
        seen.append((sched, handle.get()))
        return handle

    runner.execute_model = record
    core_outs: list = []
    step_core = engine.step_core

    def record_core():
        outs = step_core()
        core_outs.extend(outs)
        return outs

    engine.step_core = record_core
    params = [SamplingParams(n=2, temperature=1.0, seed=1, logprobs=1, max_tokens=6)]
    params.append(SamplingParams(prompt_logprobs=1, max_tokens=4))
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
    assert seen and core_outs
    for item in [*seen, *core_outs]:
        blob = pickle.dumps(item)
        assert b"paged_engine.core.request" not in blob  # no Request / Sequence inside
        pickle.loads(blob)
