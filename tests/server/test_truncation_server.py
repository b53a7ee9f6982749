"""truncate_prompt_tokens over HTTP on TEXT inputs is applied by the tokenizer, as vLLM's
renderer does (its special tokens, [CLS] ... [SEP] / BOS, stay); token-id inputs are sliced.
References: the HF tokenizer's own truncation, and the same server on those ids."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from server_proc import COMMON_ARGS, MAX_MODEL_LEN, serve_in_process
from test_truncation_tokenizer import DOC, LONG, QUERY, TEXT, hf_cut, with_specials
from transformers import AutoTokenizer

from paged_engine.testing import BOS_ID, EOS_ID


def _served(path) -> Iterator[SimpleNamespace]:
    from paged_engine import EngineConfig, LLMEngine

    engine = LLMEngine(
        EngineConfig.from_kwargs(
            model=str(path),
            dtype="float32",
            device="cpu",
            num_gpu_blocks_override=128,
            max_model_len=MAX_MODEL_LEN,
        )
    )
    with serve_in_process(COMMON_ARGS, engine) as (http, _app):
        yield SimpleNamespace(http=http, path=path)
    engine.shutdown()


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Iterator[SimpleNamespace]:
    from paged_engine.testing import write_tiny_encoder

    raw = write_tiny_encoder(tmp_path_factory.mktemp("bert"), "BertModel")
    yield from _served(with_specials(raw, pair=True))


@pytest.fixture(scope="module")
def cross(tmp_path_factory) -> Iterator[SimpleNamespace]:
    from paged_engine.testing import write_tiny_encoder

    raw = write_tiny_encoder(
        tmp_path_factory.mktemp("ce"), "BertForSequenceClassification", num_labels=1
    )
    yield from _served(with_specials(raw, pair=True))


@pytest.fixture(scope="module")
def decoder(tmp_path_factory) -> Iterator[SimpleNamespace]:
    from paged_engine.testing import write_tiny_model

    raw = write_tiny_model(tmp_path_factory.mktemp("dec"), "llama")
    yield from _served(with_specials(raw, pair=False))


def post(s: SimpleNamespace, route: str, body: dict) -> dict:
    status, _, r = s.http.request("POST", route, {"model": "tiny", **body})
    assert status == 200, r
    return r


def test_embeddings_and_pooling_keep_cls_and_sep(bert) -> None:
    k = 7
    want = hf_cut(bert.path, TEXT, k, "right")
    assert want[0] == BOS_ID and want[-1] == EOS_ID
    ref = post(bert, "/v1/embeddings", {"input": [want]})
    r = post(bert, "/v1/embeddings", {"input": [TEXT], "truncate_prompt_tokens": k})
    assert r["usage"]["prompt_tokens"] == k
    assert r["data"][0]["embedding"] == pytest.approx(ref["data"][0]["embedding"], abs=1e-6)
    r = post(bert, "/pooling", {"input": TEXT, "truncate_prompt_tokens": k})
    assert r["usage"]["prompt_tokens"] == k
    assert r["data"][0]["data"] == pytest.approx(ref["data"][0]["embedding"], abs=1e-6)
    # -1: all that fit, [SEP] last
    whole = hf_cut(bert.path, LONG, MAX_MODEL_LEN, "right")
    assert whole[-1] == EOS_ID
    ref = post(bert, "/v1/embeddings", {"input": [whole]})
    r = post(bert, "/v1/embeddings", {"input": LONG, "truncate_prompt_tokens": -1})
    assert r["data"][0]["embedding"] == pytest.approx(ref["data"][0]["embedding"], abs=1e-6)
    # token ids: sliced
    ids = AutoTokenizer.from_pretrained(bert.path).encode(TEXT)
    ref = post(bert, "/v1/embeddings", {"input": [ids[:k]]})
    r = post(bert, "/v1/embeddings", {"input": [ids], "truncate_prompt_tokens": k})
    assert r["data"][0]["embedding"] == pytest.approx(ref["data"][0]["embedding"], abs=1e-6)
    status, _, r = bert.http.request(
        "POST", "/v1/embeddings", {"input": TEXT, "truncate_prompt_tokens": MAX_MODEL_LEN + 1}
    )
    assert status == 400 and r["error"]["param"] == "truncate_prompt_tokens", r


def test_classify_score_and_rerank_cut_by_the_tokenizer(cross) -> None:
    k = 7
    want = hf_cut(cross.path, TEXT, k, "right")
    ref = post(cross, "/classify", {"input": [want]})
    r = post(cross, "/classify", {"input": TEXT, "truncate_prompt_tokens": k})
    assert r["usage"]["prompt_tokens"] == k
    assert r["data"][0]["probs"] == pytest.approx(ref["data"][0]["probs"], abs=1e-6)

    tok = AutoTokenizer.from_pretrained(cross.path, truncation_side="right")
    k = 12
    pair = tok(QUERY, text_pair=DOC, truncation=True, max_length=k)["input_ids"]
    assert len(pair) == k and pair.count(EOS_ID) == 2  # both [SEP]s kept
    ref = post(cross, "/classify", {"input": [pair]})  # one label: the score's sigmoid
    ref = {"data": [{"score": ref["data"][0]["probs"][0]}]}
    body = {"queries": QUERY, "documents": DOC, "truncate_prompt_tokens": k}
    r = post(cross, "/score", body)
    assert r["usage"]["prompt_tokens"] == k
    assert r["data"][0]["score"] == pytest.approx(ref["data"][0]["score"], abs=1e-6)
    r = post(cross, "/rerank", {"query": QUERY, "documents": [DOC], "truncate_prompt_tokens": k})
    assert r["results"][0]["relevance_score"] == pytest.approx(ref["data"][0]["score"], abs=1e-6)
    status, _, r = cross.http.request("POST", "/score", {**body, "truncate_prompt_tokens": 999})
    assert status == 400 and r["error"]["param"] == "truncate_prompt_tokens", r


def test_completions_keep_bos_and_cut_the_start(decoder) -> None:
    k = 7
    want = hf_cut(decoder.path, TEXT, k, "left")
    assert want[0] == BOS_ID
    body = {"prompt": TEXT, "max_tokens": 1, "truncate_prompt_tokens": k, "return_token_ids": True}
    r = post(decoder, "/v1/completions", body)
    assert r["usage"]["prompt_tokens"] == k
    assert r["choices"][0]["prompt_token_ids"] == want
    ids = AutoTokenizer.from_pretrained(decoder.path).encode(TEXT)
    r = post(decoder, "/v1/completions", {**body, "prompt": ids})
    assert r["choices"][0]["prompt_token_ids"] == ids[-k:]  # token ids: sliced
    r = post(decoder, "/v1/completions", {**body, "truncate_prompt_tokens": None})
    assert r["choices"][0]["prompt_token_ids"] == ids  # no cut
