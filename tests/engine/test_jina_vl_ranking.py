"""jina-reranker-m0 (`JinaVLForRanking`: models/jina_vl_ranker.py, jina_vl_scoring.py) against
HF Qwen2-VL with the head in torch.

The release is remote code; its model is transformers' Qwen2VLForConditionalGeneration plus
`score` = Linear(D, D) -> ReLU -> Linear(D, 1) on the last hidden state of the last token,
minus 2.65, through a sigmoid. The test writes a tiny random Qwen2-VL checkpoint (transformers
5 saves it under the release's names: `model.X`, `visual.X`, no LM head), converts it into the
release's layout (flat Qwen2-VL config.json of transformers 4.4x with `rope_scaling` "mrope",
architectures ["JinaVLForRanking"], random `score.0.*` / `score.2.*`) and checks `LLM.score`
on text-text and text-image pairs (vLLM's template, document first, score token 100 appended),
`use_activation=False`'s raw logit and `LLM.classify` on an image prompt against HF's last
hidden state through the head (1e-4, float32); then the refusals.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from image_checks import qwen2_vl_hf_inputs

from paged_engine import LLM, PoolingParams
from paged_engine.testing import write_tiny_qwen2_vl

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
Image = pytest.importorskip("PIL.Image")

VISION = "<|vision_start|><|image_pad|><|vision_end|>"
BIAS = 2.65


def _image(seed: int, size: tuple[int, int]):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def _release_layout(src, dst) -> dict[str, torch.Tensor]:
    """`src` (a transformers Qwen2-VL checkpoint) as jina-reranker-m0's files in `dst`;
    returns the head's weights."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    for key in ("model_type", "layer_types", "dtype", "architectures"):
        text.pop(key, None)
    cfg |= text  # the release's config is flat: the decoder's fields at the top level
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    cfg["architectures"] = ["JinaVLForRanking"]
    cfg["auto_map"] = {"AutoModel": "modeling.JinaVLForRanking"}
    (dst / "config.json").write_text(json.dumps(cfg))
    weights = safetensors_torch.load_file(str(src / "model.safetensors"))
    assert not any(n.startswith(("lm_head.", "model.language_model.")) for n in weights)
    d = text["hidden_size"]
    g = torch.Generator().manual_seed(7)
    head = {
        "score.0.weight": torch.randn(d, d, generator=g) * 0.1,
        "score.0.bias": torch.randn(d, generator=g) * 0.1,
        "score.2.weight": torch.randn(1, d, generator=g) * 0.3,
        "score.2.bias": torch.full((1,), BIAS + 2.0),  # scores near 0.5: a sigmoid at its steepest
    }
    safetensors_torch.save_file({**weights, **head}, str(dst / "model.safetensors"))
    return head


class _HF:
    """HF Qwen2-VL's last hidden state of the pair prompt's last token through the head."""

    def __init__(self, path, head: dict[str, torch.Tensor]) -> None:
        cls = transformers.Qwen2VLForConditionalGeneration
        self.model = cls.from_pretrained(path, dtype=torch.float32).eval()
        self.images = transformers.AutoImageProcessor.from_pretrained(path)
        self.tok = transformers.AutoTokenizer.from_pretrained(path)
        self.pad = self.model.config.image_token_id
        self.head = head

    def ids(self, query: str, document: str, images: list) -> tuple[list[int], dict]:
        text = f"**Document**:\n{document}\n**Query**:\n{query}"
        ids = list(self.tok(text)["input_ids"]) + [100]
        return qwen2_vl_hf_inputs(ids, images, self.images, self.pad)

    @torch.no_grad()
    def logit(self, query: str, document: str, images: list = ()) -> tuple[list[int], float]:
        ids, extra = self.ids(query, document, list(images))
        h = self.model.model(input_ids=torch.tensor([ids]), **extra).last_hidden_state[0, -1]
        x = torch.relu(h @ self.head["score.0.weight"].T + self.head["score.0.bias"])
        return ids, float(x @ self.head["score.2.weight"].T + self.head["score.2.bias"]) - BIAS


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("jina-vl")
    src = write_tiny_qwen2_vl(root / "qwen2-vl", version="2", seed=3)
    head = _release_layout(src, root / "jina")
    llm = LLM(model=str(root / "jina"), dtype="float32", block_size=16, max_model_len=512)
    return llm, _HF(src, head), root / "jina"


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + np.exp(-v))


