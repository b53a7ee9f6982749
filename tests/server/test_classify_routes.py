"""/classify (classify.py) and cross-encoder /score and /rerank (scores.py) on tiny
`*ForSequenceClassification` models served in this process by a real engine; references are HF
transformers' classifiers on the same weights."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from server_proc import API_KEY, COMMON_ARGS, MAX_MODEL_LEN, ServerProc, serve_in_process

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TEXTS = ["the capital of France", "one two three", "bananas"]


def _served(path) -> Iterator[SimpleNamespace]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

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
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with serve_in_process(COMMON_ARGS, engine) as (http, _app):
        yield SimpleNamespace(http=http, hf=hf, tok=AutoTokenizer.from_pretrained(path))
    engine.shutdown()


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> Iterator[SimpleNamespace]:
    from paged_engine.testing import write_tiny_classifier

    path = tmp_path_factory.mktemp("cls")
    yield from _served(write_tiny_classifier(path, "qwen3", num_labels=3, id2label=LABELS))


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> Iterator[SimpleNamespace]:
    from paged_engine.testing import write_tiny_classifier

    yield from _served(write_tiny_classifier(tmp_path_factory.mktemp("ce"), "llama", num_labels=1))


def logits(s: SimpleNamespace, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return s.hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("path", ["/classify", "/v1/classify"])
def test_classify_texts_and_token_ids_match_hf(classifier, path) -> None:
    ids = [classifier.tok.encode(t) for t in TEXTS]
    for inp, want_ids in ((TEXTS, ids), (TEXTS[0], ids[:1]), (ids[1], ids[1:2]), (ids, ids)):
        status, _, r = classifier.http.request("POST", path, {"model": "tiny", "input": inp})
        assert status == 200, r
        assert r["object"] == "list" and r["model"] == "tiny" and r["id"].startswith("classify-")
        assert [d["index"] for d in r["data"]] == list(range(len(want_ids)))
        for d, t in zip(r["data"], want_ids):
            want = logits(classifier, t).softmax(-1)
            assert d["probs"] == pytest.approx(want.tolist(), abs=1e-5)
            assert d["num_classes"] == 3
            assert d["label"] == LABELS[int(want.argmax())]
        n = sum(len(t) for t in want_ids)
        assert r["usage"] == {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}


def test_classify_raw_logits_and_truncation(classifier) -> None:
    ids = classifier.tok.encode(TEXTS[0])
    body = {"input": TEXTS[0], "use_activation": False, "truncate_prompt_tokens": 2}
    status, _, r = classifier.http.request("POST", "/classify", body)
    assert status == 200, r
    # a pooling-only engine keeps the first tokens (vLLM's truncation_side "right")
    assert r["data"][0]["probs"] == pytest.approx(logits(classifier, ids[:2]).tolist(), abs=1e-5)
    assert r["usage"]["prompt_tokens"] == 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [[1, 2], "x", 3]}, "input"),
        ({"input": "x", "use_activation": "yes"}, "use_activation"),
        ({"input": "x", "add_special_tokens": 1}, "add_special_tokens"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "x", "normalize": True}, "normalize"),
        ({"input": "x", "model": 7}, "model"),
        ({"input": "x", "model": "other"}, "model"),
        ({"input": "x", "priority": 1.5}, "priority"),
        ({"input": [1 << 40]}, "input"),
        ({"input": "word " * (2 * MAX_MODEL_LEN)}, "input"),
    ],
)
def test_classify_bad_bodies_name_their_param(classifier, body, param) -> None:
    status, _, r = classifier.http.request("POST", "/classify", body)
    assert status in (400, 404), r
    assert r["error"]["param"] == param, r


def test_a_classifier_refuses_generation_embeddings_and_multi_label_scores(classifier) -> None:
    status, _, r = classifier.http.request("POST", "/v1/completions", {"prompt": "hi"})
    assert status == 400 and "sequence classifier" in r["error"]["message"], r
    status, _, r = classifier.http.request(
        "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    )
    assert status == 400 and "sequence classifier" in r["error"]["message"], r
    status, _, r = classifier.http.request("POST", "/v1/embeddings", {"input": "hi"})
    assert status == 400 and "classifier" in r["error"]["message"], r
    status, _, r = classifier.http.request("POST", "/score", {"queries": "a", "documents": "b"})
    assert status == 400 and r["error"]["param"] == "model", r
    assert "single-label" in r["error"]["message"]
    # and goes on serving
    status, _, r = classifier.http.request("POST", "/classify", {"input": "a"})
    assert status == 200, r


def test_cross_encoder_score_and_rerank_match_hf(cross_encoder) -> None:
    s = cross_encoder
    pairs = [s.tok(TEXTS[0], text_pair=d)["input_ids"] for d in TEXTS]
    want = [logits(s, ids).sigmoid().item() for ids in pairs]
    status, _, r = s.http.request("POST", "/v1/score", {"queries": TEXTS[0], "documents": TEXTS})
    assert status == 200, r
    assert [d["score"] for d in r["data"]] == pytest.approx(want, abs=1e-5)
    n = sum(len(p) for p in pairs)
    assert r["usage"] == {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}

    body = {"query": TEXTS[0], "documents": TEXTS, "top_n": 2}
    status, _, r = s.http.request("POST", "/rerank", body)
    assert status == 200, r
    order = sorted(range(len(TEXTS)), key=lambda i: -want[i])[:2]
    assert [x["index"] for x in r["results"]] == order
    for x in r["results"]:
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-5)
        assert x["document"] == {"text": TEXTS[x["index"]]}

    body = {"text_1": TEXTS[1], "text_2": TEXTS[2], "use_activation": False}
    status, _, r = s.http.request("POST", "/score", body)
    assert status == 200, r
    raw = logits(s, s.tok(TEXTS[1], text_pair=TEXTS[2])["input_ids"]).item()
    assert r["data"][0]["score"] == pytest.approx(raw, abs=1e-5)

    # a single-label classifier classifies too: sigmoid of its one logit
    status, _, r = s.http.request("POST", "/classify", {"input": TEXTS[2]})
    assert status == 200, r
    ids = s.tok.encode(TEXTS[2])
    assert r["data"][0]["probs"] == pytest.approx([logits(s, ids).sigmoid().item()], abs=1e-5)


def test_cross_encoder_pair_too_long_names_the_documents(cross_encoder) -> None:
    body = {"query": "a", "documents": ["b", "word " * (2 * MAX_MODEL_LEN)]}
    status, _, r = cross_encoder.http.request("POST", "/rerank", body)
    assert status == 400 and r["error"]["param"] == "documents", r
    assert "pair 1" in r["error"]["message"]


def test_an_embedding_model_has_no_classify(real_server: ServerProc) -> None:
    status, _, r = real_server.request("POST", "/classify", {"input": "hello"})
    assert status == 400 and r["error"]["param"] == "model", r


def test_the_api_key_guards_classify(guarded_server: ServerProc) -> None:
    status, _, r = guarded_server.request("POST", "/classify", {"input": "hello"})
    assert status == 401, r
    headers = {"Authorization": f"Bearer {API_KEY}"}
    status, _, r = guarded_server.request("POST", "/classify", {"input": "x"}, headers=headers)
    assert status == 400 and r["error"]["param"] == "model", r


def test_hf_overrides_serve_a_causal_lm_as_a_reranker(tmp_path) -> None:
    """`paged-server MODEL --hf-overrides '{...Qwen3-Reranker's...}'`: /rerank scores the
    probability of "yes" between "no" and "yes" as the causal model's next token."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from paged_engine.testing import write_tiny_model
    from paged_server.cli import build_engine, parse_args

    path = write_tiny_model(tmp_path / "lm", "qwen3")
    tok = AutoTokenizer.from_pretrained(path)
    no_tok, yes_tok = 10, 11
    overrides = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": tok.convert_ids_to_tokens([no_tok, yes_tok]),
        "is_original_qwen3_reranker": True,
    }
    argv = [str(path), "--hf-overrides", json.dumps(overrides), *COMMON_ARGS]
    engine = build_engine(parse_args([*argv, "--dtype", "float32"]))
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    try:
        with serve_in_process(COMMON_ARGS, engine) as (http, _app):
            status, _, r = http.request("POST", "/rerank", {"query": "a b", "documents": TEXTS})
    finally:
        engine.shutdown()
    assert status == 200, r
    for x in r["results"]:
        ids = tok("a b", text_pair=TEXTS[x["index"]])["input_ids"]
        with torch.no_grad():
            last = lm(torch.tensor([ids])).logits[0, -1]
        want = last[[no_tok, yes_tok]].softmax(-1)[1].item()
        assert x["relevance_score"] == pytest.approx(want, abs=1e-5)


