"""Images in the pooling APIs over HTTP (embeddings.py, scores.py, pooling_media.py), in vLLM's
request shapes, against the offline API on the same tiny checkpoints (the engine tests'
builders): CLIP's and SigLIP's chat-form /v1/embeddings and /pooling (an image-only message
embeds the image, a text-only one the text) equal `LLM.embed`; /score with a `{"content":
[image_url]}` document equals `LLM.score` (cosine of the two towers' embeddings);
jina-reranker-m0's /rerank and /score with image queries and documents, and its chat form on
/pooling (the Qwen2-VL template places the image), equal the offline API; then the 400s, each
naming its parameter, with the server answering afterwards.
"""

from __future__ import annotations

import base64
import io

import pytest
from image_checks import noise_image
from server_proc import COMMON_ARGS, serve_in_process
from test_clip_siglip_embeddings import FAMILIES, save_tiny
from test_jina_vl_ranking import _release_layout

from paged_engine import LLM
from paged_engine.testing import write_tiny_qwen2_vl

pytest.importorskip("PIL.Image")


def _url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, "png")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image_part(image) -> dict:
    return {"type": "image_url", "image_url": {"url": _url(image)}}


def _chat(*parts: dict, **extra) -> dict:
    return {"messages": [{"role": "user", "content": list(parts)}], **extra}


BROKEN = {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}
IMG_A, IMG_B = noise_image(1, (40, 40)), noise_image(2, (23, 57))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def dual_encoder(request, tmp_path_factory):
    """(offline LLM, HTTP handle) of a tiny CLIPModel / SiglipModel (no chat template: vLLM's
    fallback)."""
    path = tmp_path_factory.mktemp(request.param)
    save_tiny(request.param, path)
    llm = LLM(model=str(path), dtype="float32", max_model_len=64, num_gpu_blocks_override=32)
    with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, _):
        yield llm, http


@pytest.fixture(scope="module")
def jina(tmp_path_factory):
    """(offline LLM, HTTP handle) of a tiny jina-reranker-m0 (the engine test's release)."""
    root = tmp_path_factory.mktemp("jina-vl")
    _release_layout(write_tiny_qwen2_vl(root / "qwen2-vl", version="2", seed=3), root / "jina")
    llm = LLM(model=str(root / "jina"), dtype="float32", block_size=16, max_model_len=512)
    with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, _):
        yield llm, http


def _post(http, path: str, body: dict) -> dict:
    status, _, r = http.request("POST", path, body)
    assert status == 200, r
    return r


def _embedding(out) -> list[float]:
    return list(out.outputs.embedding)


def test_dual_encoder_chat_embeddings_equal_offline(dual_encoder):
    llm, http = dual_encoder
    image_prompt = {"prompt": "", "multi_modal_data": {"image": IMG_A}}
    want_image, want_text = llm.embed([image_prompt, "a photo of a cat"], use_tqdm=False)
    r = _post(http, "/v1/embeddings", _chat(_image_part(IMG_A)))
    assert r["data"][0]["embedding"] == pytest.approx(_embedding(want_image), abs=1e-5)
    assert r["usage"]["prompt_tokens"] == 1  # the image's one placeholder
    r = _post(http, "/pooling", _chat(_image_part(IMG_A)))
    assert r["data"][0]["data"] == pytest.approx(_embedding(want_image), abs=1e-5)
    # the text tower, tokenized as LLM.embed tokenizes (the chat form adds no BOS by default)
    text = {"type": "text", "text": "a photo of a cat"}
    r = _post(http, "/v1/embeddings", _chat(text, add_special_tokens=True))
    assert r["data"][0]["embedding"] == pytest.approx(_embedding(want_text), abs=1e-5)


def test_dual_encoder_scores_text_against_image_documents(dual_encoder):
    llm, http = dual_encoder
    docs = [{"content": [_image_part(IMG_A)]}, "hi", {"content": [_image_part(IMG_B)]}]
    offline = [
        {"prompt": "", "multi_modal_data": {"image": IMG_A}},
        "hi",
        {"prompt": "", "multi_modal_data": {"image": IMG_B}},
    ]
    want = [o.outputs.score for o in llm.score("a photo of a cat", offline, use_tqdm=False)]
    r = _post(http, "/score", {"queries": "a photo of a cat", "documents": docs})
    assert [d["score"] for d in r["data"]] == pytest.approx(want, abs=1e-5)
    r = _post(http, "/rerank", {"query": "a photo of a cat", "documents": docs})
    assert {x["index"]: x["relevance_score"] for x in r["results"]} == pytest.approx(
        dict(enumerate(want)), abs=1e-5
    )
    shown = {x["index"]: x["document"] for x in r["results"]}
    assert shown[0] == {"multi_modal": docs[0]["content"]} and shown[1] == {"text": "hi"}


