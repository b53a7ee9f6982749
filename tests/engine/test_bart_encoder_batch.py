"""BART / mBART's encoder runs a step's new encoder prompts as one batch (models/bart.py
`BartModel.encode_batch`, `PaddedBatch`).

Tiny random checkpoints (test_bart.py's, 512 positions): prompts of 1, 7, 64 and 300 tokens
encoded together give the rows each gives alone (float32, atol 1e-5), for BART (post-norm) and
mBART (pre-norm, scaled embedding), and with Florence-2's per-prompt prefix rows; one
`LLM.generate` over those prompts runs the encoder once for all four and gives HF `generate`'s
greedy tokens and top-5 logprobs.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import assert_matches
from image_checks import greedy
from test_bart import engine, hf_generate, hf_model, prompt_ids, write_tiny

LENGTHS = (1, 7, 64, 300)


@pytest.fixture(scope="module", params=["bart", "mbart"])
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def path(tmp_path_factory, kind):
    return write_tiny(tmp_path_factory.mktemp(kind), kind, seed=11, max_positions=512)


@pytest.fixture(scope="module")
def llm(path):
    return engine(path)


def test_batch_equals_one_by_one(llm):
    model = llm.llm_engine.model_runner.model.model
    ids = [torch.tensor(prompt_ids(20 + i, n)) for i, n in enumerate(LENGTHS)]
    alone = [model.encode(t) for t in ids]
    together = model.encode_batch(ids)
    assert together.shape == (sum(LENGTHS), alone[0].shape[1])
    for i, rows in enumerate(together.split(list(LENGTHS))):
        torch.testing.assert_close(rows, alone[i], atol=1e-5, rtol=0, msg=f"prompt {i}")
    # Florence-2's prefix rows (multimodal/florence2.py), on some prompts only
    d = alone[0].shape[1]
    g = torch.Generator().manual_seed(0)
    prefixes = [torch.randn(5, d, generator=g), None, torch.randn(3, d, generator=g), None]
    alone = [model.encode(t, p) for t, p in zip(ids, prefixes, strict=True)]
    together = model.encode_batch(ids, prefixes)
    assert together.shape[0] == sum(LENGTHS) + 8
    for i, rows in enumerate(together.split([len(a) for a in alone])):
        torch.testing.assert_close(rows, alone[i], atol=1e-5, rtol=0, msg=f"prefixed {i}")


def test_mixed_batch_matches_hf(path, kind, llm, monkeypatch):
    model = llm.llm_engine.model_runner.model.model
    calls: list[list[int]] = []
    batch = model.encode_batch

    def spy(ids, prefixes=None):
        calls.append([len(t) for t in ids])
        return batch(ids, prefixes)

    monkeypatch.setattr(model, "encode_batch", spy)
    encs = [prompt_ids(30 + i, n) for i, n in enumerate(LENGTHS)]
    hf = hf_model(path, kind)
    refs = [hf_generate(hf, enc) for enc in encs]
    outs = llm.generate(encs, greedy(), use_tqdm=False)
    assert calls == [list(LENGTHS)]  # one encoder run for the step's four new prompts
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_matches(f"{kind} prompt of {LENGTHS[i]}", out, ref)