def test_invocations_classify_an_input_on_a_classifier(classifier) -> None:
    body = {"input": TEXTS[:2]}
    status, _, got = classifier.http.request("POST", "/invocations", body)
    assert status == 200, got
    status, _, want = classifier.http.request("POST", "/classify", body)
    assert status == 200, want
    assert got["data"] == want["data"] and got["usage"] == want["usage"]


@pytest.mark.parametrize("flags", [["--task", "embed"], ["--runner", "pooling"]])
def test_a_pooling_server_embeds_and_refuses_generation(tmp_path, flags) -> None:
    """vLLM's `--task embed` / `--runner pooling` command lines start paged-server too."""
    from paged_engine.testing import write_tiny_model
    from paged_server.cli import build_engine, parse_args

    path = write_tiny_model(tmp_path / "lm", "qwen3")
    engine = build_engine(parse_args([str(path), *flags, "--dtype", "float32", *COMMON_ARGS]))
    try:
        with serve_in_process(COMMON_ARGS, engine) as (http, _app):
            status, _, r = http.request("POST", "/v1/embeddings", {"input": "a b"})
            assert status == 200 and len(r["data"]) == 1, r
            status, _, r = http.request("POST", "/v1/completions", {"prompt": "a", "max_tokens": 2})
            assert status == 400 and "runner='pooling'" in r["error"]["message"], r
    finally:
        engine.shutdown()