def test_jina_rerank_and_score_with_images_equal_offline(jina):
    llm, http = jina
    query = "which one is red?"
    docs = [
        {"content": [_image_part(IMG_A)]},
        "the sea is blue",
        {"content": [{"type": "text", "text": "a chart"}, _image_part(IMG_B)]},
    ]
    offline = [
        {"prompt": "", "multi_modal_data": {"image": [IMG_A]}},
        "the sea is blue",
        {"prompt": "a chart", "multi_modal_data": {"image": [IMG_B]}},
    ]
    outs = llm.score(query, offline, use_tqdm=False)
    r = _post(http, "/rerank", {"query": query, "documents": docs})
    got = {x["index"]: x["relevance_score"] for x in r["results"]}
    assert got == pytest.approx({i: o.outputs.score for i, o in enumerate(outs)}, abs=1e-5)
    tokens = sum(len(o.prompt_token_ids) for o in outs)  # each image's whole run counted
    assert r["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    # an image query beside text against a text document, N:N on /score
    queries = [{"content": [{"type": "text", "text": "like this"}, _image_part(IMG_B)]}, "red?"]
    offline_q = [{"prompt": "like this", "multi_modal_data": {"image": IMG_B}}, "red?"]
    want = llm.score(offline_q, ["a cat", offline[0]], use_tqdm=False)
    r = _post(http, "/score", {"queries": queries, "documents": ["a cat", docs[0]]})
    assert [d["score"] for d in r["data"]] == pytest.approx(
        [o.outputs.score for o in want], abs=1e-5
    )


def test_a_vlm_pools_a_chat_with_an_image_through_its_template(jina):
    """The chat form on a Qwen2-VL model: the template writes the image's placeholder, the
    server expands its run; /pooling answers what LLM.classify gives the rendered prompt."""
    llm, http = jina
    parts = [{"type": "image", "image": None}, {"type": "text", "text": "red?"}]
    text = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=False
    )
    (want,) = llm.classify([{"prompt": text, "multi_modal_data": {"image": IMG_B}}], use_tqdm=False)
    body = _chat(_image_part(IMG_B), {"type": "text", "text": "red?"})
    r = _post(http, "/pooling", body)
    assert r["data"][0]["data"] == pytest.approx(want.outputs.probs, abs=1e-5)
    assert r["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    status, _, r = http.request("POST", "/pooling", {**body, "truncate_prompt_tokens": 4})
    assert status == 400 and r["error"]["param"] == "truncate_prompt_tokens", r


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/embeddings", _chat(BROKEN), "messages[0].content[0].image_url"),
        (
            "/v1/embeddings",  # CLIP embeds a text or an image, not both
            _chat({"type": "text", "text": "a cat"}, _image_part(IMG_A)),
            "messages",
        ),
        ("/pooling", _chat(_image_part(IMG_A), _image_part(IMG_B)), "messages"),
        (
            "/score",
            {"queries": "a", "documents": {"content": [BROKEN]}},
            "documents[0].content[0].image_url",
        ),
        (
            "/score",
            {
                "queries": "a",
                "documents": [{"content": [{"type": "text", "text": "hi"}, _image_part(IMG_A)]}],
            },
            "documents[0]",
        ),
        ("/rerank", {"query": {"content": []}, "documents": ["b"]}, "query"),
        (
            "/rerank",
            {
                "query": "a",
                "documents": [{"content": [{"type": "video_url", "video_url": {"url": "x"}}]}],
            },
            "documents[0].content[0].video_url",
        ),
        ("/rerank", {"query": "a", "documents": [{"content": [], "x": 1}]}, "documents[0]"),
    ],
)
def test_dual_encoder_bad_inputs_name_the_parameter(dual_encoder, path, body, param):
    llm, http = dual_encoder
    status, _, r = http.request("POST", path, body)
    assert status == 400, r
    assert r["error"]["param"] == param and r["error"]["type"] == "invalid_request_error", r
    r = _post(http, "/v1/embeddings", _chat(_image_part(IMG_B)))  # still serving
    (want,) = llm.embed([{"prompt": "", "multi_modal_data": {"image": IMG_B}}], use_tqdm=False)
    assert r["data"][0]["embedding"] == pytest.approx(_embedding(want), abs=1e-5)


def test_a_text_only_model_refuses_images_by_name(tiny_model):
    llm = LLM(model=tiny_model, dtype="float32", max_model_len=64)
    with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, _):
        for path, body, param in [
            ("/v1/embeddings", _chat(_image_part(IMG_A)), "messages[0].content"),
            (
                "/score",
                {"queries": "a", "documents": [{"content": [_image_part(IMG_A)]}]},
                "documents[0]",
            ),
            ("/rerank", {"query": {"content": [_image_part(IMG_A)]}, "documents": "b"}, "query"),
        ]:
            status, _, r = http.request("POST", path, body)
            assert status == 400 and r["error"]["param"] == param, r
        _post(http, "/v1/embeddings", {"input": "still here"})
