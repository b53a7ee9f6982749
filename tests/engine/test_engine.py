"""Engine behaviour on a tiny model: sharing, preemption, chunking, prefix caching, abort, errors.

Each scheduling feature must leave greedy outputs unchanged and every block free at the end.
"""

from __future__ import annotations

import random

import pytest

from paged_engine import LLM, EngineConfig, LLMEngine, SamplingParams
from paged_engine.testing import write_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=3)


def _prompts(count: int, seed: int = 0, lo: int = 5, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 10) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=256, enable_prefix_caching=False)
    prompts = _prompts(8)
    return prompts, _greedy(llm, prompts)


@pytest.mark.parametrize(
    "options",
    [
        {"num_gpu_blocks_override": 12, "max_num_seqs": 8},  # preemption by recompute
        {"max_num_batched_tokens": 7},  # chunked prefill over many steps
        {"enable_prefix_caching": True},
        {"max_num_seqs": 1},
        {"block_size": 32},
    ],
    ids=["preemption", "chunked-prefill", "prefix-caching", "one-seq-at-a-time", "block-32"],
)
def test_scheduling_never_changes_outputs(model_dir, reference, options):
    prompts, expected = reference
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128, **options)
    assert _greedy(llm, prompts) == expected
    stats = llm.get_stats()
    assert stats.num_used_blocks == 0
    if "num_gpu_blocks_override" in options:
        assert stats.num_preemptions > 0, "the tiny pool should have forced preemption"


def test_prefix_cache_hits_and_same_outputs(model_dir):
    shared = _prompts(1, seed=9, lo=50, hi=50)[0]
    prompts = [shared + tail for tail in _prompts(4, seed=10, lo=3, hi=9)]
    off = LLM(model=str(model_dir), dtype="float32", max_model_len=128, enable_prefix_caching=False)
    on = LLM(model=str(model_dir), dtype="float32", max_model_len=128)
    expected = _greedy(off, prompts)
    assert _greedy(on, prompts[:1]) == expected[:1]  # fills the cache
    assert _greedy(on, prompts) == expected
    # The outputs say so too: cached prompt tokens, and metrics in time order (a regression:
    # these two fields once came through shifted into the wrong places).
    params = SamplingParams(temperature=0, max_tokens=2)
    out = on.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 48
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    stats = on.get_stats()
    assert stats.prefix_cache_hits >= 3 * 48  # three full 16-token blocks per later prompt
    assert stats.num_used_blocks == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_finished_sequence_caches_the_block_its_last_step_filled(model_dir, async_scheduling):
    """The next turn of a chat holds the answer: the block the answer's last step completed
    is cached too (it was lost when the sequence finished in that step)."""
    llm = LLM(
        model=str(model_dir), dtype="float32", max_model_len=128, async_scheduling=async_scheduling
    )
    prompt = _prompts(1, seed=11, lo=26, hi=26)[0]
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    # 26 prompt tokens + 6 computed outputs: the last step filled block 1 (positions 16-31)
    turn = prompt + list(first.outputs[0].token_ids) + [5, 6]
    out = llm.generate([{"prompt_token_ids": turn}], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 32
    stats = llm.get_stats()
    assert stats.num_used_blocks == 0 and stats.state_snapshot_hits is None  # no state


def test_cache_salt_keeps_prefix_cache_hits_apart(model_dir):
    """vLLM's cache_salt: only requests with the same salt share cached blocks."""
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128)
    shared = _prompts(1, seed=9, lo=50, hi=50)[0] + [7]
    params = SamplingParams(temperature=0, max_tokens=2)

    def run(salt: str | None):
        prompt = {"prompt_token_ids": shared} | ({} if salt is None else {"cache_salt": salt})
        return llm.generate([prompt], params, use_tqdm=False)[0]

    first = run("tenant-a")
    assert [run(s).num_cached_tokens for s in ("tenant-b", None, "tenant-a")] == [0, 0, 48]
    assert run(None).num_cached_tokens == 48
    assert run("tenant-a").outputs[0].token_ids == first.outputs[0].token_ids
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": shared, "cache_salt": ""}], params, use_tqdm=False)
    assert llm.get_stats().num_used_blocks == 0


