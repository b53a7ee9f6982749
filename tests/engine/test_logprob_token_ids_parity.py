"""vLLM's rules for `logprob_token_ids` (vllm/sampling_params.py `_validate_logprobs`, the
OpenAI protocols' `to_sampling_params`): `logprobs` is None or the ids' count as given; the
ids are bounded by MAX_LOGPROB_TOKEN_IDS (128), not by max_logprobs, which still bounds
prompt_logprobs. The server's side: tests/server/test_logprob_token_ids_server.py."""

from __future__ import annotations

import dataclasses

import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.sampling_params import MAX_LOGPROB_TOKEN_IDS, whole_vocabulary

pytest.importorskip("transformers")

PROMPT = {"prompt_token_ids": [5, 6, 7]}


@pytest.mark.parametrize("logprobs", [0, 2, 4, -1])
def test_a_logprobs_count_other_than_the_ids_count_is_refused(logprobs):
    with pytest.raises(ValueError, match=r"logprob_token_ids holds 3 ids.*logprobs="):
        SamplingParams(logprobs=logprobs, logprob_token_ids=[7, 250, 3])


def test_the_count_is_the_ids_as_given_and_then_their_distinct_count():
    p = SamplingParams(logprobs=3, logprob_token_ids=[7, 7, 3])  # 3 as given
    assert p.logprob_token_ids == [7, 3] and p.logprobs == 2
    assert SamplingParams(logprob_token_ids=[9, 4, 9]).logprobs == 2  # None: the count
    # a copy validates again (logprobs and the ids agree), -1 prompt logprobs included
    assert dataclasses.replace(p).logprob_token_ids == [7, 3]
    wide = whole_vocabulary(SamplingParams(logprob_token_ids=[7, 7], prompt_logprobs=-1), 512)
    assert (wide.logprobs, wide.prompt_logprobs, wide.logprob_token_ids) == (1, 512, [7])
    # no ids: logprobs None or 0, as in vLLM
    assert SamplingParams(logprob_token_ids=[]).logprobs is None
    assert SamplingParams(logprobs=0, logprob_token_ids=[]).logprobs == 0
    with pytest.raises(ValueError, match="logprob_token_ids holds 0 ids"):
        SamplingParams(logprobs=5, logprob_token_ids=[])


def test_at_most_128_ids():
    assert MAX_LOGPROB_TOKEN_IDS == 128
    assert len(SamplingParams(logprob_token_ids=list(range(128))).logprob_token_ids) == 128
    for ids in (list(range(129)), [1] * 129):  # counted as given, repeats included
        with pytest.raises(ValueError, match="logprob_token_ids holds at most 128"):
            SamplingParams(logprob_token_ids=ids)


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    path = tiny_model_factory("llama")
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, max_logprobs=2)
    yield llm
    llm.llm_engine.shutdown()


def test_max_logprobs_bounds_the_top_k_counts_not_the_ids(llm):
    wanted = [7, 250, 3]  # more than max_logprobs=2
    kw = {"temperature": 0, "max_tokens": 3, "ignore_eos": True}
    out = llm.generate(PROMPT, SamplingParams(**kw, logprob_token_ids=wanted), use_tqdm=False)
    got = out[0].outputs[0]
    assert len(got.logprobs) == 3
    for step, entry in enumerate(got.logprobs):
        assert set(entry) == {got.token_ids[step], *wanted}
        assert all(lp.rank >= 1 and lp.logprob <= 0.0 for lp in entry.values())
    bounded = SamplingParams(**kw, logprob_token_ids=wanted, prompt_logprobs=3)
    with pytest.raises(ValueError, match=r"^prompt_logprobs=3 .*max_logprobs=2"):
        llm.generate(PROMPT, bounded, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^logprobs=3 .*max_logprobs=2"):
        llm.generate(PROMPT, SamplingParams(**kw, logprobs=3), use_tqdm=False)