def test_score_text_and_image_pairs_match_hf(setup):
    llm, hf, _ = setup
    img_a, img_b = _image(1, (40, 56)), _image(2, (72, 24))
    docs = ["the sea is blue", "a cat on a mat, sleeping"]
    outs = llm.score("what colour is the sea?", docs, use_tqdm=False)
    for doc, out in zip(docs, outs, strict=True):
        ids, logit = hf.logit("what colour is the sea?", doc)
        assert out.prompt_token_ids == ids and ids[-1] == 100
        assert out.outputs.score == pytest.approx(_sigmoid(logit), abs=1e-4)
    # text query, image documents (vLLM's {"prompt": "", "multi_modal_data": ...} form), and an
    # image query with text beside it against a text document (the document's images first)
    pairs = [
        ("which one is red?", {"prompt": "", "multi_modal_data": {"image": img_a}}, "", [img_a]),
        (
            {"prompt": "like this", "multi_modal_data": {"image": [img_b]}},
            {"prompt": "a chart", "multi_modal_data": {"image": img_a}},
            "",
            [img_a, img_b],
        ),
    ]
    outs = llm.score([p[0] for p in pairs], [p[1] for p in pairs], use_tqdm=False)
    raw = llm.score(
        [p[0] for p in pairs],
        [p[1] for p in pairs],
        use_tqdm=False,
        pooling_params=PoolingParams(use_activation=False),
    )
    for (query, doc, _, images), out, r in zip(pairs, outs, raw, strict=True):
        q = query if isinstance(query, str) else VISION + query["prompt"]
        d = VISION + doc["prompt"]
        ids, logit = hf.logit(q, d, images)
        assert out.prompt_token_ids == ids
        assert out.outputs.score == pytest.approx(_sigmoid(logit), abs=1e-4)
        assert r.outputs.score == pytest.approx(logit, abs=1e-4)
    # LLM.classify on an image prompt given as token ids (the score token appended by hand)
    ids, _ = hf.ids("red?", VISION, [])
    out = llm.classify(
        [{"prompt_token_ids": ids, "multi_modal_data": {"image": img_b}}], use_tqdm=False
    )
    _, logit = hf.logit("red?", VISION, [img_b])
    assert out[0].outputs.probs == pytest.approx([_sigmoid(logit)], abs=1e-4)


def test_refusals(setup):
    llm, _, path = setup
    with pytest.raises(ValueError, match="data_2"):
        llm.score("q", [[5, 6, 7]], use_tqdm=False)  # token-id sides
    with pytest.raises(ValueError, match="content"):
        llm.score("q", [{"content": [{"type": "text", "text": "x"}]}], use_tqdm=False)
    with pytest.raises(ValueError, match="multi_modal_data takes 'image' only"):
        llm.score("q", [{"prompt": "d", "multi_modal_data": {"video": [1]}}], use_tqdm=False)
    with pytest.raises(ValueError, match="classifier"):
        llm.embed(["a text"], use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_type='MEAN'"):
        LLM(model=str(path), dtype="float32", pooler_config={"pooling_type": "MEAN"})
    with pytest.raises(ValueError, match="logit_bias"):
        LLM(model=str(path), dtype="float32", pooler_config={"logit_bias": 1.0})


def test_rerank_over_http_formats_pairs_as_offline(setup):
    """paged-server's /rerank reads text pairs through the same template (scores.py)."""
    pytest.importorskip("paged_server")
    from server.server_proc import COMMON_ARGS, serve_in_process

    llm, hf, _ = setup
    query, docs = "what colour is the sea?", ["the sea is blue", "a cat on a mat"]
    body = {"model": "tiny", "query": query, "documents": docs}
    with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, _):
        status, _, r = http.request("POST", "/rerank", body)
    assert status == 200, r
    got = {d["index"]: d["relevance_score"] for d in r["results"]}
    want = {i: _sigmoid(hf.logit(query, d)[1]) for i, d in enumerate(docs)}
    assert got == pytest.approx(want, abs=1e-4)