def _engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            max_model_len=128,
            enable_prefix_caching=False,
            **kw,
        )
    )


@pytest.mark.parametrize(("prompt_len", "expected_blocks"), [(20, 1 + 4), (32, 2 + 4)])
def test_parallel_sampling_shares_prompt_blocks(model_dir, prompt_len, expected_blocks):
    # Counts blocks after each step: synchronous steps (async ones apply a step later).
    engine = _engine(model_dir, async_scheduling=False)
    prompt = _prompts(1, seed=4, lo=prompt_len, hi=prompt_len)[0]
    engine.add_request(
        "r", prompt, SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=1, ignore_eos=True)
    )
    engine.step()  # prefill once, sample 4 first tokens, fork 4 sequences sharing every block
    assert engine.get_stats().num_used_blocks == -(-prompt_len // 16)
    engine.step()  # each sequence writes its first token: copy-on-write of the partial block
    stats = engine.get_stats()
    assert stats.num_used_blocks == expected_blocks
    assert stats.blocks_saved_by_sharing > 0
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert len(outs[0].outputs) == 4 and all(len(o.token_ids) == 8 for o in outs[0].outputs)
    assert engine.get_stats().num_used_blocks == 0


def test_abort_frees_blocks_and_others_unaffected(model_dir, reference):
    prompts, expected = reference
    engine = _engine(model_dir)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    engine.add_request("victim", prompts[0], SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request("victim")
    engine.abort_request("no-such-request")  # aborting an unknown id is a no-op
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != "victim"
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[str(i)] for i in range(len(prompts))] == expected
    assert engine.get_stats().num_used_blocks == 0


def test_seeded_sampling_is_batch_independent(model_dir):
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128)
    prompt = {"prompt_token_ids": _prompts(1, seed=5)[0]}
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": p} for p in _prompts(5, seed=6)]
    mixed = llm.generate(
        others[:2] + [prompt] + others[2:],
        [SamplingParams(temperature=1.0, max_tokens=12)] * 2
        + [seeded]
        + [SamplingParams(temperature=0.7, max_tokens=12)] * 3,
        use_tqdm=False,
    )
    assert mixed[2].outputs[0].token_ids == alone


