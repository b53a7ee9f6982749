"""Async scheduling with speculative decoding: the same outputs as the synchronous engine.

A speculating row waits for its pending token before it drafts (spec_decode/planner.py), and a
paused one decodes on the device-side token meanwhile, so the async engine drafts at exactly the
rows the synchronous one drafts at: greedy and seeded outputs, logprobs, finish reasons and the
draft / acceptance counters all match, with n-gram lookup, a draft model and an EAGLE head,
under n > 1, stop strings, stop ids, max_tokens, penalties and structured outputs. Under
preemption (recompute, and swap: a request with a verify step in flight recomputes) greedy
outputs match; which rows draft there depends on free blocks, so on timing, in the synchronous
engine too.
"""

from __future__ import annotations

import random

import pytest

from paged_engine import LLM, SamplingParams, StructuredOutputsParams
from paged_engine.core.scheduler import Scheduler, _verifying
from paged_engine.testing import write_tiny_eagle_head, write_tiny_model

pytest.importorskip("transformers")
from test_spec_draft_model import small_draft
from test_spec_penalties import repeating  # noqa: F401 (a fixture)

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def _prompts() -> list[dict]:
    rng = random.Random(0)
    fixed = [[5, 6, 7, 8, 9] * 6, [40, 41] * 9, [7, 7, 7, 7], [300, 301] * 3]
    rand = [[rng.randrange(3, 400) for _ in range(rng.randint(2, 30))] for _ in range(3)]
    return [{"prompt_token_ids": p} for p in fixed + rand]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=30, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=28, logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=4, n=2, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=25, stop_token_ids=[41, 9], min_tokens=3),
        SamplingParams(temperature=0.7, seed=6, frequency_penalty=0.5, max_tokens=22),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, max_tokens=20, stop=["a", "e"]),
    ]


def _run(path, async_scheduling: bool, prompts, params, **engine) -> tuple[list, object]:
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_model_len=128,
        block_size=4,
        async_scheduling=async_scheduling,
        **engine,
    )
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = [
        [
            (
                c.index,
                list(c.token_ids),
                c.text,
                c.finish_reason,
                c.stop_reason,
                [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])],
            )
            for c in o.outputs
        ]
        for o in outs
    ]
    stats = llm.llm_engine.get_stats()
    assert stats.num_used_blocks == 0 and stats.num_running == 0
    llm.llm_engine.shutdown()
    return got, stats


def _assert_same(got: list, want: list) -> None:
    assert [[c[:5] for c in o] for o in got] == [[c[:5] for c in o] for o in want]
    for o, w in zip(got, want):
        for c, e in zip(o, w):
            assert c[5] == pytest.approx(e[5], abs=1e-4)


def _assert_same_drafting(a, b) -> None:
    """The same rows drafted the same tokens and kept the same ones."""
    assert a.spec_decode_num_drafts == b.spec_decode_num_drafts
    assert a.spec_decode_num_draft_tokens == b.spec_decode_num_draft_tokens
    assert a.spec_decode_num_accepted_tokens == b.spec_decode_num_accepted_tokens
    assert a.spec_decode_num_accepted_tokens > 0


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("async_spec") / "llama", "llama", seed=1)


def test_ngram_async_equals_sync(repeating):  # noqa: F811
    spec = {"speculative_config": NGRAM}
    want, sync_stats = _run(repeating, False, _prompts(), _params(), **spec)
    got, async_stats = _run(repeating, True, _prompts(), _params(), **spec)
    _assert_same(got, want)
    _assert_same_drafting(async_stats, sync_stats)


def _greedy_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=30, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=28, stop=["a", "e"], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=25, stop_token_ids=[41, 9], min_tokens=3),
        SamplingParams(temperature=0, frequency_penalty=0.5, max_tokens=22, logprobs=1),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, stop=["a", "e"]),
    ]


