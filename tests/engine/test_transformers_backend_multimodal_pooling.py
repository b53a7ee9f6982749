"""Embeddings of a vision-language checkpoint through the Transformers modeling backend
(models/transformers_backend/multimodal.py, pooling.py): a tiny random LLaVA under
`model_impl="transformers", runner="pooling"` embeds image prompts (one image, two, none) as HF's
`LlavaModel` does with HF's processor's pixels (its last hidden state at the last token,
L2-normalized; float32, 1e-5) and as paged's native LLaVA does; vLLM's
`TransformersMultiModalEmbeddingModel` in hf_overrides gives the same embeddings and only
pools; a sequence classifier of a VLM (vLLM's `TransformersMultiModalForSequenceClassification`,
`convert="classify"`) is refused by name at engine start."""

from __future__ import annotations

import pytest
import torch
from image_checks import hf_cases, processor_inputs
from test_transformers_backend_multimodal import (  # tests/engine is on sys.path
    PROMPT,
    TEXT,
    TWO,
    _llm,
    _prompts,
    llava,  # noqa: F401 (the tiny LLaVA checkpoint fixture)
)

from paged_engine import LLM

transformers = pytest.importorskip("transformers")

EMBED = "TransformersMultiModalEmbeddingModel"
CLASSIFIER = "TransformersMultiModalForSequenceClassification"
CASES = hf_cases(PROMPT, TEXT, TWO)  # one image, text alone, two images of other sizes


def _embed(llm: LLM) -> list[torch.Tensor]:
    outs = llm.embed(_prompts(CASES), use_tqdm=False)
    return [torch.tensor(o.outputs.embedding) for o in outs]


@pytest.fixture(scope="module")
def hf_embeddings(llava) -> list[torch.Tensor]:  # noqa: F811
    """HF's LlavaModel on HF's processor's ids and pixels: the last token's final normed
    hidden state, L2-normalized (the engine's LAST pooling)."""
    processor = transformers.AutoProcessor.from_pretrained(llava)
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(llava, dtype=torch.float32)
    rows = []
    for text, images in CASES:
        ids, extra = processor_inputs(processor, text, images, ("pixel_values",))
        with torch.no_grad():
            out = hf.eval().model(input_ids=torch.tensor([ids]), **extra)
        rows.append(torch.nn.functional.normalize(out.last_hidden_state[0, -1], dim=-1))
    return rows


def test_embeddings_match_hf_and_the_native_class(llava, hf_embeddings) -> None:  # noqa: F811
    llm = _llm(llava, runner="pooling")
    assert type(llm.llm_engine.model_runner.model).__name__ == "TransformersMultiModalForCausalLM"
    got = _embed(llm)
    assert llm.llm_engine.model_runner.images.encoded == 3  # every image through HF's tower
    for row, want in zip(got, hf_embeddings, strict=True):
        torch.testing.assert_close(row, want, atol=1e-5, rtol=0)
    assert (got[0] - got[1]).abs().max() > 1e-2  # the image moves the embedding
    native = LLM(model=str(llava), dtype="float32", block_size=16, max_model_len=256)
    assert "Transformers" not in type(native.llm_engine.model_runner.model).__name__
    for row, want in zip(got, _embed(native), strict=True):
        torch.testing.assert_close(row, want, atol=1e-5, rtol=0)


def test_vllm_embedding_name_selects_a_headless_pooling_model(llava, hf_embeddings) -> None:  # noqa: F811
    """vLLM's name in hf_overrides picks the backend whatever model_impl says; without an LM
    head the model only pools."""
    llm = LLM(
        model=str(llava),
        dtype="float32",
        block_size=16,
        max_model_len=256,
        hf_overrides={"architectures": [EMBED]},
    )
    model = llm.llm_engine.model_runner.model
    assert type(model).__name__ == EMBED
    assert type(model.model).__module__.startswith("transformers.models.")  # HF's decoder
    assert llm.llm_engine.serves == "pooling"
    for row, want in zip(_embed(llm), hf_embeddings, strict=True):
        torch.testing.assert_close(row, want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"runner='generate'.*only pools"):
        _llm(llava, runner="generate", hf_overrides={"architectures": [EMBED]})


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (
            {"hf_overrides": {"architectures": [CLASSIFIER]}},
            f"{CLASSIFIER}: multimodal models are not supported",
        ),
        (
            {"convert": "classify", "hf_overrides": {"num_labels": 2}},
            "LlamaForSequenceClassification of LlavaForConditionalGeneration: sequence classif",
        ),
    ],
)
def test_a_vlm_classifier_is_refused_by_name(llava, kw: dict, match: str) -> None:  # noqa: F811
    with pytest.raises(ValueError, match=f"model_impl='transformers': .*{match}"):
        _llm(llava, runner="pooling", **kw)