def test_pooling_answers_the_models_own_output(classifier, real_server: ServerProc) -> None:
    """vLLM's /pooling: a classifier's probabilities, an embedding model's embedding."""
    body = {"input": TEXTS[:2]}
    status, _, r = classifier.http.request("POST", "/pooling", body)
    assert status == 200 and r["id"].startswith("pool-"), r
    status, _, want = classifier.http.request("POST", "/classify", body)
    assert [d["data"] for d in r["data"]] == [d["probs"] for d in want["data"]]
    assert {d["object"] for d in r["data"]} == {"pooling"}
    assert r["usage"] == want["usage"]

    status, _, r = real_server.request("POST", "/pooling", {"input": "hello", "task": "embed"})
    assert status == 200, r
    status, _, want = real_server.request("POST", "/v1/embeddings", {"input": "hello"})
    assert r["data"][0]["data"] == want["data"][0]["embedding"]
    for bad, param in (
        ({"input": "x", "task": "classify"}, "task"),
        ({"input": "x", "task": "reward"}, "task"),
        ({"input": "x", "use_activation": 1}, "use_activation"),
        ({"input": "x", "messages": []}, "messages"),
    ):
        status, _, r = real_server.request("POST", "/pooling", bad)
        assert status == 400 and r["error"]["param"] == param, (bad, r)


def test_an_encoder_cross_encoder_serves_rerank_and_embeddings(tmp_path) -> None:
    """An XLM-RoBERTa cross-encoder (bge-reranker's architecture) behind paged-server."""
    from transformers import AutoTokenizer, XLMRobertaForSequenceClassification

    from paged_engine.testing import write_tiny_encoder
    from paged_server.cli import build_engine, parse_args

    arch = "XLMRobertaForSequenceClassification"
    path = write_tiny_encoder(tmp_path / "xlmr", arch, num_labels=1, max_position_embeddings=200)
    engine = build_engine(parse_args([str(path), "--dtype", "float32", *COMMON_ARGS]))
    tok = AutoTokenizer.from_pretrained(path)
    hf = XLMRobertaForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    try:
        with serve_in_process(COMMON_ARGS, engine) as (http, _app):
            status, _, r = http.request("POST", "/rerank", {"query": "a b", "documents": TEXTS})
            assert status == 200, r
            for x in r["results"]:
                ids = tok("a b", text_pair=TEXTS[x["index"]])["input_ids"]
                with torch.no_grad():
                    want = hf(torch.tensor([ids])).logits[0, 0].sigmoid().item()
                assert x["relevance_score"] == pytest.approx(want, abs=1e-5)
            status, _, r = http.request("POST", "/v1/completions", {"prompt": "a", "max_tokens": 2})
            assert status == 400 and "sequence classifier" in r["error"]["message"], r
    finally:
        engine.shutdown()


def test_an_encoder_token_classifier_labels_each_token_on_pooling(tmp_path) -> None:
    """A BERT NER tagger (dslim/bert-base-NER's architecture): /pooling gives each prompt
    token's label probabilities by default; /classify and generation are refused."""
    from transformers import AutoTokenizer, BertForTokenClassification

    from paged_engine.testing import write_tiny_encoder
    from paged_server.cli import build_engine, parse_args

    arch = "BertForTokenClassification"
    path = write_tiny_encoder(tmp_path / "ner", arch, num_labels=3, id2label=LABELS)
    engine = build_engine(parse_args([str(path), "--dtype", "float32", *COMMON_ARGS]))
    tok = AutoTokenizer.from_pretrained(path)
    hf = BertForTokenClassification.from_pretrained(path, dtype=torch.float32).eval()
    try:
        with serve_in_process(COMMON_ARGS, engine) as (http, _app):
            status, _, r = http.request("POST", "/pooling", {"input": TEXTS[:2]})
            assert status == 200, r
            for d, text in zip(r["data"], TEXTS[:2]):
                with torch.no_grad():
                    want = hf(torch.tensor([tok(text)["input_ids"]])).logits[0].softmax(-1)
                torch.testing.assert_close(torch.tensor(d["data"]), want, atol=1e-5, rtol=1e-5)
            status, _, r = http.request("POST", "/classify", {"input": TEXTS[0]})
            assert status == 400 and "labels each token" in r["error"]["message"], r
            status, _, r = http.request("POST", "/v1/completions", {"prompt": "a", "max_tokens": 2})
            assert status == 400 and "token classifier" in r["error"]["message"], r
    finally:
        engine.shutdown()
