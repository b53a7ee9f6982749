"""Token rules: the bitmask op, logit_bias, allowed_token_ids and bad_words (sampler and engine)."""

from __future__ import annotations

import re

import pytest
import torch

from paged_engine import LLM, SamplingParams
from paged_engine.sample.metadata import metadata_from_params
from paged_engine.sample.sampler import Sampler
from paged_engine.structured_output.bitmask import apply_token_bitmask, bitmask_width

CPU = torch.device("cpu")


@pytest.mark.parametrize("vocab", [5, 32, 100, 130])
def test_bitmask_matches_bit_by_bit_reference(vocab):
    g = torch.Generator().manual_seed(vocab)
    words = bitmask_width(vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int32)
    logits = torch.randn(5, vocab, generator=g)
    rows = torch.tensor([4, 0, 2])
    ref = logits.clone()
    for r, lr in enumerate(rows.tolist()):
        for t in range(vocab):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                ref[lr, t] = float("-inf")
    apply_token_bitmask(logits, rows, bitmask)
    assert torch.equal(logits, ref)


def test_bitmask_shorter_than_vocab_masks_the_rest():
    logits = torch.zeros(1, 40)
    apply_token_bitmask(logits, torch.tensor([0]), torch.full((1, 1), -1, dtype=torch.int32))
    assert torch.isinf(logits[0, 32:]).all() and (logits[0, :32] == 0).all()


def _sample(params: list[SamplingParams], logits: torch.Tensor) -> list[int]:
    md = metadata_from_params(params, CPU, logits.shape[1])
    return Sampler()(logits, md).token_ids.tolist()


def test_sampler_logit_bias_and_allowed_ids_batched():
    logits = torch.zeros(4, 10)
    logits[:, 3] = 5.0  # the unconstrained argmax
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logit_bias={7: 100}),
        SamplingParams(temperature=0, allowed_token_ids=[1, 8]),
        SamplingParams(temperature=0, logit_bias={"3": -100.0, 2: 1.0}),
    ]
    logits[2, 8] = 1.0
    assert _sample(params, logits) == [3, 7, 8, 2]


def test_sampling_params_token_rule_validation():
    assert SamplingParams(logit_bias={"5": 300, 6: -1e9}).logit_bias == {5: 100.0, 6: -100.0}
    bad = [
        ({"logit_bias": [1, 2]}, "logit_bias must be a dict"),
        ({"logit_bias": {"x": 1}}, "logit_bias must be an integer"),
        ({"logit_bias": {-3: 1}}, "logit_bias token ids must be non-negative"),
        ({"logit_bias": {3: float("nan")}}, "logit_bias[3] must be a finite number"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
        ({"allowed_token_ids": [1, "a"]}, "allowed_token_ids must be an integer"),
        ({"bad_words": ["ok", ""]}, "bad_words must be a list of non-empty strings"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=256)


def _greedy(llm: LLM, prompt: str, **kw) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **kw)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def test_engine_allowed_ids_and_bias(llm):
    assert set(_greedy(llm, "hello", allowed_token_ids=[40, 41, 42])) <= {40, 41, 42}
    assert _greedy(llm, "hello", logit_bias={77: 100}) == [77] * 16
    free = _greedy(llm, "hello")
    banned = _greedy(llm, "hello", logit_bias={t: -100 for t in set(free)})
    assert not set(banned) & set(free)


def test_engine_rejects_out_of_vocab_ids(llm):
    vocab = llm.llm_engine.vocab_size
    for kw in ({"logit_bias": {vocab: 1}}, {"allowed_token_ids": [0, vocab + 5]}):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate(["x"], SamplingParams(**kw), use_tqdm=False)
    assert len(_greedy(llm, "x")) == 16  # still serving


def test_engine_bad_words(llm):
    tok = llm.get_tokenizer()
    free = _greedy(llm, "the quick brown")
    text = tok.decode(free)
    word = text.split()[1] if len(text.split()) > 1 else text.split()[0]
    out = llm.generate(
        ["the quick brown"],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, bad_words=[word]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids != free
    for ids in (tok.encode(word, add_special_tokens=False),
                tok.encode(" " + word, add_special_tokens=False)):  # fmt: skip
        n = len(ids)
        assert all(out.token_ids[i : i + n] != ids for i in range(len(out.token_ids) - n + 1))
