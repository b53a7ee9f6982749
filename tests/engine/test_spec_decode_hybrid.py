"""Speculative decoding on models with a recurrent state: hybrids (Qwen3.5's Gated DeltaNet,
Jamba's Mamba among attention layers) and pure state-space models (Mamba, Mamba2 without KV).

A verify step runs a row's drafts through the state; the worker backs the row up first and puts
it back when a draft is rejected, and the accepted tokens run again in the next step (their
tokens sent to the worker). Greedy decoding must be token-identical to plain decoding (logprobs
within 1e-4) with drafts both accepted and rejected, by n-gram lookup and by a draft model; n > 1
sequences, preemption mid-speculation, the prefix cache's snapshots and TP=2 lose nothing, and no
state row is left taken.
"""

from __future__ import annotations

import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_model

pytestmark = pytest.mark.usefixtures("no_isolated_step_failures")  # conftest.py

pytest.importorskip("transformers")

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
# name -> (tiny arch, config overrides)
CASES = {
    "mamba": ("mamba", {}),
    "mamba2": ("mamba2", {}),
    "qwen3_5": ("qwen3_5", {}),
    # tied embeddings: a tiny model that repeats itself, so n-grams get accepted
    "jamba": ("jamba", {"tie_word_embeddings": True}),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    made = {}

    def make(name: str):
        if name not in made:
            arch, kw = CASES[name]
            made[name] = write_tiny_model(tmp_path_factory.mktemp(name), arch, seed=1, **kw)
        return made[name]

    return make


def _requests(llm: LLM) -> list[dict]:
    """Prompts that repeat the model's own greedy text (so n-grams propose what it will say,
    and sometimes not), and ones that do not."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeds = [[5, 6, 7, 8], [40, 41, 42], [100, 7, 250, 9, 31]]
    outs = llm.generate([{"prompt_token_ids": s} for s in seeds], greedy, use_tqdm=False)
    echoed = [s + list(o.outputs[0].token_ids) for s, o in zip(seeds, outs, strict=True)]
    return [{"prompt_token_ids": p} for p in echoed + [[9, 9, 9, 9, 9, 9], [3, 4] * 8]]


def _outputs(outs):
    return [
        (list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        for o in outs
        for c in o.outputs
    ]


def _assert_same(got, want):
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, g), (_, w) in zip(got, want, strict=True):
        assert g == pytest.approx(w, abs=1e-4)


def _run(path, requests, params, **kw):
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, **kw)
    outs = llm.generate(requests, params, use_tqdm=False)
    engine = llm.llm_engine
    slots = engine.scheduler.state_slots
    assert slots.num_free == slots.num_slots  # no state row left taken
    assert engine.get_stats().num_used_blocks == 0
    return _outputs(outs), engine


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_is_token_identical_with_drafts_accepted_and_rejected(name, dirs):
    path = dirs(name)
    plain = LLM(model=str(path), dtype="float32", max_model_len=256)
    requests = _requests(plain)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
    want = _outputs(plain.generate(requests, params, use_tqdm=False))
    got, engine = _run(path, requests, params, speculative_config=NGRAM)
    _assert_same(got, want)
    stats = engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0  # drafts kept: the state ran them
    # drafts rejected: the state was put back and the accepted tokens ran again
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_forks_preemption_and_prefix_cache(dirs):
    """n = 2 greedy sequences speculate next to each other, preempted (recompute) under a small
    block pool, with prefix-cache snapshots: the plain engine's outputs."""
    path = dirs("jamba")
    plain = LLM(model=str(path), dtype="float32", max_model_len=256)
    requests = _requests(plain) * 2
    params = SamplingParams(n=2, temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
    want = _outputs(plain.generate(requests, params, use_tqdm=False))
    got, engine = _run(
        path,
        requests,
        params,
        speculative_config=NGRAM,
        num_gpu_blocks_override=24,
        max_num_batched_tokens=32,
    )
    _assert_same(got, want)
    stats = engine.get_stats()
    assert engine.scheduler.num_preemptions > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_draft_model_on_a_stateful_target(dirs, tmp_path):
    """A transformer draft (same tokenizer) for a Mamba2 target: greedy identical; a draft
    with a recurrent state of its own is refused, naming the option."""
    target = dirs("mamba2")
    draft = write_tiny_model(tmp_path / "draft", "llama", seed=1)
    plain = LLM(model=str(target), dtype="float32", max_model_len=256)
    requests = _requests(plain)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    want = _outputs(plain.generate(requests, params, use_tqdm=False))
    spec = {"model": str(draft), "num_speculative_tokens": 3}
    got, engine = _run(target, requests, params, speculative_config=spec)
    _assert_same(got, want)
    stats = engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        LLM(
            model=str(dirs("mamba")),
            dtype="float32",
            speculative_config={"model": str(target), "num_speculative_tokens": 2},
        )


def test_tensor_parallel_ranks_roll_back_together(dirs):
    """tensor_parallel_size=2 (gloo on the CPU): each rank backs up and restores its shard of
    the state on the same verdicts; the plain engine's greedy tokens."""
    path = dirs("mamba")
    plain = LLM(model=str(path), dtype="float32", max_model_len=256)
    requests = _requests(plain)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    want = _outputs(plain.generate(requests, params, use_tqdm=False))
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_model_len=256,
        tensor_parallel_size=2,
        speculative_config=NGRAM,
    )
    try:
        got = _outputs(llm.generate(requests, params, use_tqdm=False))
        stats = llm.llm_engine.get_stats()
    finally:
        llm.llm_engine.shutdown()
    _assert_same(got, want)
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
