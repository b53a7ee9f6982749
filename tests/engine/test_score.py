"""LLM.score (scoring.py): cosine similarity of two texts' embeddings, pairs 1:1, 1:N, N:N;
truncate_prompt_tokens on embed / encode / score.

Reference: HF transformers' base model `last_hidden_state` on the same weights (test_embed.py's
`hf_embeddings`), the cosine computed here in float64.
"""

from __future__ import annotations

import pytest
import torch
from test_embed import hf_embeddings, make_llm

from paged_engine import PoolingParams, ScoringRequestOutput

QUERY = list(range(3, 30))
DOCS = [[5, 6, 7, 8], list(range(40, 75)), list(range(3, 30)), [9]]


def hf_cosine(path, first, second) -> list[float]:
    a = hf_embeddings(path, first, "LAST", normalize=False)
    b = hf_embeddings(path, second, "LAST", normalize=False)
    return [
        float(torch.nn.functional.cosine_similarity(x.double(), y.double(), dim=0))
        for x, y in zip(a, b)
    ]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


def test_one_query_against_documents_matches_hf(llm, tiny_llama_dir):
    core = llm.llm_engine.engine_core
    before = core.prompt_tokens_total
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    # the query ran once, not once per document
    assert core.prompt_tokens_total - before == len(QUERY) + sum(map(len, DOCS))
    assert all(isinstance(o, ScoringRequestOutput) and o.finished for o in outs)
    want = hf_cosine(tiny_llama_dir, [QUERY] * len(DOCS), DOCS)
    got = [o.outputs.score for o in outs]
    assert got == pytest.approx(want, abs=1e-5)
    assert got[2] == pytest.approx(1.0, abs=1e-6)  # the query against itself
    pad = llm.get_tokenizer().pad_token_id
    sep = [] if pad is None else [pad]
    assert [o.prompt_token_ids for o in outs] == [QUERY + sep + d for d in DOCS]
    assert len({o.request_id for o in outs}) == len(DOCS)


def test_pairs_one_to_one_and_text_prompts(llm, tiny_llama_dir):
    firsts = [QUERY, [7, 8, 9, 10, 11]]
    outs = llm.score(firsts, DOCS[:2], use_tqdm=False)
    want = hf_cosine(tiny_llama_dir, firsts, DOCS[:2])
    assert [o.outputs.score for o in outs] == pytest.approx(want, abs=1e-5)
    # text on either side: tokenized as generate tokenizes it; scoring is symmetric
    tok = llm.get_tokenizer()
    (ab,) = llm.score("hello world", "a cat on a mat", use_tqdm=False)
    (ba,) = llm.score("a cat on a mat", "hello world", use_tqdm=False)
    assert ab.outputs.score == pytest.approx(ba.outputs.score, abs=1e-6)
    ref = hf_cosine(tiny_llama_dir, [tok.encode("hello world")], [tok.encode("a cat on a mat")])
    assert ab.outputs.score == pytest.approx(ref[0], abs=1e-5)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm, tiny_llama_dir):
    long = list(range(3, 203))  # longer than max_model_len (128)
    with pytest.raises(ValueError, match="too long"):
        llm.embed(long, use_tqdm=False)
    (cut,) = llm.embed(long, use_tqdm=False, truncate_prompt_tokens=20)
    assert cut.prompt_token_ids == long[-20:]
    (ref,) = hf_embeddings(tiny_llama_dir, [long[-20:]], "LAST")
    torch.testing.assert_close(torch.tensor(cut.outputs.embedding), ref, atol=1e-5, rtol=1e-4)
    (most,) = llm.encode(long, PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)
    assert most.prompt_token_ids == long[-128:]  # a pooling prompt may fill max_model_len
    (short,) = llm.embed(DOCS[0], use_tqdm=False, truncate_prompt_tokens=20)  # shorter: whole
    assert short.prompt_token_ids == DOCS[0]
    (scored,) = llm.score(long, QUERY, use_tqdm=False, truncate_prompt_tokens=20)
    assert scored.outputs.score == pytest.approx(
        hf_cosine(tiny_llama_dir, [long[-20:]], [QUERY[-20:]])[0], abs=1e-5
    )


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "8"])
def test_bad_truncate_prompt_tokens_names_it(llm, bad):
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=bad)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.score(QUERY, DOCS, use_tqdm=False, truncate_prompt_tokens=bad)


def test_bad_pairings_name_the_side(llm):
    with pytest.raises(ValueError, match="data_1 has 2 texts and data_2 3"):
        llm.score([QUERY, QUERY], DOCS[:3], use_tqdm=False)
    with pytest.raises(ValueError, match="data_1 must hold"):
        llm.score([], DOCS, use_tqdm=False)
    with pytest.raises(ValueError, match="data_2 must hold"):
        llm.score(QUERY, [], use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_params"):
        llm.score(QUERY, DOCS, use_tqdm=False, pooling_params={"normalize": True})
    # nothing of a refused call stays queued
    assert not llm.llm_engine.has_unfinished_requests()