def test_stop_conditions(model_dir):
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128)
    prompt = {"prompt_token_ids": _prompts(1, seed=7)[0]}
    free = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    out = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0]
    assert out.outputs[0].token_ids == free.token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    text = free.text
    if len(text.strip()) > 4:
        stop_str = text.strip()[2:4]
        out = llm.generate(
            prompt,
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop_str]),
            use_tqdm=False,
        )[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop_str
        assert stop_str not in out.text and text.startswith(out.text)


def test_bad_input_raises_and_engine_keeps_serving(model_dir):
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=64)
    good = {"prompt_token_ids": [5, 6, 7]}
    cases = [
        ("", SamplingParams(), "prompt"),
        ({"prompt_token_ids": []}, SamplingParams(), "prompt"),
        ({"prompt_token_ids": list(range(3, 80))}, SamplingParams(), "max_model_len"),
        ({"prompt_token_ids": [10**9]}, SamplingParams(), "token"),
    ]
    for prompt, params, word in cases:
        with pytest.raises(ValueError, match=word):
            llm.generate(prompt, params, use_tqdm=False)
    for kwargs, name in [
        ({"n": 0}, "n"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
    ]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(model=str(model_dir), not_an_option=1)
    out = llm.generate(good, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1
    assert llm.get_stats().num_used_blocks == 0


def test_a_step_from_a_second_thread_is_refused(model_dir):
    """Two threads stepping one engine (LLM.generate beside a server's loop) would corrupt the
    scheduler and the free-block list: the second step is a RuntimeError, and the engine
    serves once the first is done."""
    import threading

    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=64)
    core = llm.llm_engine.engine_core
    inside, release = threading.Event(), threading.Event()
    step = core._step

    def slow_step():
        inside.set()
        release.wait(10)
        return step()

    core._step = slow_step
    first = threading.Thread(target=core.step)
    first.start()
    assert inside.wait(10)
    with pytest.raises(RuntimeError, match="another thread"):
        llm.llm_engine.step()
    release.set()
    first.join()
    core._step = step
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    llm.llm_engine.shutdown()


def test_triton_path_matches_torch_reference(model_dir):
    """The GPU code path, run by the Triton interpreter: slot mappings, block tables, kernels.

    And no kernel is specialised on a step's shape: from the engine start's profile forward
    (which builds the prefill kernels on a GPU) through chunked prefills, a prefix hit and
    decode steps of 1-4 rows, each kernel and constexpr set keeps one compile key, so a GPU
    compiles nothing again mid-serving (see tests/compile_keys.py)."""
    from compile_keys import recompiled, record_compile_keys

    from paged_engine.worker.memory_profiler import profile_forward

    # every token is a program of each launch in the interpreter: short prompts, 8-token blocks
    prompts = _prompts(3, seed=11, lo=10, hi=16)
    prompts.append(prompts[0][:10] + [7, 8, 9])  # shares a prefix block with prompt 0
    kw = dict(model=str(model_dir), dtype="float32", max_model_len=96, max_num_batched_tokens=24)
    kw["block_size"] = 8
    kw["max_num_seqs"] = len(prompts)  # the profile forward: 4 rows of 6 tokens, not 24 of 1
    torch_out = _greedy(LLM(attention_backend="torch", **kw), prompts, max_tokens=4)
    triton_llm = LLM(attention_backend="triton", **kw)
    # the Triton backend runs its norms through paged_kernels.rms_norm too (use_triton_norms)
    from paged_engine.layers.norm import RMSNorm
    from paged_kernels import rms_norm

    runner = triton_llm.llm_engine.engine_core.executor.worker.model_runner
    norms = [m for m in runner.model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.kernel is rms_norm for m in norms)
    with record_compile_keys() as keys:
        profile_forward(runner)  # a GPU engine's start runs it (CPU engines skip it)
        assert _greedy(triton_llm, prompts, max_tokens=4) == torch_out
    # (the rope kernel stores each Llama layer's K/V: no write kernel of its own)
    assert {name for name, _ in keys} >= {"_paged_attention_kernel", "_rope_qk_kernel"}
    assert recompiled(keys) == {}
    assert triton_llm.get_stats().num_used_blocks == 0


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"include_stop_str_in_output": True},
        {"skip_special_tokens": False},
        {"n": 3, "logprobs": 2},
    ],
)
def test_every_output_kind_gives_the_same_text(model_dir, extra):
    """FINAL_ONLY decodes each output once at the end; CUMULATIVE every step; DELTA pieces
    that add up. The texts (and tokens, finish reasons) are the same."""
    from paged_engine import RequestOutputKind

    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128)
    prompts = [{"prompt_token_ids": p} for p in _prompts(6, seed=9)]
    # 27 stop ids of 512 (and eos): some outputs end on a stop token, some run to max_tokens
    params = dict(
        temperature=1.0, seed=5, max_tokens=24, stop_token_ids=list(range(3, 30)), **extra
    )
    engine, got = llm.llm_engine, {}
    for kind in RequestOutputKind:
        ids = [f"{kind.name}-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, p, SamplingParams(output_kind=kind, **params))
        acc: dict = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                for o in out.outputs:
                    key = (out.request_id.split("-")[1], o.index)
                    text, toks, _ = acc.get(key, ("", [], None))
                    if kind == RequestOutputKind.DELTA:
                        acc[key] = (text + o.text, toks + o.token_ids, o.finish_reason)
                    else:
                        acc[key] = (o.text, list(o.token_ids), o.finish_reason)
        got[kind] = acc
    want = got[RequestOutputKind.CUMULATIVE]
    assert any(reason == "stop" for _, _, reason in want.values())
    assert any(text for text, _, _ in want.values())
    assert got[RequestOutputKind.FINAL_ONLY] == want
    assert got[RequestOutputKind.DELTA] == want
