"""/score and /rerank (scores.py) against a real server on a tiny llama: each score is the
cosine similarity of HF transformers' final hidden states of the two texts (last token), on the
same weights; the shapes are vLLM's (score) and Jina's / Cohere's (rerank)."""

from __future__ import annotations

import pytest
import torch
from server_proc import API_KEY, MAX_MODEL_LEN, ServerProc

QUERY = "the capital of France"
DOCS = ["Paris is a city", "one two three", "the capital of France", "bananas"]


@pytest.fixture(scope="module")
def hf(tiny_model: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model)


def cosine(hf, a: list[int], b: list[int]) -> float:
    model, _ = hf
    with torch.no_grad():
        x = model.base_model(torch.tensor([a])).last_hidden_state[0, -1].double()
        y = model.base_model(torch.tensor([b])).last_hidden_state[0, -1].double()
    return float(torch.nn.functional.cosine_similarity(x, y, dim=0))


def pair_tokens(hf, a: list[int], b: list[int]) -> int:
    """vLLM's count for a pair: both texts and the pad token between them (if any)."""
    return len(a) + len(b) + (hf[1].pad_token_id is not None)


@pytest.mark.parametrize("names", [("queries", "documents"), ("text_1", "text_2")])
def test_score_one_query_against_documents_matches_hf(real_server: ServerProc, hf, names):
    tok = hf[1]
    body = {"model": "tiny", names[0]: QUERY, names[1]: DOCS}
    status, _, r = real_server.request("POST", "/score", body)
    assert status == 200, r
    assert r["object"] == "list" and r["model"] == "tiny" and r["id"].startswith("score-")
    assert [d["index"] for d in r["data"]] == [0, 1, 2, 3]
    assert {d["object"] for d in r["data"]} == {"score"}
    q = tok.encode(QUERY)
    want = [cosine(hf, q, tok.encode(d)) for d in DOCS]
    assert [d["score"] for d in r["data"]] == pytest.approx(want, abs=1e-5)
    assert r["data"][2]["score"] == pytest.approx(1.0, abs=1e-6)
    tokens = sum(pair_tokens(hf, q, tok.encode(d)) for d in DOCS)
    assert r["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def test_score_pairs_n_to_n_on_the_v1_path(real_server: ServerProc, hf):
    tok = hf[1]
    firsts = ["hello world", "bananas"]
    body = {"data_1": firsts, "data_2": DOCS[:2]}
    status, _, r = real_server.request("POST", "/v1/score", body)
    assert status == 200, r
    want = [cosine(hf, tok.encode(a), tok.encode(b)) for a, b in zip(firsts, DOCS[:2])]
    assert [d["score"] for d in r["data"]] == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_sorts_best_first_and_keeps_top_n(real_server: ServerProc, hf, path):
    tok = hf[1]
    body = {"model": "tiny", "query": QUERY, "documents": DOCS}
    status, _, r = real_server.request("POST", path, body)
    assert status == 200, r
    assert r["model"] == "tiny" and r["id"].startswith("rerank-")
    q = tok.encode(QUERY)
    want = [cosine(hf, q, tok.encode(d)) for d in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    assert [x["index"] for x in r["results"]] == order
    for x in r["results"]:
        assert x["document"] == {"text": DOCS[x["index"]]}
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-5)
    tokens = sum(pair_tokens(hf, q, tok.encode(d)) for d in DOCS)
    assert r["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}

    body = {"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": False}
    status, _, top = real_server.request("POST", path, body)
    assert status == 200, top
    assert [x["index"] for x in top["results"]] == order[:2]
    assert all("document" not in x for x in top["results"])


def test_truncation_keeps_the_last_tokens(real_server: ServerProc, hf):
    long_text = " ".join(["word"] * (MAX_MODEL_LEN + 20))
    status, _, r = real_server.request("POST", "/score", {"queries": long_text, "documents": "x"})
    assert status == 400 and r["error"]["param"] == "queries", r
    body = {"queries": long_text, "documents": "word word", "truncate_prompt_tokens": 6}
    status, _, r = real_server.request("POST", "/score", body)
    assert status == 200, r
    tok = hf[1]
    want = cosine(hf, tok.encode(long_text)[-6:], tok.encode("word word")[-6:])
    assert r["data"][0]["score"] == pytest.approx(want, abs=1e-5)
    # -1: as many as fit, here and on /v1/embeddings
    body["truncate_prompt_tokens"] = -1
    status, _, r = real_server.request("POST", "/score", body)
    assert status == 200, r
    body = {"input": long_text, "truncate_prompt_tokens": -1, "encoding_format": "float"}
    status, _, r = real_server.request("POST", "/v1/embeddings", body)
    assert status == 200 and r["usage"]["prompt_tokens"] == MAX_MODEL_LEN, r


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/score", {"queries": "a"}, "documents"),
        ("/score", {"documents": ["a"]}, "queries"),
        ("/score", {"queries": ["a", "b"], "documents": ["a", "b", "c"]}, "documents"),
        ("/score", {"queries": [], "documents": ["a"]}, "queries"),
        ("/score", {"queries": "a", "documents": [1, 2]}, "documents"),
        ("/score", {"queries": "a", "documents": "b", "text_1": "c"}, "text_1"),
        ("/score", {"queries": "a", "documents": "b", "bogus": 1}, "bogus"),
        (
            "/score",
            {"queries": "a", "documents": "b", "truncate_prompt_tokens": 0},
            "truncate_prompt_tokens",
        ),
        ("/score", {"queries": "a", "documents": "b", "model": "other"}, "model"),
        ("/score", {"queries": "a", "documents": "b", "use_activation": "yes"}, "use_activation"),
        ("/rerank", {"documents": ["a"]}, "query"),
        ("/rerank", {"query": ["a", "b"], "documents": ["a"]}, "query"),
        ("/rerank", {"query": "a", "documents": []}, "documents"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
        ("/rerank", {"query": "a", "documents": ["b"], "return_documents": 1}, "return_documents"),
        ("/rerank", [1, 2], None),
    ],
)
def test_bad_requests_name_the_field(real_server: ServerProc, path, body, param):
    status, _, r = real_server.request("POST", path, body)
    assert status in (400, 404), r
    assert r["error"]["param"] == param, r
    status, _, r = real_server.request("POST", "/rerank", {"query": "a", "documents": ["b"]})
    assert status == 200 and len(r["results"]) == 1


@pytest.mark.parametrize("path", ["/score", "/rerank", "/v2/rerank", "/v1/score"])
def test_the_api_key_guards_every_scoring_path(guarded_server: ServerProc, path):
    body = {"queries": "a", "documents": "b"} if "score" in path else {"query": "a"}
    body["documents"] = "b"
    status, _, r = guarded_server.request("POST", path, body)
    assert status == 401 and r["error"]["code"] == "invalid_api_key", r
    auth = {"Authorization": f"Bearer {API_KEY}"}
    status, _, r = guarded_server.request("POST", path, body, headers=auth)
    assert status == 200, r