@pytest.mark.parametrize(
    "model, blocks, engine",
    [
        ("repeating", 34, {}),
        # a random target: a verify step in flight when its request is preempted rejects
        ("llama", 42, {"preemption_mode": "swap", "swap_space": 0.01}),
    ],
    ids=["recompute", "swap"],
)
def test_preemption_with_verify_steps_in_flight(request, model, blocks, engine, monkeypatch):
    """Preempted while a verify step runs: its tokens land, and it recomputes (never swaps:
    its rejected drafts' slots would count as computed). Greedy rows are the synchronous
    engine's (which rows draft depends on free blocks, so on timing, there)."""
    path = request.getfixturevalue(model)
    spec = dict(
        engine, speculative_config=NGRAM, num_gpu_blocks_override=blocks, max_num_batched_tokens=40
    )
    prompts, params = _prompts(), _greedy_params()
    del prompts[3], params[6]
    want, _ = _run(path, False, prompts, params, **spec)
    verifying: list[bool] = []
    preempt = Scheduler._preempt

    def recording(self, req, preempted, *, allow_swap=True):
        verifying.append(any(map(_verifying, req.live_seqs())))
        preempt(self, req, preempted, allow_swap=allow_swap)

    monkeypatch.setattr(Scheduler, "_preempt", recording)
    got, stats = _run(path, True, prompts, params, **spec)
    _assert_same(got, want)
    assert any(verifying) and stats.spec_decode_num_accepted_tokens > 0
    if "preemption_mode" in engine:
        assert stats.num_swap_preemptions > 0


def test_ngram_backoff_on_a_random_target_drafts_the_same_rows(llama):
    """A random target rejects most drafts: sequences pause and decode async in between, and
    resume drafting at the same rows as the synchronous engine."""
    spec = {"speculative_config": dict(NGRAM, num_speculative_tokens=2)}
    want, sync_stats = _run(llama, False, _prompts(), _params(), **spec)
    got, async_stats = _run(llama, True, _prompts(), _params(), **spec)
    _assert_same(got, want)
    _assert_same_drafting(async_stats, sync_stats)
    assert sync_stats.spec_decode_num_accepted_tokens < sync_stats.spec_decode_num_draft_tokens


def test_n_greater_than_one_siblings_pause_and_resume_together(llama):
    """n = 2 on a random target: both samples pause (their drafts rejected) and decode on
    their pending tokens, each spending its own pause; a request waits while any sample is
    due to draft."""
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 6}, {"prompt_token_ids": [40, 41] * 9}]
    params = SamplingParams(temperature=0.8, seed=4, n=2, max_tokens=80, ignore_eos=True)
    spec = {"speculative_config": dict(NGRAM, num_speculative_tokens=2)}
    want, sync_stats = _run(llama, False, prompts, [params] * 2, **spec)
    got, async_stats = _run(llama, True, prompts, [params] * 2, **spec)
    _assert_same(got, want)
    assert async_stats.spec_decode_num_drafts == sync_stats.spec_decode_num_drafts > 0
    assert async_stats.spec_decode_num_draft_tokens == sync_stats.spec_decode_num_draft_tokens


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_device_drafts_async_equal_sync(llama, tmp_path, method):
    """Drafts the worker proposes (a draft model, an EAGLE head): the same rows draft, the
    same tokens come out."""
    if method == "eagle":
        head = write_tiny_eagle_head(tmp_path / "head", llama, seed=1)
        spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 2}
    else:
        draft = small_draft(llama, tmp_path / "draft", "llama")
        spec = {"model": str(draft), "num_speculative_tokens": 2}
    engine = {"speculative_config": spec}
    want, sync_stats = _run(llama, False, _prompts(), _params(), **engine)
    got, async_stats = _run(llama, True, _prompts(), _params(), **engine)
    _assert_same(got, want)
    _assert_same_drafting(async_stats, sync_stats)


def test_structured_outputs_async_equals_sync(repeating):  # noqa: F811
    pytest.importorskip("llguidance")
    so = StructuredOutputsParams(regex="a{6}b{6}c{6}")
    params = [
        SamplingParams(temperature=0, max_tokens=30, logprobs=1, structured_outputs=so),
        SamplingParams(temperature=0, max_tokens=30, logprobs=1, ignore_eos=True),
    ]
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(repeating).encode("aaaaa", add_special_tokens=False)
    prompts = [{"prompt_token_ids": ids}, _prompts()[0]]
    want, sync_stats = _run(repeating, False, prompts, params, speculative_config=NGRAM)
    got, async_stats = _run(repeating, True, prompts, params, speculative_config=NGRAM)
    _assert_same(got, want)
    _assert_same_drafting(async_stats, sync_stats)
